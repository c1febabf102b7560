//! Helpers for tests that run the real `runner` binary.
#![allow(dead_code)]
pub mod committed;
pub mod slurm;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn runner() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_runner"));
    // The tests' own environment must not leak config values into the runs.
    for (k, _) in std::env::vars() {
        // A test suite run inside a Slurm job must not make every run an srun task.
        if k.starts_with("RUNNER_")
            || k.starts_with("SLURM_")
            || ["RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"].contains(&k.as_str())
        {
            c.env_remove(k);
        }
    }
    // The plan's table is fitted to COLUMNS where it is set: the tests read it unfitted.
    c.env_remove("COLUMNS");
    c
}

pub fn run(args: &[&str], dir: &Path) -> Output {
    output_within(runner().args(args).current_dir(dir), HANG)
}

/// How long one command of a test may take before it counts as hung: far beyond any test's
/// command, far below CI's limit, so that a hang fails its test with what it printed instead of
/// holding the whole suite until CI is killed.
pub const HANG: std::time::Duration = std::time::Duration::from_secs(900);

/// `cmd`'s output, as `Command::output`, in its own process group; past `limit` the group (the
/// launcher and its ranks) is killed and the test fails with what the command printed so far.
pub fn output_within(cmd: &mut Command, limit: std::time::Duration) -> Output {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let mut child = cmd
        .process_group(0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the command starts");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = r.read_to_end(&mut bytes);
            bytes
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > limit {
            let group = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    match status {
        Some(status) => Output { status, stdout, stderr },
        None => panic!(
            "{cmd:?} hung: killed after {limit:?}\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

pub fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

pub fn assert_ok(o: &Output) {
    let (out, err) = text(o);
    assert!(o.status.success(), "runner failed ({}):\nstdout:\n{out}\nstderr:\n{err}", o.status);
}

/// A small, quick pipeline: 600 training rows × 5 features, 3 classes.
pub const TINY: &str = r#"
[run]
name = "tiny"
seed = 3
world_size = 2
timeout_s = 30

[load]
rows = 600
features = 5
classes = 3
validation_rows = 100

[wrap.model]
hidden = [16]

[train]
epochs = 2
batch_size = 16
"#;

/// A small language model on `book.txt` ([`book`]): each rank's 2 threads as two thread replicas
/// of one thread; 40 windows of 16 characters, 8 of them held out for validation.
pub const SMALL_LM: &str = r#"
[run]
name = "threads"
seed = 5
timeout_s = 60
threads_per_rank = 2

[load]
source = "text"
path = "book.txt"
rows = 40

[normalize]
method = "none"

[wrap]
threads_per_replica = 1

[wrap.model]
kind = "transformer"
vocab = 256
d_model = 32
heads = 4
layers = 2
seq_len = 16
tied = true
bias = false

[train]
epochs = 3
batch_size = 8
optimizer = "adamw"
lr = 0.002
clip_grad_norm = 1.0

[validate]
rows = 8
"#;

/// A text for [`SMALL_LM`]: 400 numbered lines of one sentence.
pub fn book() -> String {
    (0..400).map(|i| format!("{i}: to be, or not to be, that is the question. ")).collect()
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Spawning with captured output, for processes that must run at the same time.
pub trait OutputLater {
    fn output_later(&mut self) -> std::process::Child;
}

impl OutputLater for Command {
    fn output_later(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("runner starts")
    }
}

/// The pids whose parent is `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // The parent pid is the 4th field, after the parenthesised command name.
            stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok()) == Some(pid)
        })
        .collect()
}

/// Whether `pid` is a live (not zombie) process.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')))
}

/// Runs `runner run p.toml --out OUT EXTRA...` in `dir` and kills rank `victim` (SIGKILL) as soon
/// as the epoch-2 checkpoint exists; the run must then fail (exit 1), not have ended already.
/// Returns what the launcher wrote on stderr.
pub fn run_and_kill(dir: &Path, out: &str, extra: &[&str], victim: usize) -> String {
    run_and_kill_at(dir, out, extra, victim, "epoch-0002/index.json")
}

/// As [`run_and_kill`], killing rank `victim` as soon as `checkpoints/MARKER` exists.
pub fn run_and_kill_at(dir: &Path, out: &str, extra: &[&str], victim: usize, marker: &str) -> String {
    use std::time::{Duration, Instant};
    let mut launcher = runner()
        .args([&["run", "p.toml", "--out", out][..], extra].concat())
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let marker = dir.join(out).join("checkpoints").join(marker);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "no checkpoint {}", marker.display());
        std::thread::sleep(Duration::from_millis(5));
    }
    let rank_pid = children(launcher.id())
        .into_iter()
        .find(|p| {
            let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            env.split(|b| *b == 0).any(|v| v == format!("RANK={victim}").as_bytes())
        })
        .expect("the rank process");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(rank_pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let status = launcher.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(launcher.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "the kill must land before the run ends:\n{err}");
    err
}

/// Whether a trace column measures time or the process's resident memory: what differs between
/// two runs of the same configuration by nature.
pub fn measured(column: &str) -> bool {
    runner::sweep::check::TIMING_COLUMNS.contains(&column)
}

/// Whether `run_dir` holds a complete checkpoint (a checkpoint's directory with its index).
pub fn has_checkpoint(run_dir: &Path) -> bool {
    std::fs::read_dir(run_dir.join("checkpoints"))
        .is_ok_and(|d| d.filter_map(|e| e.ok()).any(|e| e.path().join("index.json").is_file()))
}

