//! The newest features under hostile input, class by class: waits that must end (a store that
//! accepts and never answers, a rank that never joins), the preemption signal at any moment,
//! libtorch's own output kept off the terminal and messages that name the real cause, outputs
//! that never replace their inputs or stay half-made, `predict`, configuration that does what it
//! says, and values from the environment and the tracker. Every case pins its message and exit
//! code, and checks that no C++ frame or libtorch log line reached the terminal, that the process
//! ended within its bound, and that nothing was lost (manifests, inputs, earlier files).
use crate::common;

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{runner, write, TINY};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// How a command ended, and what it said.
struct Ended {
    status: ExitStatus,
    out: String,
    err: String,
    took: Duration,
}

impl Ended {
    fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

/// A command running with its output read as it comes (a full pipe never blocks it).
struct Running {
    child: Child,
    out: JoinHandle<String>,
    err: JoinHandle<String>,
    start: Instant,
}

impl Running {
    fn start(cmd: &mut Command) -> Running {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("runner starts");
        let start = Instant::now();
        let drain = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut s = Vec::new();
                let _ = r.read_to_end(&mut s);
                String::from_utf8_lossy(&s).into_owned()
            })
        };
        let out = drain(Box::new(child.stdout.take().unwrap()));
        let err = drain(Box::new(child.stderr.take().unwrap()));
        Running { child, out, err, start }
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Waits at most `bound` (then kills it: a hang is a failure).
    fn end(mut self, bound: Duration) -> Ended {
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let took = self.start.elapsed();
                return Ended { status, out: self.out.join().unwrap(), err: self.err.join().unwrap(), took };
            }
            if self.start.elapsed() > bound {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("still running after {bound:?} (a hang); it said:\n{}", self.err.join().unwrap());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn ended(cmd: &mut Command, bound: Duration) -> Ended {
    Running::start(cmd).end(bound)
}

/// `runner ARGS` in `dir`.
fn cmd(dir: &Path, args: &[&str]) -> Command {
    let mut c = runner();
    c.args(args).current_dir(dir);
    c
}

/// Nothing of libtorch's own reached the terminal, and the process was not a panic.
fn clean(e: &Ended) {
    for text in [&e.out, &e.err] {
        for bad in
            ["Exception raised from", "(most recent call first)", "[c10d]", "frame #", "panicked", "RUST_BACKTRACE"]
        {
            assert!(!text.contains(bad), "{bad:?} reached the terminal:\n{text}");
        }
    }
    assert_ne!(e.code(), Some(101), "a panic's exit code:\n{}", e.err);
}

/// Refused: exit `code`, `says` in the error output, clean, within `bound`.
fn refused(e: &Ended, code: i32, says: &str) {
    clean(e);
    assert_eq!(e.code(), Some(code), "exit code; it said:\n{}{}", e.out, e.err);
    assert!(e.err.contains(says), "expected {says:?} in:\n{}", e.err);
}

fn manifest(run_dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(run_dir.join("manifest.json")).expect("a manifest");
    serde_json::from_str(&text).unwrap()
}

/// A TCP listener on a free loopback port that accepts every connection and never says a word:
/// a store that hangs, or another program on the port. Counts the connections it took.
struct Silent {
    port: u16,
    accepted: Arc<AtomicUsize>,
}

fn silent() -> Silent {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
            count.fetch_add(1, Ordering::SeqCst);
        }
    });
    Silent { port, accepted }
}

/// A loopback port nothing listens on (bound, read, released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Waits until `listener` has taken a connection: the process is inside its wait.
fn connected(listener: &Silent) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while listener.accepted.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "nothing connected to the listener");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The torchrun variables of rank `rank` of 2 against 127.0.0.1:`port`.
fn torchrun_rank(c: &mut Command, rank: usize, port: u16) -> &mut Command {
    c.env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
}

// ---------------------------------------------------------------------------------------------
// 1. Nothing waits forever.

