//! Runs that survive failures by themselves, with real processes and real kills. Each kill waits
//! for a marker (a rank's position, a new rank process, a test hook's file: see
//! `runner::testhook`) instead of sleeping, at moments drawn from a fixed seed: mid-step, during
//! a restart, during a checkpoint (synchronous and asynchronous) and during validation. A run
//! restarted by `run.max_restarts` (or by torchrun's `--max-restarts`) ends complete, with the
//! trace and `model.safetensors` of an uninterrupted run, bit for bit; a failure that repeats
//! at one step is not retried; checkpoints written in the background equal synchronous ones and
//! a kill during their write leaves the one before resumable.
use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, assert_same_trace, checkpoint_bytes, run, text, write};

/// 1200 rows of 5 features at 2 ranks × 16: 38 optimizer steps per epoch, 114 in all; a
/// checkpoint every 10 steps, Adam's moments in it, validation after every epoch.
const CHAOS: &str = r#"
[run]
name = "chaos"
seed = 7
world_size = 2
timeout_s = 30
abort_after_s = 2
max_restarts = 5

[load]
rows = 1200
features = 5
classes = 3
validation_rows = 200

[wrap.model]
hidden = [16]

[train]
epochs = 3
batch_size = 16
optimizer = "adam"
lr = 0.01

[checkpoint]
every_steps = 10
"#;

/// A small deterministic generator for the kill moments (xorshift64*).
struct Draw(u64);

impl Draw {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// A launcher running in the background, its stderr going to a file.
struct Launched {
    child: Child,
    stderr: PathBuf,
}

impl Launched {
    fn start(dir: &Path, out: &str, extra: &[&str], env: &[(&str, String)]) -> Launched {
        let stderr = dir.join(format!("{out}.stderr"));
        let child = common::runner()
            .args([&["run", "p.toml", "--out", out][..], extra].concat())
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        Launched { child, stderr }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Waits for the launcher to end: its exit code and stderr.
    fn finish(mut self) -> (Option<i32>, String) {
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status.code(), self.stderr());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the launcher did not end:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits until `ready` gives a value (at most 120 s, else fails saying `what` with the stderr).
fn wait_for<T>(launched: &Launched, what: &str, mut ready: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(v) = ready() {
            return v;
        }
        assert!(Instant::now() < deadline, "never saw {what}:\n{}", launched.stderr());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The processes descending from `pid`.
fn descendants(pid: u32) -> Vec<u32> {
    let mut all = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        let children = common::children(p);
        next.extend(&children);
        all.extend(children);
    }
    all
}

/// The live process descending from `root` that runs rank `rank`.
fn rank_pid(root: u32, rank: usize) -> Option<u32> {
    descendants(root).into_iter().find(|p| {
        let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
        common::alive(*p) && env.split(|b| *b == 0).any(|v| v == format!("RANK={rank}").as_bytes())
    })
}

fn kill(pid: u32) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
}

/// Rank `rank`'s position in `run_dir`: its text and the optimizer steps done.
fn position(run_dir: &Path, rank: usize) -> Option<(String, usize)> {
    let text = std::fs::read_to_string(run_dir.join(format!(".rank-{rank}.position"))).ok()?;
    let (stage, done) = (text.get(..64)?, text.get(64..)?);
    Some((stage.trim().to_owned(), done.trim().parse().ok()?))
}

fn manifest(run_dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run_dir.join("manifest.json")).unwrap()).unwrap()
}

/// Asserts that `a` and `b` trained the same: every non-timing trace value and the model file.
fn assert_same_run(a: &Path, b: &Path) {
    assert_same_trace(a, b);
    let model = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(model(a) == model(b), "model.safetensors of {} and {} differ", a.display(), b.display());
}

