//! Checkpoints and exact resume: a run killed mid-way and resumed ends bit-identical to one
//! never interrupted; a bad checkpoint is refused, naming the file.
mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{assert_ok, children, run, runner, text, write};
use polars::prelude::*;

const RESUMABLE: &str = r#"
[run]
name = "res"
world_size = 3
timeout_s = 10
abort_after_s = 2

[load]
rows = 3000
features = 8
classes = 3
validation_rows = 100

[wrap.model]
hidden = [32]
dropout = 0.1

[train]
epochs = 6
batch_size = 16
optimizer = "adam"
lr = 0.01

[checkpoint]
every = 1
keep = 2
"#;

fn trace(dir: &Path) -> DataFrame {
    ParquetReader::new(std::fs::File::open(dir.join("trace.parquet")).unwrap()).finish().unwrap()
}

/// Runs into `out`, and kills rank `victim` as soon as the epoch-2 checkpoint exists.
fn run_and_kill(dir: &Path, out: &str, victim: usize) {
    let mut launcher = runner()
        .args(["run", "p.toml", "--out", out])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let marker = dir.join(out).join("checkpoints/epoch-0002.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "no epoch-2 checkpoint");
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
}

#[test]
fn a_killed_run_resumed_ends_bit_identical_to_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESUMABLE);
    assert_ok(&run(&["run", "p.toml", "--out", "whole"], dir.path()));
    run_and_kill(dir.path(), "cut", 1);
    assert_ok(&run(&["run", "--resume", "cut"], dir.path()));

    let (a, b) = (trace(&dir.path().join("whole")), trace(&dir.path().join("cut")));
    assert_eq!(a.height(), 6 * 3);
    for name in a.get_column_names() {
        if ["epoch_s", "samples_per_s", "comm_s", "compute_s", "bubble"].contains(&name.as_str()) {
            continue;
        }
        assert_eq!(a.column(name).unwrap(), b.column(name).unwrap(), "column {name} differs after resume");
    }
    let params = |d: &str| std::fs::read(dir.path().join(d).join("checkpoints/epoch-0006.pt")).unwrap();
    assert!(params("whole") == params("cut"), "final parameters and optimizer state differ after resume");
    // keep = 2: older checkpoints are pruned.
    assert!(!dir.path().join("whole/checkpoints/epoch-0004.pt").exists());
}

#[test]
fn a_corrupt_or_mismatched_checkpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESUMABLE);
    assert_ok(&run(&["run", "p.toml", "--out", "r", "--set", "train.epochs=2"], dir.path()));

    for (args, expected) in [
        (&["--set", "run.world_size=2"][..], "it was written at world size 3, this run has 2"),
        (&["--set", "wrap.model.hidden=[16]"][..], "it holds a different model"),
    ] {
        let o = run(&[&["run", "--resume", "r"][..], args].concat(), dir.path());
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("checkpoint r/checkpoints/epoch-0002.pt is refused") && err.contains(expected), "{err}");
    }

    let pt = dir.path().join("r/checkpoints/epoch-0002.pt");
    let bytes = std::fs::read(&pt).unwrap();
    std::fs::write(&pt, &bytes[..bytes.len() / 2]).unwrap();
    let o = run(&["run", "--resume", "r"], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("checkpoint r/checkpoints/epoch-0002.pt is refused: it is truncated or corrupt")
            && err.contains("delete it to resume from the one before"),
        "{err}"
    );
}