#[test]
fn a_node_facing_a_store_that_never_answers_fails_within_its_bound_and_a_signal_ends_its_wait() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    let store = silent();
    let port = store.port.to_string();
    let node1 = |timeout: &str, out: &str| {
        let mut c = cmd(
            d,
            &["run", "p.toml", "--set", timeout, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"],
        );
        c.args(["--master-port", &port, "--out", out]);
        c
    };
    // Bounded by run.timeout_s (2 s), plus a second's grace for c10d's own timeout.
    let e = ended(&mut node1("run.timeout_s=2", "failed"), Duration::from_secs(30));
    let says = format!(
        "error: cannot join node 0's rendezvous store at 127.0.0.1:{port}: no answer in 2 s: the server accepted the \
         connection but does not reply; check that node 0's `runner run` is up and serving this address and port \
         (run.timeout_s = 2 s bounds the wait)"
    );
    refused(&e, 1, &says);
    // Node 0 owns the run directory (docs/guide/slurm.md): a node that never heard from it writes
    // nothing there, not even a failed manifest.
    assert!(!d.join("failed/manifest.json").exists());

    // Waiting (run.timeout_s = 60), the node ends at once on SIGTERM, and on the preemption signal.
    for (sig, code, status, says) in [
        (Signal::SIGTERM, 143, "interrupted", "interrupted by SIGTERM before any rank started: nothing was written"),
        (Signal::SIGUSR1, 138, "preempted", "interrupted by SIGUSR1 before any rank started: nothing was written"),
    ] {
        let out = format!("waiting-{status}");
        let before = store.accepted.load(Ordering::SeqCst);
        let running = Running::start(&mut node1("run.timeout_s=60", &out));
        let deadline = Instant::now() + Duration::from_secs(60);
        while store.accepted.load(Ordering::SeqCst) == before {
            assert!(Instant::now() < deadline, "the node never connected");
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(200));
        kill(running.pid(), sig).unwrap();
        let sent = Instant::now();
        let e = running.end(Duration::from_secs(60));
        assert!(sent.elapsed() < Duration::from_secs(3), "{sig}: ended {:?} after the signal", sent.elapsed());
        refused(&e, code, says);
        assert!(!d.join(&out).join("manifest.json").exists(), "{status}: the node wrote a manifest");
    }
}

#[test]
fn a_torchrun_rank_facing_a_store_that_never_answers_fails_within_its_bound_and_sigterm_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    let store = silent();
    let e = ended(
        torchrun_rank(&mut cmd(d, &["run", "p.toml", "--set", "run.timeout_s=2"]), 1, store.port),
        Duration::from_secs(30),
    );
    refused(
        &e,
        1,
        &format!(
            "error: rank 1: cannot join rank 0's rendezvous store at 127.0.0.1:{}: no answer in 2 s: the server \
             accepted the connection but does not reply; check that rank 0's `runner run` is up and serving this \
             address and port (run.timeout_s = 2 s bounds the wait)",
            store.port
        ),
    );
    // A rank keeps SIGTERM's default action: in the middle of the wait, it ends at once.
    let running =
        Running::start(torchrun_rank(&mut cmd(d, &["run", "p.toml", "--set", "run.timeout_s=60"]), 1, store.port));
    connected(&store);
    std::thread::sleep(Duration::from_millis(200));
    kill(running.pid(), Signal::SIGTERM).unwrap();
    let sent = Instant::now();
    let e = running.end(Duration::from_secs(60));
    assert!(sent.elapsed() < Duration::from_secs(3), "ended {:?} after SIGTERM", sent.elapsed());
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(e.status.signal(), Some(15), "{}", e.err);
    clean(&e);
}

#[test]
fn a_lone_torchrun_rank_0_names_the_rank_that_never_joined() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    let e = ended(
        torchrun_rank(&mut cmd(d, &["run", "p.toml", "--set", "run.timeout_s=2"]), 0, free_port()),
        Duration::from_secs(30),
    );
    refused(
        &e,
        1,
        "error: rank 0: rank 1 never joined within run.timeout_s (2 s): start all 2 ranks, each with the same \
         MASTER_ADDR and MASTER_PORT",
    );
    assert!(!e.err.contains("store.get"), "{}", e.err);
}

// ---------------------------------------------------------------------------------------------
// 3. Messages that name the real cause.