/// A run killed at four moments drawn from `seed` (mid-step, during a restart, during a
/// checkpoint, during validation) ends complete and equal to the uninterrupted run.
fn chaos(sets: &[&str], seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", CHAOS);
    let sets: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
    assert_ok(&run(&[&["run", "p.toml", "--out", "whole"][..], &sets].concat(), d));

    let mut draw = Draw(seed);
    let (mid_step, mid_victim) = (5 + draw.below(12) as usize, draw.below(2) as usize);
    let restart_victim = draw.below(2) as usize;
    let (checkpoint_step, checkpoint_victim) = (40 + 10 * draw.below(3) as usize, draw.below(2) as usize);
    eprintln!(
        "seed {seed}: rank {mid_victim} in step {mid_step}, rank {restart_victim} during the restart, rank \
         {checkpoint_victim} during the checkpoint of step {checkpoint_step}, rank 0 during validation of epoch 3"
    );
    let once = |name: &str| d.join(name).display().to_string();
    let env = [
        ("RUNNER_TEST_STALL_CHECKPOINT", format!("{checkpoint_victim}:{checkpoint_step}@{}", once("ck.once"))),
        (
            "RUNNER_TEST_STALL_AT",
            format!(
                "{mid_victim}:train, epoch 1, step {mid_step}@{};0:validate, epoch 3@{}",
                once("step.once"),
                once("val.once")
            ),
        ),
    ];
    let launched = Launched::start(d, "cut", &sets, &env);
    let (root, run_dir) = (launched.child.id(), d.join("cut"));

    // Mid-step: as the victim begins step `mid_step` (its position names the step under way).
    wait_for(&launched, "the stalled step", || d.join("step.once").exists().then_some(()));
    let victim = wait_for(&launched, "the first attempt's ranks", || rank_pid(root, mid_victim));
    let before = rank_pid(root, restart_victim);
    kill(victim);
    // During the restart: as soon as the new attempt's process of that rank exists.
    let restarted = wait_for(&launched, "the restarted rank", || {
        rank_pid(root, restart_victim).filter(|p| Some(*p) != before && *p != victim)
    });
    kill(restarted);
    // During a checkpoint: its file written, the checkpoint not committed.
    wait_for(&launched, "the stalled checkpoint", || d.join("ck.once").exists().then_some(()));
    let stalled = wait_for(&launched, "the stalled rank", || rank_pid(root, checkpoint_victim));
    kill(stalled);
    // During the last validation.
    wait_for(&launched, "the stalled validation", || d.join("val.once").exists().then_some(()));
    let validating = wait_for(&launched, "the validating rank", || rank_pid(root, 0));
    kill(validating);

    let (code, err) = launched.finish();
    assert_eq!(code, Some(0), "{err}");
    assert_same_run(&d.join("whole"), &run_dir);
    let m = manifest(&run_dir);
    assert_eq!(m["status"], "complete", "{m:#}");
    let failures = m["failures"].as_array().unwrap();
    let restarts = m["restarts"].as_array().unwrap();
    assert_eq!((failures.len(), restarts.len()), (4, 4), "{m:#}");
    for f in failures {
        assert_eq!(f["cause"], "was killed by SIGKILL", "{f:#}");
    }
    let at = |i: usize| failures[i]["position"].as_str().unwrap_or("").to_owned();
    assert_eq!(at(0), format!("train, epoch 1, step {mid_step}"), "{m:#}");
    assert_eq!(failures[0]["step"].as_u64(), Some(mid_step as u64 - 1), "{m:#}");
    assert!(at(2).starts_with("checkpoint") || at(2).starts_with("train"), "{m:#}");
    assert_eq!(at(3), "validate, epoch 3", "{m:#}");
    // The validation of epoch 3 came after step 114; the restart resumed from step 110.
    assert_eq!((failures[3]["step"].as_u64(), restarts[3]["from_step"].as_u64()), (Some(114), Some(110)), "{m:#}");
    assert_eq!(restarts[3]["recomputed_steps"], 4, "{m:#}");
    let goodput = m["goodput"]["goodput"].as_f64().unwrap();
    assert!(goodput > 0.0 && goodput < 1.0, "{m:#}");
    assert!(err.contains("restarting every rank from the checkpoint of step 110 (restart 4 of 5)"), "{err}");
}

