//! `runner bench`: the runner against the same pipeline in plain PyTorch
//! (benches/reference/ddp_torch.py under torchrun, with the MLP, or the CNN and the transformer of
//! the twins cnn_torch.py and transformer_torch.py), side by side in one run. For each workload
//! and world size the two alternate, A B A B, so that a change in the machine's load hits both;
//! the results (medians with min–max, ratios, fraction of the matmul peak, the targets) go to
//! benches/RESULTS.md between markers, the notes around them are kept.
//!
//! Both run as their users run them: the runner with its default `run.numerics = "native"` and
//! PyTorch, each with MKL choosing its kernels by the CPU. A third run in each repetition, the
//! runner with `run.numerics = "portable"` (crate::numerics: the same bits on any x86-64 CPU),
//! prices that choice: the cost of reproducible numerics, in the report's own table.
//!
//! The `fsdp` workload measures sharded data parallelism instead: the runner's
//! [`workload::FSDP_STRATEGY`] against PyTorch FSDP2 (benches/reference/fsdp2_torch.py), and as
//! its third run the runner's own DDP step. The `tp` workload measures tensor parallelism: the
//! runner at `[wrap.mesh] tensor = 2` against PyTorch's DTensor (benches/reference/tp_torch.py) at
//! the same mesh, with no third run. Every run's per-rank peak resident memory is measured from
//! outside ([`memory`]), the same way for both sides.
pub mod catalogue;
pub mod files;
pub mod memory;
pub mod peak;
mod report;
pub mod workload;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use tch::Kind;

use crate::config::schema::CpuNumerics;
use workload::{Peer, Workload};

pub struct Options {
    /// One repetition, results printed but not written.
    pub quick: bool,
    pub repetitions: usize,
    pub world_sizes: Vec<usize>,
    /// Workload names; empty: all.
    pub workloads: Vec<String>,
    pub out: PathBuf,
    /// "fp32", "bf16": each workload runs in each.
    pub precisions: Vec<String>,
}

/// One measured run of one side.
#[derive(Debug, Clone)]
pub struct Measure {
    /// Process start to exit.
    pub wall_s: f64,
    /// Median over epochs of the slowest rank's epoch time.
    pub epoch_s: f64,
    /// Training samples per epoch, all ranks.
    pub samples: f64,
    /// Global training loss per epoch.
    pub losses: Vec<f64>,
    /// Each rank's peak resident memory, bytes (rank 0 first).
    pub peak_rss: Vec<u64>,
}

/// Every run of one workload at one world size.
#[derive(Debug, Clone)]
pub struct Cell {
    pub world_size: usize,
    pub threads: usize,
    /// The runner as it runs by default: MKL's kernels for this CPU.
    pub runner: Vec<Measure>,
    pub torch: Vec<Measure>,
    /// The runner with `run.numerics = "portable"` (`MKL_CBWR=COMPATIBLE`), against PyTorch DDP.
    pub runner_portable: Vec<Measure>,
    /// The runner with `wrap.strategy = "ddp"`, against PyTorch FSDP2.
    pub runner_ddp: Vec<Measure>,
}

pub struct WorkloadResult {
    pub workload: Workload,
    pub cells: Vec<Cell>,
}