/// The Slurm variables of task 0 of a 3-task step on one node.
fn srun_task0(c: &mut Command, port: u16) -> &mut Command {
    for (k, v) in [
        ("SLURM_STEP_ID", "0"),
        ("SLURM_PROCID", "0"),
        ("SLURM_STEP_NUM_TASKS", "3"),
        ("SLURM_STEP_NUM_NODES", "1"),
        ("SLURM_NODEID", "0"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_STEP_TASKS_PER_NODE", "3"),
        ("SLURM_JOB_NODELIST", "localhost"),
        ("SLURM_JOB_ID", "4242"),
    ] {
        c.env(k, v);
    }
    c.env("MASTER_PORT", port.to_string())
}

#[test]
fn slurm_and_runner_variables_are_named_as_the_variables_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    let bound = Duration::from_secs(30);
    let slurm = |vars: &[(&str, &str)]| {
        let mut c = cmd(d, &["run", "p.toml", "--out", "o"]);
        for (k, v) in vars {
            c.env(k, v);
        }
        ended(&mut c, bound)
    };
    let e = slurm(&[("SLURM_NNODES", "2"), ("SLURM_NODEID", "5")]);
    refused(&e, 2, "error: SLURM_NODEID=5 must be below SLURM_NNODES=2");
    let e = slurm(&[
        ("SLURM_NNODES", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_JOB_NODELIST", "node[01-"),
        ("SLURM_JOB_ID", "7"),
    ]);
    refused(&e, 2, "error: SLURM_JOB_NODELIST=\"node[01-\": unbalanced brackets in the Slurm host list \"node[01-\"; pass --master-addr HOST");
    let e = slurm(&[("SLURM_NNODES", "two")]);
    refused(&e, 2, "error: SLURM_NNODES=\"two\" is not a number (it gives --nnodes under Slurm)");
    let e = slurm(&[("SLURM_NNODES", "2"), ("SLURM_NODEID", "1")]);
    refused(&e, 2, "error: SLURM_NNODES=2 needs --master-addr, the address of node 0 that every node can reach");
    // The flags, when given, are named as flags.
    let e = ended(&mut cmd(d, &["run", "p.toml", "--nnodes", "2", "--node-rank", "5"]), bound);
    refused(&e, 2, "error: --node-rank 5 must be below --nnodes 2");

    // Task 0 of 3 whose pipeline says 2 ranks: refused at once, not after waiting for tasks 1 and 2.
    let e = ended(srun_task0(&mut cmd(d, &["run", "p.toml", "--set", "run.timeout_s=60"]), free_port()), bound);
    refused(
        &e,
        2,
        "error: rank 0: srun started 3 tasks (SLURM_STEP_NUM_TASKS=3), one rank each, but run.world_size is 2; pass \
         --set run.world_size=3, or start 2 ranks",
    );
    assert!(e.took < Duration::from_secs(20), "refused after {:?}", e.took);

    // RUNNER_SECTION__KEY variables are named whole.
    let e = ended(cmd(d, &["validate", "p.toml"]).env("RUNNER_FOO__BAR", "1"), bound);
    refused(&e, 2, "error: environment variable RUNNER_FOO__BAR: unknown key `foo`");
    let e = ended(cmd(d, &["validate", "p.toml"]).env("RUNNER_TRAIN__LRR", "1"), bound);
    refused(&e, 2, "error: environment variable RUNNER_TRAIN__LRR: unknown key `train.lrr`; did you mean `train.lr`?");
}

// ---------------------------------------------------------------------------------------------
// 2. A preemption is always a preemption.

/// Four epochs of TINY: about a second of training after a second of starting.
fn four_epochs() -> String {
    TINY.replace("epochs = 2", "epochs = 4")
}

/// Waits until the runner's own first instruction has run: its pre-init hook blocked the signals.
/// (Before it, the dynamic loader relocates libtorch: no code of the runner's runs there.)
fn set_up(pid: Pid) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return };
        // Signals blocked (the hook ran), or handlers installed (after it: Rust's runtime, then
        // the runner's own setup).
        let set = |field: &str| {
            status.lines().find_map(|l| l.strip_prefix(field)).is_some_and(|v| v.trim().chars().any(|c| c != '0'))
        };
        if set("SigBlk:") || set("SigCgt:") {
            return;
        }
        assert!(Instant::now() < deadline, "the runner never started");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn the_preemption_signal_at_twenty_moments_of_the_first_two_seconds_preempts_and_the_run_resumes_exactly() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &four_epochs());
    let reference = ended(&mut cmd(d, &["run", "p.toml", "--out", "reference"]), Duration::from_secs(120));
    assert_eq!(reference.code(), Some(0), "{}", reference.err);
    let model = std::fs::read(d.join("reference/model.safetensors")).unwrap();
    let mut seen = Vec::new();
    for i in 0..20u64 {
        let out = format!("o{i}");
        let mut c = cmd(d, &["run", "p.toml", "--out", &out]);
        // Its own process group: the odd moments signal the launcher and its ranks at once.
        c.process_group(0);
        let running = Running::start(&mut c);
        set_up(running.pid());
        std::thread::sleep(Duration::from_millis(100 * i));
        let target = if i % 2 == 0 { running.pid() } else { Pid::from_raw(-running.pid().as_raw()) };
        let _ = kill(target, Signal::SIGUSR1);
        let e = running.end(Duration::from_secs(120));
        clean(&e);
        let run_dir = d.join(&out);
        let m = manifest(&run_dir);
        match e.code() {
            Some(0) => assert_eq!(m["status"], "complete", "moment {i}: {m}"),
            Some(138) => {
                assert_eq!(m["status"], "preempted", "moment {i}: {m}\n{}", e.err);
                assert!(e.err.contains("preempted "), "moment {i}: {}", e.err);
                // The same command resumes it (or starts it over), to the uninterrupted run's end.
                let resumed = ended(&mut cmd(d, &["run", "p.toml", "--out", &out]), Duration::from_secs(120));
                clean(&resumed);
                assert_eq!(resumed.code(), Some(0), "moment {i}: the resume failed:\n{}", resumed.err);
                assert_eq!(manifest(&run_dir)["status"], "complete");
            }
            _ => panic!("moment {i}: {} (manifest {m}):\n{}", e.status, e.err),
        }
        assert!(std::fs::read(run_dir.join("model.safetensors")).unwrap() == model, "moment {i}: another model");
        common::assert_same_trace(&d.join("reference"), &run_dir);
        seen.push((i, e.code(), m["preempted_at_step"].clone()));
    }
    eprintln!("moment, exit code, preempted at step: {seen:?}");
}