#[test]
fn a_ddp_run_killed_four_times_ends_as_if_never_interrupted() {
    chaos(&[], 40);
}

#[test]
fn an_fsdp_run_with_asynchronous_checkpoints_killed_four_times_ends_as_if_never_interrupted() {
    chaos(&["wrap.strategy=\"fsdp\"", "checkpoint.async=true"], 41);
}

#[test]
fn a_failure_that_repeats_at_one_step_is_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", CHAOS);
    // Steps this large make the weights infinite within a few steps, the same ones every time.
    let o = run(
        &["run", "p.toml", "--out", "nan", "--set", "train.optimizer=\"sgd\"", "--set", "train.lr=1e30"]
            .into_iter()
            .chain(["--set", "checkpoint.every_steps=1"])
            .collect::<Vec<_>>(),
        d,
    );
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not restarted: it failed the same way before"), "{err}");
    assert!(err.contains("became NaN or infinite") || err.contains("the training loss became"), "{err}");
    let m = manifest(&d.join("nan"));
    assert_eq!(m["status"], "failed");
    let (failures, restarts) = (m["failures"].as_array().unwrap(), m["restarts"].as_array().unwrap());
    assert_eq!((failures.len(), restarts.len()), (2, 1), "two tries: {m:#}");
    assert_eq!(failures[0]["step"], failures[1]["step"], "{m:#}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn asynchronous_checkpoints_equal_synchronous_ones_resume_exactly_and_survive_a_kill_in_their_write() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &CHAOS.replace("max_restarts = 5", "max_restarts = 0"));
    let asynchronous = ["--set", "checkpoint.async=true"];
    assert_ok(&run(&["run", "p.toml", "--out", "sync"], d));
    assert_ok(&run(&[&["run", "p.toml", "--out", "async"][..], &asynchronous].concat(), d));
    assert_same_run(&d.join("sync"), &d.join("async"));
    for name in ["step-00000110", "epoch-0003"] {
        assert!(
            checkpoint_bytes(&d.join("sync"), name) == checkpoint_bytes(&d.join("async"), name),
            "checkpoint {name} differs between synchronous and asynchronous writes"
        );
    }

    // Rank 0's thread stops once its file of step 50 is written; training goes on meanwhile.
    let env = [("RUNNER_TEST_STALL_CHECKPOINT", "0:50".to_owned())];
    let launched = Launched::start(d, "cut", &asynchronous, &env);
    let run_dir = d.join("cut");
    let staging = wait_for(&launched, "the file of step 50", || {
        let ck = std::fs::read_dir(run_dir.join("checkpoints")).ok()?;
        ck.filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| p.file_name().unwrap().to_string_lossy().starts_with(".step-00000050.tmp-"))
            .filter(|p| p.join("rank-0.safetensors").exists())
    });
    wait_for(&launched, "training past step 50", || position(&run_dir, 1).filter(|(_, done)| *done > 50));
    kill(wait_for(&launched, "rank 0", || rank_pid(launched.child.id(), 0)));
    let (code, err) = launched.finish();
    assert_eq!(code, Some(1), "{err}");
    assert!(!staging.exists(), "the unfinished checkpoint is left: {}", staging.display());
    assert!(!run_dir.join("checkpoints/step-00000050").exists());
    assert!(run_dir.join("checkpoints/step-00000040/index.json").is_file());
    assert_ok(&run(&["run", "--resume", "cut"], d));
    assert_same_run(&d.join("sync"), &run_dir);
}

