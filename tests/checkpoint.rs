//! Checkpoints and exact resume: a run killed mid-way and resumed ends bit-identical to one
//! never interrupted; a bad checkpoint is refused, naming the file.
mod common;

use std::path::Path;

use common::{assert_ok, run, run_and_kill, text, trace, write};

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

#[test]
fn a_killed_run_resumed_ends_bit_identical_to_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESUMABLE);
    assert_ok(&run(&["run", "p.toml", "--out", "whole"], dir.path()));
    run_and_kill(dir.path(), "cut", &[], 1);
    assert_ok(&run(&["run", "--resume", "cut"], dir.path()));

    let (a, b) = (trace(&dir.path().join("whole")), trace(&dir.path().join("cut")));
    assert_eq!(a.height(), 6 * 3);
    for name in a.get_column_names() {
        if common::measured(name) {
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

/// Checkpoints of about 0.8 MiB (a 8-256-256-3 MLP with Adam's state), two kept.
const SIZED: &str = r#"
[run]
name = "ck"
world_size = 2

[load]
rows = 400
features = 8
classes = 3
validation_rows = 50

[wrap.model]
hidden = [256, 256]

[train]
epochs = 4
batch_size = 50
optimizer = "adam"

[checkpoint]
every = 1
keep = 2
"#;

/// A tmpfs of `kib` KiB mounted on a fresh directory, unmounted when dropped.
struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    fn new(kib: u64) -> Result<SmallDisk, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("not root".into());
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let ok = std::process::Command::new("mount")
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
        let _ = std::process::Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

/// Bytes the files under `dir` take, in 4 KiB pages (as tmpfs counts them).
fn pages(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| if p.is_dir() { pages(&p) } else { p.metadata().unwrap().len().div_ceil(4096) * 4096 })
        .sum()
}

#[test]
fn a_disk_that_holds_the_kept_checkpoints_is_enough_and_a_full_one_is_named_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", SIZED);
    assert_ok(&run(&["run", "p.toml", "--out", "full"], dir.path()));
    let full = dir.path().join("full");
    let checkpoint = pages(&full.join("checkpoints")) / 2;
    let needed = pages(&full);
    // Room for the finished run (2 checkpoints kept) plus half a checkpoint: not for a third.
    let disk = match SmallDisk::new((needed + checkpoint / 2) / 1024) {
        Ok(d) => d,
        Err(why) => {
            common::cannot_run(
                "a_disk_that_holds_the_kept_checkpoints",
                &format!("cannot mount a small tmpfs ({why})"),
            );
            return;
        }
    };
    let out = disk.0.path().join("o");
    let o = run(&["run", "p.toml", "--out", out.to_str().unwrap()], dir.path());
    assert_ok(&o);
    let checkpoints: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(checkpoints.len(), 4, "epochs 3 and 4 kept: {checkpoints:?}");
    drop(disk);

    // Room for one checkpoint and a half: the second is refused before it is written.
    let disk = SmallDisk::new((needed - checkpoint / 2) / 1024).unwrap();
    let out = disk.0.path().join("o");
    let o = run(&["run", "p.toml", "--out", out.to_str().unwrap()], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not enough free space for the checkpoint of epoch 2"), "{err}");
    assert!(err.contains("the last good checkpoint (epoch 1) is kept"), "{err}");
    assert!(out.join("checkpoints/epoch-0001.pt").is_file() && out.join("checkpoints/epoch-0001.json").is_file());
    let tmp: Vec<_> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect();
    assert!(tmp.is_empty(), "{tmp:?}");
}