#[test]
fn a_preemption_signal_that_reaches_one_rank_only_preempts_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &TINY.replace("epochs = 2", "epochs = 30"));
    let running = Running::start(&mut cmd(d, &["run", "p.toml", "--out", "o"]));
    let deadline = Instant::now() + Duration::from_secs(60);
    // Rank 1, once the run trains (its first interval is in the trace).
    let rank1 = loop {
        let ranks = common::children(running.child.id());
        let rank1 = ranks.into_iter().find(|p| {
            let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            env.split(|b| *b == 0).any(|v| v == b"RANK=1")
        });
        if let (Some(pid), true) = (rank1, d.join("o/trace.parquet").exists()) {
            break pid;
        }
        assert!(Instant::now() < deadline, "the run did not train");
        std::thread::sleep(Duration::from_millis(10));
    };
    kill(Pid::from_raw(rank1 as i32), Signal::SIGUSR1).unwrap();
    let e = running.end(Duration::from_secs(60));
    refused(&e, 138, ": checkpoint written; the same command, or runner run --resume o, continues it");
    assert!(!e.err.contains("failed"), "{}", e.err);
    let m = manifest(&d.join("o"));
    assert_eq!(m["status"], "preempted", "{m}");
    assert!(m["preempted_at_step"].as_u64().unwrap() > 0, "{m}");
    let resumed = ended(&mut cmd(d, &["run", "p.toml", "--out", "o"]), Duration::from_secs(120));
    assert_eq!(resumed.code(), Some(0), "{}", resumed.err);
    clean(&resumed);
}

// ---------------------------------------------------------------------------------------------
// 5. Outputs that never replace their inputs and never stay half-made.

/// The files in `dir`, sorted, each with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_file())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect();
    out.sort();
    out
}