#[test]
fn torchrun_restarting_its_workers_resumes_from_the_newest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &CHAOS.replace("max_restarts = 5", "max_restarts = 0"));
    assert_ok(&run(&["run", "p.toml", "--out", "whole"], d));
    let mut torchrun = Command::new(common::reference_python());
    torchrun
        .args(["-m", "torch.distributed.run", "--standalone", "--no-python", "--max-restarts", "2"])
        .args(["--nproc-per-node", "2", "--monitor-interval", "0.1", env!("CARGO_BIN_EXE_runner")])
        .args(["run", "p.toml", "--out", "cut"])
        .env("OMP_NUM_THREADS", "1");
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("RUNNER_") || k.starts_with("SLURM_")) {
        torchrun.env_remove(k);
    }
    let stderr = d.join("torchrun.stderr");
    let child =
        torchrun.current_dir(d).stdout(Stdio::null()).stderr(std::fs::File::create(&stderr).unwrap()).spawn().unwrap();
    let launched = Launched { child, stderr };
    let run_dir = d.join("cut");
    let victim = wait_for(&launched, "rank 1 past step 25", || {
        let reached = position(&run_dir, 1).is_some_and(|(_, done)| done >= 25);
        reached.then(|| rank_pid(launched.child.id(), 1)).flatten()
    });
    kill(victim);
    let (code, err) = launched.finish();
    assert_eq!(code, Some(0), "{err}");
    assert_same_run(&d.join("whole"), &run_dir);
    let m = manifest(&run_dir);
    let restarts = m["restarts"].as_array().unwrap();
    assert_eq!(restarts.len(), 1, "{m:#}");
    assert_eq!(restarts[0]["by"], "torchrun", "{m:#}");
    let from = restarts[0]["from_step"].as_u64().unwrap();
    assert!(from >= 20 && from.is_multiple_of(10), "{m:#}");
}

/// A restart from a checkpoint near an epoch's end: the epoch's row times its steps once each
/// (those before the checkpoint in the failed attempt, the rest in the restarted one), so its
/// throughput is the uninterrupted epochs', not the whole epoch's samples over two steps' time.
#[test]
fn an_epoch_restarted_from_a_checkpoint_near_its_end_keeps_its_throughput() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let wide = CHAOS.replace("hidden = [16]", "hidden = [256, 256]").replace("every_steps = 10", "every_steps = 36");
    write(d, "p.toml", &wide);
    // Rank 0 holds at the step after the checkpoint of step 36 (of 38 in epoch 1) until it is
    // killed; its restart goes past it.
    let past = d.join("past");
    let env = [("RUNNER_TEST_WAIT_AT", format!("0:train, epoch 1, step 37@{}", past.display()))];
    let launched = Launched::start(d, "cut", &[], &env);
    let run_dir = d.join("cut");
    wait_for(&launched, "the checkpoint of step 36", || {
        run_dir.join("checkpoints/step-00000036/index.json").exists().then_some(())
    });
    let rank0 = wait_for(&launched, "rank 0 holding at step 37", || {
        position(&run_dir, 0).filter(|(text, _)| text.starts_with("train, epoch 1, step 37"))?;
        rank_pid(launched.child.id(), 0)
    });
    kill(rank0);
    std::fs::write(&past, "").unwrap();
    let (code, err) = launched.finish();
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("restarting every rank from the checkpoint of step 36"), "{err}");

    let trace = common::trace(&run_dir);
    let rank = trace.column("rank").unwrap().cast(&polars::prelude::DataType::Int64).unwrap();
    let column = |name: &str| -> Vec<f64> {
        let c = trace.column(name).unwrap().f64().unwrap().clone();
        (0..trace.height()).filter(|&i| rank.i64().unwrap().get(i) == Some(0)).map(|i| c.get(i).unwrap()).collect()
    };
    let (rate, seconds) = (column("samples_per_s"), column("epoch_s"));
    eprintln!("rank 0: samples_per_s {rate:?}, epoch_s {seconds:?}");
    assert_eq!(rate.len(), 3, "three epochs: {rate:?}");
    // Untouched, epoch 1 would take about as long as epochs 2 and 3; timed over its two rerun
    // steps alone, it would be some 19 times faster.
    let others = (rate[1] + rate[2]) / 2.0;
    assert!(rate[0] < 3.0 * others, "epoch 1's throughput {} against {others} (epoch_s {seconds:?})", rate[0]);
}
