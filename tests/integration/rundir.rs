//! The run directory belongs to one run: the lock, `--out` on someone else's directory, what
//! the runner deletes, stale temporary files, and a final status however the launcher ends.
use crate::common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{alive, assert_ok, children, run, runner, text, write, TINY};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Long enough to be stopped mid-run, with a checkpoint every epoch.
const LONG: &str = r#"
[run]
name = "long"
world_size = 2
timeout_s = 5
abort_after_s = 2

[load]
rows = 2000
features = 8
classes = 3
validation_rows = 100

[wrap.model]
hidden = [32]

[train]
epochs = 300
batch_size = 16

[checkpoint]
every = 1
keep = 2
"#;

fn start(dir: &Path, args: &[&str]) -> Child {
    runner().args(args).current_dir(dir).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Waits until `launcher` has `n` ranks that write checkpoints (epoch 1 done).
fn training(launcher: &Child, run_dir: &Path, n: usize) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ranks = children(launcher.id());
        let checkpointed = common::has_checkpoint(run_dir);
        if ranks.len() == n && checkpointed {
            return ranks;
        }
        assert!(Instant::now() < deadline, "the run did not start training");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn finish(mut child: Child, bound: Duration) -> (std::process::ExitStatus, String) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            return (status, err);
        }
        if start.elapsed() > bound {
            let _ = child.kill();
            panic!("did not stop within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn manifest(run_dir: &Path) -> String {
    std::fs::read_to_string(run_dir.join("manifest.json")).unwrap()
}

#[test]
fn a_second_launcher_on_the_same_directory_is_refused_naming_the_pid_that_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LONG);
    let first = start(dir.path(), &["run", "p.toml", "--out", "o"]);
    let ranks = training(&first, &dir.path().join("o"), 2);
    let second = run(&["run", "p.toml", "--out", "o"], dir.path());
    let (_, err) = text(&second);
    assert_eq!(second.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("is in use by another run (runner pid {} holds .runner.lock)", first.id())), "{err}");
    // The first run's checkpoints and ranks are untouched.
    assert!(ranks.iter().all(|&p| alive(p)));
    assert!(dir.path().join("o/checkpoints").read_dir().unwrap().count() > 0);
    kill(Pid::from_raw(first.id() as i32), Signal::SIGTERM).unwrap();
    let (status, err) = finish(first, Duration::from_secs(10));
    assert_eq!(status.code(), Some(143), "{err}");
}

#[test]
fn out_on_a_directory_that_is_not_this_runs_is_refused_unless_force_and_only_runner_files_are_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    std::fs::create_dir_all(d.join("o/checkpoints")).unwrap();
    write(&d.join("o"), "notes.txt", "mine");
    write(&d.join("o/checkpoints"), "keep.me", "mine");
    write(&d.join("o/checkpoints"), "epoch-0009.json", "{}");
    let refused = run(&["run", "p.toml", "--out", "o"], d);
    let (_, err) = text(&refused);
    assert_eq!(refused.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--out o is not this run's directory: it holds files the runner did not write (notes.txt)"),
        "{err}"
    );
    assert!(err.contains("--force"), "{err}");
    assert_ok(&run(&["run", "p.toml", "--out", "o", "--force"], d));
    assert_eq!(std::fs::read_to_string(d.join("o/notes.txt")).unwrap(), "mine");
    assert_eq!(std::fs::read_to_string(d.join("o/checkpoints/keep.me")).unwrap(), "mine");
    assert!(!d.join("o/checkpoints/epoch-0009.json").exists(), "a stale checkpoint of the runner's is replaced");

    // Another configuration's run directory: refused; the same configuration's complete run:
    // refused too (a fresh run would replace it), unless --force.
    assert_ok(&run(&["run", "p.toml", "--out", "r"], d));
    let again = run(&["run", "p.toml", "--out", "r"], d);
    assert_eq!(again.status.code(), Some(2), "{}", text(&again).1);
    assert!(text(&again).1.contains("r holds this configuration's complete run"), "{}", text(&again).1);
    assert_ok(&run(&["run", "p.toml", "--out", "r", "--force"], d));
    let other = run(&["run", "p.toml", "--out", "r", "--set", "run.seed=4"], d);
    let (_, err) = text(&other);
    assert_eq!(other.status.code(), Some(2), "{err}");
    assert!(err.contains("not this configuration's run"), "{err}");
    assert_ok(&run(&["run", "p.toml", "--out", "r", "--set", "run.seed=4", "--force"], d));
}

#[test]
fn sighup_interrupts_the_run_and_sigusr1_preempts_it_at_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LONG);
    for (sig, code, status) in [(Signal::SIGHUP, 129, "interrupted"), (Signal::SIGUSR1, 138, "preempted")] {
        let out = format!("{sig}");
        let launcher = start(dir.path(), &["run", "p.toml", "--out", &out]);
        let ranks = training(&launcher, &dir.path().join(&out), 2);
        kill(Pid::from_raw(launcher.id() as i32), sig).unwrap();
        let (status_code, err) = finish(launcher, Duration::from_secs(10));
        assert_eq!(status_code.code(), Some(code), "{err}");
        for pid in ranks {
            assert!(!alive(pid), "{sig}: rank process {pid} outlived the launcher");
        }
        let m = manifest(&dir.path().join(&out));
        assert!(m.contains(&format!("\"status\": \"{status}\"")), "{m}");
        if sig == Signal::SIGUSR1 {
            // The step of the checkpoint every rank wrote, in the manifest, the output and the
            // checkpoint's own name.
            let step: usize = m
                .split("\"preempted_at_step\": ")
                .nth(1)
                .unwrap()
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(err.contains(&format!("preempted at step {step}: checkpoint written;")), "{err}");
            let name = format!("step-{step:08}/index.json");
            assert!(dir.path().join(&out).join("checkpoints").join(&name).exists(), "no {name}");
        }
    }
}