#[test]
fn prepare_never_replaces_its_input_or_files_it_was_not_told_to_and_writes_all_three_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bound = Duration::from_secs(30);
    write(d, "a.txt", &"to be or not to be\n".repeat(50));
    let e = ended(&mut cmd(d, &["prepare", "text", "a.txt", "--out", "data"]), bound);
    assert_eq!(e.code(), Some(0), "{}", e.err);
    let prepared = files(&d.join("data"));
    assert_eq!(prepared.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(), ["meta.json", "train.bin", "val.bin"]);

    // Its own output as its input: refused, even with --force, and the file is untouched.
    for force in [&[][..], &["--force"][..]] {
        let e = ended(cmd(d, &["prepare", "text", "data/train.bin", "--out", "data"]).args(force), bound);
        refused(
            &e,
            2,
            "error: data/train.bin is the input itself: prepare would replace the text with its token ids; choose \
             another --out",
        );
        assert_eq!(files(&d.join("data")), prepared, "nothing changed");
    }
    // Files already there are replaced only with --force.
    write(d, "b.txt", &"all the world's a stage\n".repeat(50));
    let e = ended(&mut cmd(d, &["prepare", "text", "b.txt", "--out", "data"]), bound);
    refused(
        &e,
        2,
        "error: data already holds data/train.bin, data/val.bin, data/meta.json: pass --force to replace them, or \
         choose another --out",
    );
    assert_eq!(files(&d.join("data")), prepared, "nothing changed");
    let e = ended(&mut cmd(d, &["prepare", "text", "b.txt", "--out", "data", "--force"]), bound);
    assert_eq!(e.code(), Some(0), "{}", e.err);
    clean(&e);
    let replaced = files(&d.join("data"));
    assert_eq!(replaced.len(), 3);
    assert!(replaced.iter().zip(&prepared).all(|(a, b)| a.1 != b.1), "all three replaced");

    // A text too short to split gives no files.
    for (text, says) in [
        ("x", "x.txt holds 1 character: train.bin (the first 90%) and val.bin (the rest) need one each at least; give a longer text"),
        ("", "x.txt is empty: there is nothing to prepare"),
    ] {
        write(d, "x.txt", text);
        let e = ended(&mut cmd(d, &["prepare", "text", "x.txt", "--out", "short"]), bound);
        refused(&e, 2, says);
        assert!(!d.join("short/train.bin").exists() && !d.join("short/val.bin").exists());
    }
}

/// A tmpfs of `kib` KiB mounted on a fresh directory, unmounted when dropped.
struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    fn new(kib: u64) -> Result<SmallDisk, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("not root".into());
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            Ok(SmallDisk(dir))
        } else {
            Err("mount -t tmpfs failed".into())
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

#[test]
fn prepare_that_cannot_write_its_last_file_leaves_none_of_the_three() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 30000 characters: train.bin takes 54000 bytes (14 pages), val.bin 6000 (2 pages).
    write(d, "t.txt", &"abcdefghij".repeat(3000));
    let disk = match SmallDisk::new(60) {
        Ok(disk) => disk,
        Err(why) => return common::cannot_run("prepare_that_cannot_write_its_last_file", &why),
    };
    let out = disk.0.path().join("data");
    let e = ended(&mut cmd(d, &["prepare", "text", "t.txt", "--out", out.to_str().unwrap()]), Duration::from_secs(30));
    refused(&e, 1, "cannot write ");
    let left: Vec<String> =
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(left.is_empty(), "left behind: {left:?}\n{}", e.err);
}

// ---------------------------------------------------------------------------------------------
// 6. `predict`.

/// A small language model trained on a prepared text holding an escape sequence; returns its
/// run directory.
fn trained_lm(d: &Path) -> std::path::PathBuf {
    let text = "\u{1b}[2J all the world's a stage\n".repeat(40);
    write(d, "play.txt", &text);
    let e = ended(&mut cmd(d, &["prepare", "text", "play.txt", "--out", "data"]), Duration::from_secs(30));
    assert_eq!(e.code(), Some(0), "{}", e.err);
    let pipeline = r#"
[run]
name = "lm"
seed = 5
world_size = 1
timeout_s = 60

[load]
source = "tokens"
path = "data/train.bin"
validation_path = "data/val.bin"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 32
d_model = 16
heads = 2
layers = 1
seq_len = 8

[train]
steps = 4
batch_size = 4
optimizer = "adamw"
lr = 0.002
"#;
    write(d, "lm.toml", pipeline);
    let e = ended(&mut cmd(d, &["run", "lm.toml", "--out", "lm"]), Duration::from_secs(120));
    assert_eq!(e.code(), Some(0), "{}", e.err);
    d.join("lm")
}

