//! No hangs, nothing left behind: ranks killed or stopped at random moments, interrupts, and
//! concurrent runs, all with the real binary and real rank processes.
use crate::common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{alive, children, runner, write};

/// Long enough that every kill lands mid-run; a failed run must stop within the bound anyway.
const LONG: &str = r#"
[run]
name = "long"
world_size = 3
timeout_s = 4
abort_after_s = 2

[load]
rows = 3000
features = 8
classes = 3
validation_rows = 100

[wrap.model]
hidden = [32]

[train]
epochs = 200
batch_size = 16
"#;

fn start(dir: &Path, out: &str) -> Child {
    start_with(dir, out, &[])
}

fn start_with(dir: &Path, out: &str, extra: &[&str]) -> Child {
    runner()
        .args(["run", "p.toml", "--out", out])
        .args(extra)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until the launcher has `n` rank processes and they have started training.
fn ranks_training(launcher: &Child, dir: &Path, n: usize) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut ranks = children(launcher.id());
        ranks.sort();
        let training = (0..n).all(|r| {
            std::fs::read_to_string(dir.join(format!(".rank-{r}.position"))).is_ok_and(|p| p.contains("train"))
        });
        if ranks.len() == n && training {
            return ranks;
        }
        assert!(Instant::now() < deadline, "ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn finish(mut launcher: Child, bound: Duration) -> (std::process::ExitStatus, String, Duration) {
    let start = Instant::now();
    loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(launcher.stderr.as_mut().unwrap(), &mut err).unwrap();
            return (status, err, start.elapsed());
        }
        if start.elapsed() > bound {
            let _ = launcher.kill();
            panic!("the launcher did not stop within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn killing_any_rank_at_any_moment_stops_the_job_and_names_it() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LONG);
    // A fixed pseudo-random sequence of (rank, delay) so failures reproduce.
    let mut x: u64 = 0x9E3779B97F4A7C15;
    for round in 0..4 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let (victim, delay_ms) = ((x % 3) as usize, 50 + (x >> 8) % 700);
        let out = format!("r{round}");
        let launcher = start(dir.path(), &out);
        let ranks = ranks_training(&launcher, &dir.path().join(&out), 3);
        std::thread::sleep(Duration::from_millis(delay_ms));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(ranks[victim] as i32), nix::sys::signal::Signal::SIGKILL)
            .unwrap();
        // abort_after_s is 2: every other rank is gone well within the bound.
        let (status, err, took) = finish(launcher, Duration::from_secs(8));
        assert_eq!(status.code(), Some(1), "round {round}: {err}");
        assert!(
            err.contains(&format!("error: the run failed: rank {victim} was killed by SIGKILL during ")),
            "round {round}:\n{err}"
        );
        assert!(took < Duration::from_secs(5), "round {round} took {took:?}");
        for pid in ranks {
            assert!(!alive(pid), "round {round}: rank process {pid} outlived the launcher");
        }
        let manifest = std::fs::read_to_string(dir.path().join(&out).join("manifest.json")).unwrap();
        assert!(manifest.contains("\"status\": \"failed\"") && manifest.contains("killed by SIGKILL"), "{manifest}");
    }
}

#[test]
fn a_stalled_rank_is_named_as_the_root_cause_within_timeout_plus_abort_after() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LONG);
    let launcher = start(dir.path(), "o");
    let ranks = ranks_training(&launcher, &dir.path().join("o"), 3);
    let stopped_at = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(ranks[1] as i32), nix::sys::signal::Signal::SIGSTOP).unwrap();
    let (status, err, _) = finish(launcher, Duration::from_secs(15));
    let took = stopped_at.elapsed();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("error: the run failed: rank 1 was stopped (SIGSTOP or a debugger) for"),
        "the stopped rank is the root cause, not the peer that timed out waiting for it:\n{err}"
    );
    assert!(err.contains("during train, epoch"), "where it stalled:\n{err}");
    // timeout_s 4 + abort_after_s 2, and a little for the launcher's polling.
    assert!(took < Duration::from_secs_f64(6.5), "took {took:?}");
    for pid in ranks {
        assert!(!alive(pid), "rank process {pid} outlived the launcher");
    }
    let manifest = std::fs::read_to_string(dir.path().join("o").join("manifest.json")).unwrap();
    assert!(manifest.contains("\"failure\": \"rank 1 was stopped"), "{manifest}");
}

#[test]
fn sigint_and_sigterm_stop_every_rank_and_mark_the_run_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LONG);
    // The message counts what the run counts: epochs, or intervals of optimizer steps (the
    // file's train.epochs removed with `~`, as Hydra writes it).
    let steps = ["--set", "~train.epochs", "--set", "train.steps=100000", "--set", "validate.every_steps=50"];
    for (sig, code, extra, unit) in [
        (nix::sys::signal::Signal::SIGINT, 130, &[][..], "every finished epoch in"),
        (nix::sys::signal::Signal::SIGTERM, 143, &[][..], "every finished epoch in"),
        (nix::sys::signal::Signal::SIGINT, 130, &steps[..], "every finished interval of 50 optimizer steps in"),
    ] {
        let out = format!("{sig}-{}", extra.len());
        let launcher = start_with(dir.path(), &out, extra);
        let ranks = ranks_training(&launcher, &dir.path().join(&out), 3);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(launcher.id() as i32), sig).unwrap();
        let (status, err, _) = finish(launcher, Duration::from_secs(8));
        assert_eq!(status.code(), Some(code), "{err}");
        assert!(
            err.contains(&format!("interrupted by {sig}: every rank was stopped; the trace keeps {unit}")),
            "{err}"
        );
        for pid in ranks {
            assert!(!alive(pid), "rank process {pid} outlived the launcher");
        }
        let manifest = std::fs::read_to_string(dir.path().join(&out).join("manifest.json")).unwrap();
        assert!(manifest.contains("\"status\": \"interrupted\""), "{manifest}");
    }
}

#[test]
fn four_concurrent_runs_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", common::TINY);
    let runs: Vec<Child> = (0..4)
        .map(|i| {
            runner()
                .args(["run", "p.toml", "--out", &format!("c{i}")])
                .current_dir(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, run) in runs.into_iter().enumerate() {
        let (status, err, _) = finish(run, Duration::from_secs(120));
        assert!(status.success(), "run {i} failed: {err}");
    }
}