/// The tensor files of checkpoint `name` of `run_dir` (`rank-R.safetensors`, by name), their
/// bytes one after another: two checkpoints with equal bytes hold the same state, bit for bit.
pub fn checkpoint_bytes(run_dir: &Path, name: &str) -> Vec<u8> {
    let dir = run_dir.join("checkpoints").join(name);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no tensor file", dir.display());
    files.iter().flat_map(|f| std::fs::read(f).unwrap()).collect()
}

/// Asserts that two run directories' traces agree in every column but the timings.
pub fn assert_same_trace(a: &Path, b: &Path) {
    let (a, b) = (trace(a), trace(b));
    assert_eq!(a.height(), b.height(), "trace rows");
    for name in a.get_column_names() {
        if name == "run_id" || measured(name) {
            continue;
        }
        assert_eq!(a.column(name).unwrap(), b.column(name).unwrap(), "column {name} differs");
    }
}

/// The plan's whole-process estimate of each rank's memory (plan.json's `memory`: the training
/// state, activations, data and libtorch) is within 15% of every rank's measured peak resident
/// memory (the trace's `peak_rss_bytes`).
pub fn assert_estimate_holds(run_dir: &Path) {
    use polars::prelude::*;
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("plan.json")).unwrap()).unwrap();
    // Under a pipeline each rank's own (its stage's), else the one estimate of every rank.
    let part = |rank: u64, k: &str| match plan["memory_by_rank"].get(rank as usize) {
        Some(own) => own[k].as_f64().unwrap(),
        None => plan["memory"][k].as_f64().unwrap(),
    };
    // The estimate is a release build's: a debug build's own code is about 28 MiB larger.
    let debug_code = if cfg!(debug_assertions) { 28.0 * 1048576.0 } else { 0.0 };
    let t = trace(run_dir);
    let ranks = t.column("rank").unwrap().cast(&DataType::UInt64).unwrap();
    let peaks = t.column("peak_rss_bytes").unwrap().u64().unwrap().clone();
    for (rank, peak) in ranks.u64().unwrap().into_no_null_iter().zip(peaks.into_no_null_iter()) {
        let estimate: f64 =
            ["model", "activations", "data", "base"].iter().map(|k| part(rank, k)).sum::<f64>() + debug_code;
        let off = (estimate - peak as f64) / peak as f64;
        assert!(
            off.abs() <= 0.15,
            "{} rank {rank}: estimated {:.0} MiB, peak {:.0} MiB ({:+.1}%)",
            run_dir.display(),
            estimate / 1048576.0,
            peak as f64 / 1048576.0,
            100.0 * off
        );
    }
}

/// A run directory's trace.parquet, read back by polars.
pub fn trace(dir: &Path) -> polars::prelude::DataFrame {
    use polars::prelude::{ParquetReader, SerReader};
    let file = std::fs::File::open(dir.join("trace.parquet")).expect("trace.parquet");
    ParquetReader::new(file).finish().unwrap()
}

/// The test suite's Python (torch 2.13.0 and scripts/test-requirements.txt), installed by
/// `scripts/setup.sh --tests`. Missing, a test fails and says how to install it: it never skips.
pub fn reference_python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".deps/reference/bin/python");
    let stamp = Path::new(env!("CARGO_MANIFEST_DIR")).join(".deps/reference/.test-requirements");
    assert!(
        python.exists() && stamp.exists(),
        "the tests' Python environment is missing: run ./scripts/setup.sh --tests (the README's test command does)"
    );
    python
}

/// A test that cannot run here for a reason the machine can fix (not root, a missing tool):
/// under `CI=true` (or `CI=1`) it fails with `why`; elsewhere it prints a loud SKIPPED line to
/// stderr and the caller returns. Never a silent pass in CI.
pub fn cannot_run(test: &str, why: &str) {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    assert!(!ci, "{test} cannot run under CI=true: {why}");
    eprintln!("\n********** SKIPPED {test}: {why} (fails under CI=true) **********\n");
}

/// A name no other test of this run (any test binary, any thread) uses: `prefix`, this process's
/// id and a per-process counter. Kernel interface names allow 15 bytes: keep `prefix` short.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}{}x{n}", std::process::id() % 1_000_000)
}

/// Copies the directory `from` to `to`, recursively (a committed sweep, to report on in a temporary place).
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// A column of the trace's rank-0 rows.
pub fn rank0(dir: &Path, col: &str) -> Vec<f64> {
    use polars::prelude::ChunkCompareEq;
    let df = trace(dir);
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    df.filter(&mask).unwrap().column(col).unwrap().f64().unwrap().into_no_null_iter().collect()
}

/// `a` and `b` end within `tol`: the trace's global losses (relative) and every tensor of
/// model.safetensors (absolute).
pub fn assert_close_runs(a: &Path, b: &Path, tol: f64) {
    for col in ["global_train_loss", "val_loss"] {
        let (x, y) = (rank0(a, col), rank0(b, col));
        assert_eq!(x.len(), y.len(), "{col}");
        for (e, (x, y)) in x.iter().zip(&y).enumerate() {
            assert!(((x - y) / y).abs() <= tol, "{col}, row {e}: {x} against {y}");
        }
    }
    let model = |d: &Path| -> std::collections::BTreeMap<String, tch::Tensor> {
        tch::Tensor::read_safetensors(d.join("model.safetensors")).unwrap().into_iter().collect()
    };
    let (x, y) = (model(a), model(b));
    assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
    for (name, t) in &x {
        let diff = (t - &y[name]).abs().max().double_value(&[]);
        assert!(diff <= tol, "model.safetensors `{name}` differs by {diff}");
    }
}

/// README.md and every page under docs/, in a stable order.
pub fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "md") {
                out.push(p);
            }
        }
    }
    let mut out = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")];
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("docs"), &mut out);
    out
}