#[test]
fn predict_streams_stops_with_its_reader_checks_its_vocabulary_and_names_an_unfinished_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let lm = trained_lm(d);
    let bound = Duration::from_secs(60);
    let predict = |extra: &[&str]| {
        let mut c = cmd(d, &["predict", "lm", "--prompt", "all "]);
        c.args(extra);
        c
    };

    // A billion tokens into a reader that takes 100 bytes and leaves: the first come at once,
    // and the sampling ends when the reader goes.
    let mut child = predict(&["--tokens", "1000000000"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    let mut first = [0u8; 100];
    child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    assert!(start.elapsed() < Duration::from_secs(30), "100 bytes took {:?}", start.elapsed());
    assert!(first.starts_with(b"all "), "{:?}", String::from_utf8_lossy(&first));
    drop(child.stdout.take());
    let gone = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(gone.elapsed() < Duration::from_secs(20), "still sampling after its reader left");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0));

    // On a terminal, the escape sequence is shown, not obeyed (through a pseudo-terminal).
    let runner_bin = env!("CARGO_BIN_EXE_runner");
    let line = format!("{runner_bin} predict lm --prompt \"$(printf '\\033[2J')\" --tokens 20");
    let e = ended(Command::new("script").args(["-qec", &line, "/dev/null"]).current_dir(d), bound);
    assert_eq!(e.code(), Some(0), "{}{}", e.out, e.err);
    assert!(e.out.contains("\\x1b[2J"), "{:?}", e.out);
    assert!(!e.out.contains('\u{1b}'), "a raw ESC reached the terminal: {:?}", e.out);
    // Into a pipe, the text is written as the model drew it.
    let e = ended(&mut predict(&["--tokens", "5"]), bound);
    assert_eq!(e.code(), Some(0), "{}", e.err);
    assert!(e.out.starts_with("all "), "{:?}", e.out);

    // Temperatures that leave no distribution to draw from.
    let e = ended(&mut predict(&["--temperature", "inf"]), bound);
    refused(&e, 2, "error: --temperature must be a finite number above 0, got inf");
    let e = ended(&mut predict(&["--temperature", "1e-320"]), bound);
    refused(&e, 2, "error: --temperature 1e-320 divides the logits (up to ");
    assert!(e.err.contains("past the largest float; give a larger temperature"), "{}", e.err);

    // Another vocabulary beside the token file: refused by its digest, whatever its size.
    let meta = d.join("data/meta.json");
    let kept = std::fs::read(&meta).unwrap();
    write(d, "other.txt", &"abc".repeat(40));
    let e = ended(&mut cmd(d, &["prepare", "text", "other.txt", "--out", "other"]), bound);
    assert_eq!(e.code(), Some(0), "{}", e.err);
    std::fs::copy(d.join("other/meta.json"), &meta).unwrap();
    let e = ended(&mut predict(&[]), bound);
    refused(&e, 1, "data/meta.json is not the vocabulary this run trained with: it changed since (digest ");
    std::fs::write(&meta, kept).unwrap();

    // A run that did not finish has no model: said with how it ended.
    let unfinished = d.join("unfinished");
    std::fs::create_dir(&unfinished).unwrap();
    for f in ["plan.json", "config.toml", "manifest.json"] {
        std::fs::copy(lm.join(f), unfinished.join(f)).unwrap();
    }
    let mut m = manifest(&lm);
    m["status"] = "failed".into();
    m["failure"] = "rank 1 was killed by SIGKILL during train, epoch 1, step 3".into();
    std::fs::write(unfinished.join("manifest.json"), m.to_string()).unwrap();
    let e = ended(&mut cmd(d, &["predict", "unfinished", "--prompt", "all "]), bound);
    refused(
        &e,
        1,
        "error: unfinished has no model.safetensors: the run did not finish (its manifest says failed: rank 1 was \
         killed by SIGKILL during train, epoch 1, step 3); runner run --resume unfinished continues it from its \
         newest checkpoint",
    );
}

// ---------------------------------------------------------------------------------------------
// 7. Configuration that does what it says.

/// Rank 0's validation metrics per trace row: (val_loss, val_acc).
fn validation(run_dir: &Path) -> Vec<(f64, f64)> {
    let t = common::trace(run_dir);
    let rank = t.column("rank").unwrap().cast(&polars::prelude::DataType::Int64).unwrap();
    let rank = rank.i64().unwrap();
    let (loss, acc) =
        (t.column("val_loss").unwrap().f64().unwrap().clone(), t.column("val_acc").unwrap().f64().unwrap().clone());
    (0..t.height()).filter(|&i| rank.get(i) == Some(0)).map(|i| (loss.get(i).unwrap(), acc.get(i).unwrap())).collect()
}