pub fn bench(opts: &Options) -> anyhow::Result<u8> {
    let root = std::env::current_dir()?;
    let chosen: Vec<Workload> = catalogue::all()
        .into_iter()
        .filter(|w| opts.workloads.is_empty() || opts.workloads.iter().any(|n| n == w.name))
        .collect();
    if let Some(missing) = chosen.iter().map(|w| root.join(w.peer.script())).find(|s| !s.is_file()) {
        bail!("{} not found: run `runner bench` from the repository's root", missing.display());
    }
    let python = reference_python(&root)?;
    let torchrun = python.with_file_name("torchrun");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let work = root.join("target/bench");

    // The peaks are measured before each workload and after the last, and the best is kept: a
    // single measurement on a shared machine can land in a slow moment and flatter the fractions.
    // A precision's peak is measured only when a workload runs in it, each by a probe of about a
    // second (bfloat16's is the ceiling of what bf16 can gain on this CPU).
    let bf16 = opts.precisions.iter().any(|p| p == "bf16");
    let (mut peak, mut peak_bf16) = (0.0f64, if bf16 { 0.0 } else { f64::NAN });
    let mut measure_peak = |when: &str| {
        crate::say!("measuring the matmul peak {when} ({cores} threads, about a second per precision)...");
        peak = peak.max(peak::matmul_peak(cores, Kind::Float, peak::PROBE));
        let mut line = format!("  float32 {:.1} GFLOP/s", peak / 1e9);
        if bf16 {
            peak_bf16 = peak_bf16.max(peak::matmul_peak(cores, Kind::BFloat16, peak::PROBE));
            line += &format!(", bfloat16 {:.1} GFLOP/s", peak_bf16 / 1e9);
        }
        crate::say!("{line} (best so far)");
    };

    let mut results = Vec::new();
    let in_precisions = |w: Workload| {
        let precisions = opts.precisions.iter().filter(|p| *p != "bf16" || w.compute_bound);
        precisions.map(|p| w.clone().in_precision(p == "bf16")).collect::<Vec<_>>()
    };
    for w in chosen.into_iter().flat_map(in_precisions) {
        measure_peak(&format!("before {}", w.name));
        crate::say!("\n{}: {}", w.name, w.describe());
        let files = files::prepare(&w, &work.join(w.name))?;
        let mut cells = Vec::new();
        for &ws in &opts.world_sizes {
            if let Some(why) = skipped(&w, ws) {
                crate::say!("  world size {ws}: skipped ({why})");
                continue;
            }
            let side = Sides { files: &files, w: &w, ws, threads: (cores / ws).max(1) };
            cells.push(side.cell(&torchrun, &root, opts.repetitions)?);
        }
        results.push(WorkloadResult { workload: w, cells });
    }

    measure_peak("at the end");
    let machine = report::Machine::this(cores, peak, peak_bf16);
    let text = report::markdown(&machine, opts.repetitions, &results);
    crate::say!("\n{text}");
    if opts.quick {
        crate::say!("(--quick: {} not written)", opts.out.display());
    } else {
        report::write(&opts.out, &text)?;
        crate::say!("written to {}", opts.out.display());
    }
    Ok(0)
}

/// Why a workload does not run at world size `ws`, if it does not.
fn skipped(w: &Workload, ws: usize) -> Option<String> {
    match w.peer {
        Peer::TorchFsdp2 { .. } if ws < 2 => Some("sharding needs at least 2 ranks".into()),
        Peer::TorchTp { tensor, .. } if ws != tensor => {
            Some(format!("the mesh is tensor {tensor} × data 1: world size {tensor}"))
        }
        _ => None,
    }
}

/// One workload at one world size: what both sides run with.
struct Sides<'a> {
    files: &'a files::Files,
    w: &'a Workload,
    ws: usize,
    threads: usize,
}

impl Sides<'_> {
    /// `repetitions` rounds of runner, PyTorch and the peer's third run, alternating.
    fn cell(&self, torchrun: &Path, root: &Path, repetitions: usize) -> anyhow::Result<Cell> {
        let (files, w, ws, threads) = (self.files, self.w, self.ws, self.threads);
        let mut cell = Cell {
            world_size: ws,
            threads,
            runner: Vec::new(),
            torch: Vec::new(),
            runner_portable: Vec::new(),
            runner_ddp: Vec::new(),
        };
        for rep in 1..=repetitions {
            let r = retried(|| run_runner(files, w, ws, threads, CpuNumerics::Native, None))?;
            let t = retried(|| run_torch(torchrun, &root.join(w.peer.script()), files, w, ws, threads))?;
            let third = self.third()?;
            let third_summary = third.as_ref().map_or(String::new(), |(k, what)| format!(", {what} {}", summary(k)));
            crate::say!(
                "  world size {ws}, run {rep}/{repetitions}: runner {}, PyTorch {}{third_summary}",
                summary(&r),
                summary(&t),
            );
            cell.runner.push(r);
            cell.torch.push(t);
            match (w.peer, third) {
                (Peer::TorchDdp, Some((k, _))) => cell.runner_portable.push(k),
                (Peer::TorchFsdp2 { .. }, Some((k, _))) => cell.runner_ddp.push(k),
                _ => {}
            }
        }
        Ok(cell)
    }

    /// The third run that prices a choice against the peer: portable numerics beside PyTorch DDP,
    /// the runner's DDP beside FSDP2; none beside DTensor.
    fn third(&self) -> anyhow::Result<Option<(Measure, &'static str)>> {
        let (files, w, ws, threads) = (self.files, self.w, self.ws, self.threads);
        Ok(match w.peer {
            Peer::TorchDdp => Some((
                retried(|| run_runner(files, w, ws, threads, CpuNumerics::Portable, None))?,
                "runner with portable numerics",
            )),
            Peer::TorchFsdp2 { .. } => Some((
                retried(|| run_runner(files, w, ws, threads, CpuNumerics::Native, Some("ddp")))?,
                "runner with DDP",
            )),
            Peer::TorchTp { .. } => None,
        })
    }
}