#[test]
fn a_preempted_run_resumes_when_the_same_command_runs_again_and_ends_as_if_uninterrupted() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Preemption by SIGUSR2 (submitit's signal); no epoch checkpoints of its own.
    let pipeline = LONG
        .replace("epochs = 300", "epochs = 40")
        .replace("every = 1\nkeep = 2", "keep = 2")
        .replace("abort_after_s = 2", "abort_after_s = 2\npreempt_signal = \"USR2\"");
    write(d, "p.toml", &pipeline);
    let launcher = start(d, &["run", "p.toml", "--out", "o"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !d.join("o/trace.parquet").exists() {
        assert!(Instant::now() < deadline, "the run did not train");
        std::thread::sleep(Duration::from_millis(5));
    }
    kill(Pid::from_raw(launcher.id() as i32), Signal::SIGUSR2).unwrap();
    let (status, err) = finish(launcher, Duration::from_secs(30));
    assert_eq!(status.code(), Some(128 + 12), "{err}");
    assert!(err.contains("preempted at step"), "{err}");
    assert!(manifest(&d.join("o")).contains("\"status\": \"preempted\""));
    // The same command line resumes it, from the step the preemption wrote.
    let again = run(&["run", "p.toml", "--out", "o"], d);
    let (out, err) = text(&again);
    assert_ok(&again);
    assert!(out.contains("resuming run") && out.contains("(preempted at step"), "{out}\n{err}");
    assert!(manifest(&d.join("o")).contains("\"status\": \"complete\""));
    assert_ok(&run(&["run", "p.toml", "--out", "whole"], d));
    let (differences, _) =
        runner::sweep::check::compare(&common::trace(&d.join("o")), &common::trace(&d.join("whole")), None);
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}

#[test]
fn a_launcher_killed_outright_leaves_a_crashed_run_that_resumes_and_stale_temporary_files_go() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &LONG.replace("epochs = 300", "epochs = 6"));
    let launcher = start(d, &["run", "p.toml", "--out", "o"]);
    let ranks = training(&launcher, &d.join("o"), 2);
    kill(Pid::from_raw(launcher.id() as i32), Signal::SIGKILL).unwrap();
    let _ = finish(launcher, Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(5);
    while ranks.iter().any(|&p| alive(p)) {
        assert!(Instant::now() < deadline, "ranks outlived a killed launcher");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(manifest(&d.join("o")).contains("\"status\": \"running\""), "as the dead launcher left it");
    write(&d.join("o"), ".trace.parquet.tmp-4194303", "half");
    write(&d.join("o/checkpoints"), ".epoch-0001.pt.tmp-4194303", "half");
    let resumed = run(&["run", "--resume", "o"], d);
    let (out, err) = text(&resumed);
    assert_ok(&resumed);
    assert!(out.contains("resuming run") && out.contains("crashed"), "{out}\n{err}");
    assert!(manifest(&d.join("o")).contains("\"status\": \"complete\""));
    assert!(!d.join("o/.trace.parquet.tmp-4194303").exists());
    assert!(!d.join("o/checkpoints/.epoch-0001.pt.tmp-4194303").exists());
}

#[test]
fn a_store_that_cannot_be_served_or_joined_ends_the_launch_before_any_run_directory_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &TINY.replace("timeout_s = 30", "timeout_s = 1"));
    // Nobody serves this port: node 1 cannot join.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let join = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", &port];
    let o = run(&[&["run", "p.toml", "--out", "j"][..], &join].concat(), d);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot join node 0's rendezvous store"), "{err}");
    // Node 0 owns the run directory (docs/guide/slurm.md): a node that never heard from it
    // writes nothing there, not even a failed manifest.
    assert!(!d.join("j/manifest.json").exists());
    // An address that is not this host's: node 0 cannot serve.
    let serve = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "192.0.2.1", "--master-port", &port];
    let o = run(&[&["run", "p.toml", "--out", "s"][..], &serve].concat(), d);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot listen on 192.0.2.1"), "{err}");
    // The nodes meet before node 0 takes its run directory: nothing was started, nothing written.
    assert!(!d.join("s").exists());
}

#[test]
fn a_closed_stdout_does_not_fail_the_run() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let mut child = runner()
        .args(["run", "p.toml", "--out", "o"])
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // `| head -2`: read two lines, then close the pipe.
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    for _ in 0..2 {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    }
    drop(stdout);
    let (status, err) = finish(child, Duration::from_secs(60));
    assert!(status.success(), "{status}: {err}");
    assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{err}");
    assert!(manifest(&dir.path().join("o")).contains("\"status\": \"complete\""));
}