#[test]
fn split_validation_measures_rank_0_s_normaliser_as_rank0_does() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // pipelines/ddp.toml's scope: each rank normalises by its own shard's statistics.
    let p = format!("{TINY}\n[normalize]\nscope = \"rank\"\n");
    write(d, "p.toml", &p);
    let bound = Duration::from_secs(120);
    for (on, out) in [("rank0", "r"), ("split", "s")] {
        let e = ended(&mut cmd(d, &["run", "p.toml", "--out", out, "--set", &format!("validate.on=\"{on}\"")]), bound);
        assert_eq!(e.code(), Some(0), "{}", e.err);
    }
    let (r, s) = (validation(&d.join("r")), validation(&d.join("s")));
    assert_eq!(r.len(), s.len());
    for ((rl, ra), (sl, sa)) in r.iter().zip(&s) {
        assert!((rl - sl).abs() < 1e-6 && (ra - sa).abs() < 1e-6, "rank0 {r:?}, split {s:?}");
    }
}

#[test]
fn configuration_that_would_not_do_what_it_says_is_refused_naming_where_it_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bound = Duration::from_secs(60);
    let validate = |file: &str, extra: &[&str]| {
        let mut c = cmd(d, &["validate", file]);
        c.args(extra);
        ended(&mut c, bound)
    };
    // The run's length given twice, whichever way round.
    write(d, "epochs.toml", &TINY.replace("epochs = 2", "epochs = 5"));
    let e = validate("epochs.toml", &["--set", "train.steps=5"]);
    refused(&e, 2, "`train.steps` (--set train.steps=5): and train.epochs = 5 (file epochs.toml:18) both set the run's length: keep one");
    write(d, "steps.toml", &TINY.replace("epochs = 2", "steps = 5"));
    let e = validate("steps.toml", &["--set", "train.epochs=5"]);
    refused(&e, 2, "`train.steps` (file steps.toml:18): and train.epochs = 5 (--set train.epochs=5) both set the run's length: keep one");

    // `validate.batches` beyond the validation rows (100 rows: 7 batches of 16).
    let e = validate("epochs.toml", &["--set", "validate.batches=8"]);
    refused(
        &e,
        2,
        "`validate.batches` (--set validate.batches=8): asks for 8 batches of 16, but the validation set holds 100 \
         rows (7 batches): give at most 7, or leave it out to validate on every one",
    );
    assert_eq!(validate("epochs.toml", &["--set", "validate.batches=7"]).code(), Some(0));

    // Learning rates whose schedule leaves float32, the parameters' type.
    let e = validate("epochs.toml", &["--set", "train.lr=1e39"]);
    refused(&e, 2, "`train.lr` (--set train.lr=1e39): the schedule reaches 1e39, beyond float32's largest value");
    let e = validate("epochs.toml", &["--set", "train.lr=1e308", "--set", "train.schedule.warmup_steps=10"]);
    refused(&e, 2, "`train.lr` (--set train.lr=1e308): 1e308 × 10 warmup steps overflows");

    // `extends` given twice.
    write(d, "a.toml", "[train]\nlr = 0.2\n");
    write(d, "b.toml", "[train]\nlr = 0.3\n");
    write(d, "twice.toml", &format!("extends = \"a.toml\"\nextends = \"b.toml\"\n{TINY}"));
    let e = validate("twice.toml", &[]);
    refused(&e, 2, "error: twice.toml:2: `extends` is given twice: a file extends one base");

    // A typo in a base is the base's, at its line: in a table the child sets too, and a misspelt
    // table.
    write(d, "base.toml", &TINY.replace("hidden = [16]", "hidden = [16]\nhiddn = 3"));
    write(d, "child.toml", "extends = \"base.toml\"\n\n[wrap.model]\nhidden = [8]\n");
    let e = validate("child.toml", &[]);
    refused(&e, 2, "error: base.toml:16: unknown key `wrap.model.hiddn`; did you mean `wrap.model.hidden`?");
    write(d, "base.toml", &format!("{TINY}\n[trian]\nlr = 1\n"));
    write(d, "child.toml", "extends = \"base.toml\"\n\n[train]\nlr = 0.05\n");
    let e = validate("child.toml", &[]);
    refused(&e, 2, "error: base.toml:21: unknown key `trian`; did you mean `train`?");

    // A chain deeper than 32 files, and one of 10 000, are refused at once.
    for depth in [40usize, 10_000] {
        let chain = d.join(format!("chain{depth}"));
        std::fs::create_dir(&chain).unwrap();
        write(&chain, "f0.toml", TINY);
        for i in 1..depth {
            write(&chain, &format!("f{i}.toml"), &format!("extends = \"f{}.toml\"\n", i - 1));
        }
        let top = format!("chain{depth}/f{}.toml", depth - 1);
        let e = validate(&top, &[]);
        refused(&e, 2, &format!("error: {top}:1: the extends chain is longer than 32 files ({top} → "));
        assert!(e.took < Duration::from_secs(20), "{depth} files took {:?}", e.took);
    }
}