/// "12.34 s (0.567 s/epoch, peak MiB per rank 512 / 498)".
fn summary(m: &Measure) -> String {
    let peaks: Vec<String> = m.peak_rss.iter().map(|b| format!("{:.0}", *b as f64 / (1u64 << 20) as f64)).collect();
    format!("{:.2} s ({:.3} s/epoch, peak MiB per rank {})", m.wall_s, m.epoch_s, peaks.join(" / "))
}

/// The reference's Python, installed on first use by benches/reference/setup.sh.
fn reference_python(root: &Path) -> anyhow::Result<PathBuf> {
    let out = Command::new(root.join("benches/reference/setup.sh"))
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run benches/reference/setup.sh")?;
    if !out.status.success() {
        bail!("the PyTorch reference could not be installed (benches/reference/setup.sh {})", out.status);
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The runner on the workload's pipeline; `strategy`: another `wrap.strategy` than the pipeline's.
fn run_runner(
    files: &files::Files,
    w: &Workload,
    ws: usize,
    threads: usize,
    numerics: CpuNumerics,
    strategy: Option<&str>,
) -> anyhow::Result<Measure> {
    let mut tag = w.precision_tag().to_string();
    if numerics == CpuNumerics::Portable {
        tag += "-portable";
    }
    if let Some(s) = strategy {
        tag += &format!("-{s}");
    }
    let out = files.dir.join(format!("runner{tag}-ws{ws}"));
    let exe = std::env::current_exe().context("cannot find the runner binary")?;
    let mut cmd = Command::new(exe);
    cmd.arg("run")
        .arg(&files.pipeline)
        .args(["--set", &format!("run.world_size={ws}"), "--set", &format!("run.threads_per_rank={threads}")])
        .arg("--out")
        .arg(&out)
        // The bench owns its directories: another thread count is another run id, same place.
        .arg("--force")
        // The key decides, not an MKL_CBWR the bench's caller set.
        .env_remove("MKL_CBWR");
    // Native is the default: the runner as its users run it sets nothing.
    if numerics == CpuNumerics::Portable {
        cmd.args(["--set", "run.numerics=\"portable\""]);
    }
    if w.bf16 {
        cmd.args(["--set", "train.precision=\"bf16\""]);
    }
    if let Some(s) = strategy {
        cmd.args(["--set", &format!("wrap.strategy=\"{s}\"")]);
    }
    let (wall_s, peak_rss) = timed(cmd, ws, &files.dir.join(format!("runner{tag}-ws{ws}.log")))?;
    let df = crate::trace::read_parquet(&out.join(crate::rundir::TRACE))?;
    let col = |c: &str| -> anyhow::Result<Vec<f64>> {
        Ok(df.column(c)?.cast(&polars::prelude::DataType::Float64)?.f64()?.into_no_null_iter().collect())
    };
    let (epoch, epoch_s, loss, samples) = (col("epoch")?, col("epoch_s")?, col("global_train_loss")?, col("samples")?);
    let epochs = epoch.iter().fold(0.0f64, |m, e| m.max(*e)) as usize;
    let mut slowest = vec![0.0f64; epochs];
    let mut losses = vec![0.0; epochs];
    let mut per_epoch_samples = vec![0.0; epochs];
    for i in 0..epoch.len() {
        let e = epoch[i] as usize - 1;
        slowest[e] = slowest[e].max(epoch_s[i]);
        losses[e] = loss[i];
        per_epoch_samples[e] += samples[i];
    }
    // The ranks of a tensor group train the same samples: each counted once.
    let samples = per_epoch_samples[0] / w.peer.tensor() as f64;
    Ok(Measure { wall_s, epoch_s: report::median(&slowest), samples, losses, peak_rss })
}

/// The workload's peer, PyTorch DDP, FSDP2 or DTensor tensor parallelism, running `script`.
fn run_torch(
    torchrun: &Path,
    script: &Path,
    files: &files::Files,
    w: &Workload,
    ws: usize,
    threads: usize,
) -> anyhow::Result<Measure> {
    match w.peer {
        Peer::TorchDdp => run_torch_ddp(torchrun, script, files, w, ws, threads),
        Peer::TorchFsdp2 { .. } | Peer::TorchTp { .. } => run_torch_lm(torchrun, script, files, w, ws, threads),
    }
}

fn run_torch_ddp(
    torchrun: &Path,
    script: &Path,
    files: &files::Files,
    w: &Workload,
    ws: usize,
    threads: usize,
) -> anyhow::Result<Measure> {
    let tag = w.precision_tag();
    let result = files.dir.join(format!("torch{tag}-ws{ws}.json"));
    let _ = std::fs::remove_file(&result);
    let mut cmd = Command::new(torchrun);
    cmd.args(["--standalone", &format!("--nproc_per_node={ws}")])
        .arg(script)
        .arg(&files.data)
        .arg("--model")
        .arg(&files.model)
        .arg("--init")
        .arg(&files.init)
        .args(["--batch", &w.batch.to_string(), "--epochs", &w.epochs.to_string()])
        .args(["--optimizer", &w.optimizer_name(), "--lr", &w.lr.to_string()])
        .args(["--weight-decay", &w.weight_decay.to_string()])
        .args(["--threads", &threads.to_string()])
        .arg("--out")
        .arg(&result)
        .env("OMP_NUM_THREADS", threads.to_string())
        // PyTorch as its users run it: the bench itself runs under the runner's MKL_CBWR.
        .env_remove("MKL_CBWR");
    if w.bf16 {
        cmd.args(["--precision", "bf16"]);
    }
    let (wall_s, peak_rss) = timed(cmd, ws, &files.dir.join(format!("torch{tag}-ws{ws}.log")))?;
    let (epoch_s, losses, samples) = reference_epochs(&result, "epochs", "epoch_s", "PyTorch DDP")?;
    Ok(Measure { wall_s, epoch_s: report::median(&epoch_s), samples, losses, peak_rss })
}

/// The per-epoch seconds and losses, and the first epoch's samples, from a reference's JSON
/// result: `list` names its array of epochs, `seconds` their time.
fn reference_epochs(result: &Path, list: &str, seconds: &str, who: &str) -> anyhow::Result<(Vec<f64>, Vec<f64>, f64)> {
    let text = std::fs::read_to_string(result).with_context(|| format!("{who} wrote no {}", result.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let rows = v[list].as_array().filter(|r| !r.is_empty()).with_context(|| format!("no {list} in {who}'s result"))?;
    let get = |e: &serde_json::Value, k: &str| e[k].as_f64().with_context(|| format!("no {k} in {who}'s result"));
    let epoch_s = rows.iter().map(|e| get(e, seconds)).collect::<anyhow::Result<_>>()?;
    let losses = rows.iter().map(|e| get(e, "loss")).collect::<anyhow::Result<_>>()?;
    Ok((epoch_s, losses, get(&rows[0], "samples")?))
}

/// PyTorch FSDP2 or DTensor tensor parallelism (the twins of the runner's language model, with
/// one command line) on the workload's token file, from the same initial weights, a row per epoch.
fn run_torch_lm(
    torchrun: &Path,
    script: &Path,
    files: &files::Files,
    w: &Workload,
    ws: usize,
    threads: usize,
) -> anyhow::Result<Measure> {
    let workload::Kind::Transformer(t) = &w.kind else {
        bail!("the {} workload: {} runs a language model", w.name, w.peer.script())
    };
    let (name, who) = match w.peer {
        Peer::TorchTp { .. } => ("tp", "PyTorch DTensor"),
        _ => ("fsdp2", "PyTorch FSDP2"),
    };
    let tag = w.precision_tag();
    let result = files.dir.join(format!("{name}{tag}-ws{ws}.json"));
    let _ = std::fs::remove_file(&result);
    let mut cmd = Command::new(torchrun);
    cmd.args(["--standalone", &format!("--nproc_per_node={ws}")])
        .arg(script)
        .arg(&files.data)
        .args(["--rows", &w.rows.to_string(), "--vocab", &t.vocab.to_string()])
        .args(["--d-model", &t.d_model.to_string(), "--heads", &t.heads.to_string()])
        .args(["--layers", &t.layers.to_string(), "--seq-len", &t.seq_len.to_string()])
        .args(["--batch", &w.batch.to_string(), "--epochs", &w.epochs.to_string()])
        .args(["--optimizer", &w.optimizer_name(), "--lr", &w.lr.to_string()])
        .args(["--weight-decay", &w.weight_decay.to_string()])
        .args(["--seed", &workload::SEED.to_string(), "--threads", &threads.to_string()])
        .arg("--init")
        .arg(&files.init)
        .arg("--out")
        .arg(&result)
        .env("OMP_NUM_THREADS", threads.to_string())
        .env_remove("MKL_CBWR");
    let spec = crate::model::transformer::Spec::of(t);
    if spec.tied {
        cmd.arg("--tied");
    }
    if !spec.bias {
        cmd.arg("--no-bias");
    }
    if w.bf16 {
        cmd.args(["--precision", "bf16"]);
    }
    if let Peer::TorchTp { tensor, .. } = w.peer {
        cmd.args(["--tensor", &tensor.to_string()]);
    }
    let (wall_s, peak_rss) = timed(cmd, ws, &files.dir.join(format!("{name}{tag}-ws{ws}.log")))?;
    let (epoch_s, losses, samples) = reference_epochs(&result, "rows", "seconds", who)?;
    Ok(Measure { wall_s, epoch_s: report::median(&epoch_s), samples, losses, peak_rss })
}

/// One more try after a failed run: PyTorch's gloo teardown now and then aborts a rank at exit
/// ("terminate called without an active exception"), after the work is done.
fn retried(run: impl Fn() -> anyhow::Result<Measure>) -> anyhow::Result<Measure> {
    run().or_else(|e| {
        crate::say!("  a run failed ({e:#}); trying it again");
        run()
    })
}

/// Runs `cmd` (a launcher of `ranks` ranks) with its output in `log`, and returns its wall time
/// and each rank's peak resident memory; fails naming the log.
fn timed(mut cmd: Command, ranks: usize, log: &Path) -> anyhow::Result<(f64, Vec<u64>)> {
    let file = std::fs::File::create(log).with_context(|| format!("cannot write {}", log.display()))?;
    let start = Instant::now();
    let mut child = cmd.stdin(Stdio::null()).stdout(file.try_clone()?).stderr(file).spawn()?;
    let (status, peaks) = memory::wait_measuring(&mut child, ranks)?;
    let wall_s = start.elapsed().as_secs_f64();
    if !status.success() {
        bail!("{:?} {status}; see {}", cmd.get_program(), log.display());
    }
    Ok((wall_s, peaks))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[test]
    fn the_command_line_accepts_every_workload_and_only_those() {
        for w in super::catalogue::all() {
            assert!(crate::cli::Cli::try_parse_from(["runner", "bench", "--workload", w.name]).is_ok(), "{}", w.name);
        }
        assert!(crate::cli::Cli::try_parse_from(["runner", "bench", "--workload", "tiny"]).is_err());
        let cli = crate::cli::Cli::try_parse_from(["runner", "bench", "--workload", "cnn,transformer"]).unwrap();
        let crate::cli::Command::Bench(args) = cli.command else { panic!("not bench") };
        assert_eq!(args.workloads, ["cnn", "transformer"]);
    }
}