#[test]
fn config_toml_says_where_each_value_came_from_after_a_resume_with_set() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &format!("{TINY}\n[checkpoint]\nevery = 1\n"));
    let bound = Duration::from_secs(120);
    let e = ended(
        &mut cmd(d, &["run", "p.toml", "--out", "o", "--set", "trace.tensorboard=false", "--set", "train.lr=0.1"]),
        bound,
    );
    assert_eq!(e.code(), Some(0), "{}", e.err);
    let e = ended(
        &mut cmd(d, &["run", "--resume", "o", "--set", "train.epochs=3", "--set", "trace.tensorboard=true"]),
        bound,
    );
    assert_eq!(e.code(), Some(0), "{}", e.err);
    clean(&e);
    let config = std::fs::read_to_string(d.join("o/config.toml")).unwrap();
    for line in [
        "epochs = 3  # --set train.epochs=3 (on resume)",
        "lr = 0.1  # --set train.lr=0.1",
        "tensorboard = true  # --set trace.tensorboard=true",
    ] {
        assert!(config.lines().any(|l| l == line), "no {line:?} in:\n{config}");
    }
}

// ---------------------------------------------------------------------------------------------
// 8. Values from the environment and the tracker.

#[test]
fn environment_and_tracking_values_that_cannot_hold_are_refused_and_a_silent_server_costs_little() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    let bound = Duration::from_secs(60);
    let e = ended(cmd(d, &["validate", "p.toml"]).env("MKL_CBWR", "garbage"), bound);
    refused(&e, 2, "error: MKL_CBWR=\"garbage\" in the environment is not a value MKL knows: MKL would ignore it");
    for ok in ["COMPATIBLE", "AVX2,STRICT", ""] {
        let e = ended(cmd(d, &["validate", "p.toml"]).env("MKL_CBWR", ok), bound);
        assert_eq!(e.code(), Some(0), "MKL_CBWR={ok}: {}", e.err);
    }
    for (url, says) in [
        ("http://127.0.0.1:99999", "port 99999 is not between 1 and 65535"),
        ("http://mlflow host:5000", "is not a URL"),
        ("http://me:s3cret@127.0.0.1:5000", "\"http://me:***@127.0.0.1:5000\" holds credentials"),
    ] {
        let e = ended(&mut cmd(d, &["validate", "p.toml", "--set", &format!("track.mlflow=\"{url}\"")]), bound);
        refused(&e, 2, says);
        assert!(!e.err.contains("s3cret"), "{}", e.err);
    }
    // A server that accepts and never answers: the plan says so, and the run's end waits for it
    // no longer than the plan's probe did.
    let server = silent();
    let url = format!("track.mlflow=\"http://127.0.0.1:{}\"", server.port);
    let e = ended(&mut cmd(d, &["run", "p.toml", "--out", "o", "--set", &url]), Duration::from_secs(120));
    assert_eq!(e.code(), Some(0), "{}", e.err);
    clean(&e);
    assert!(e.out.contains("cannot be reached"), "{}", e.out);
    assert!(e.out.contains("never answered (given 5 s from the run's start); nothing was sent"), "{}", e.out);
    assert!(e.took < Duration::from_secs(40), "the run took {:?}", e.took);
    assert_eq!(manifest(&d.join("o"))["status"], "complete");
}
