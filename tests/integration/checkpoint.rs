//! Checkpoints and exact resume: a run killed mid-way and resumed ends bit-identical to one
//! never interrupted; a configuration change is refused by name, a damaged checkpoint names
//! what is wrong and the one before it that is whole, and no message advises deleting anything.
use crate::common;

use std::path::Path;

use common::{assert_ok, checkpoint_bytes, run, run_and_kill, text, trace, write};

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
    let params = |d: &str| checkpoint_bytes(&dir.path().join(d), "epoch-0006");
    assert!(params("whole") == params("cut"), "final parameters and optimizer state differ after resume");
    // keep = 2: older checkpoints are pruned.
    let left: Vec<String> = std::fs::read_dir(dir.path().join("whole/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(!dir.path().join("whole/checkpoints/epoch-0004").exists());
}

/// Runs `runner --resume r EXTRA...` in `dir`: its exit code must be 2, its stderr hold every
/// line of `expected`, and never advise deleting anything.
fn refused(dir: &Path, extra: &[&str], expected: &[&str]) {
    let o = run(&[&["run", "--resume", "r"][..], extra].concat(), dir);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
    for e in expected {
        assert!(err.contains(e), "{extra:?}:\n{err}\nexpected: {e}");
    }
    assert!(!err.contains("delete") && !err.contains("panicked"), "{err}");
}

#[test]
fn a_configuration_change_is_refused_by_name_and_a_damaged_checkpoint_names_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", RESUMABLE);
    assert_ok(&run(&["run", "p.toml", "--out", "r", "--set", "train.epochs=2"], d));
    // Configuration changes name the key, its values and where the new one came from; the
    // checkpoints are sound and stay.
    refused(
        d,
        &["--set", "run.world_size=2", "--set", "train.epochs=3"],
        &["cannot resume with run.world_size = 2: its global batch (samples per optimizer step) was 48 \
           (train.batch_size 16 × 3 ranks), it would be 32 (train.batch_size 16 × 2 ranks); every step must cover \
           the same samples: set train.batch_size = 24"],
    );
    refused(
        d,
        &["--set", "wrap.model.hidden=[16]"],
        &[
            "`wrap.model.hidden`: [32] in the run, [16] now (--set wrap.model.hidden=[16])",
            "The run's checkpoints are sound: resume with the run's own values to continue it.",
        ],
    );

    let ck = d.join("r/checkpoints/epoch-0002");
    let file = ck.join("rank-0.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let len = bytes.len();
    let before = "the checkpoint before it (epoch 1) is whole: move r/checkpoints/epoch-0002 out of r/checkpoints to \
                  resume from that one, or start a new run";
    // Cut short.
    std::fs::write(&file, &bytes[..len / 2]).unwrap();
    let cut = format!(
        "checkpoint epoch 2 (r/checkpoints/epoch-0002) cannot be resumed: rank-0.safetensors is {} bytes, its index \
         says {len}: the file is truncated or was replaced",
        len / 2
    );
    refused(d, &[], &[&cut, before]);
    // One byte of a tensor changed.
    let mut flipped = bytes.clone();
    flipped[len - 3] ^= 0x40;
    std::fs::write(&file, &flipped).unwrap();
    refused(d, &[], &["in rank-0.safetensors fails its checksum: the file is damaged", before]);
    // The index and the file disagree on where a tensor lies.
    std::fs::write(&file, &bytes).unwrap();
    let index_path = ck.join("index.json");
    let index = std::fs::read_to_string(&index_path).unwrap();
    let mut edited: serde_json::Value = serde_json::from_str(&index).unwrap();
    let piece = &mut edited["tensors"]["layer0.bias"]["pieces"][0]["bytes"];
    let start = piece[0].as_u64().unwrap();
    *piece = serde_json::json!([start + 4, piece[1].as_u64().unwrap() + 4]);
    std::fs::write(&index_path, edited.to_string()).unwrap();
    refused(d, &[], &["its index does not match rank-0.safetensors: `layer0.bias` is F32 [32] at bytes", before]);
    // The tensor file gone, its index left.
    std::fs::write(&index_path, &index).unwrap();
    std::fs::remove_file(&file).unwrap();
    refused(d, &[], &["its index names rank-0.safetensors, which is missing", before]);
    // Every checkpoint damaged: nothing to go back to.
    std::fs::remove_file(d.join("r/checkpoints/epoch-0001/rank-0.safetensors")).unwrap();
    refused(d, &[], &["no earlier checkpoint is whole: start a new run (without --resume)"]);
    // Back in place, the run resumes.
    std::fs::write(&file, &bytes).unwrap();
    assert_ok(&run(&["run", "--resume", "r", "--set", "train.epochs=3"], d));
}

#[test]
fn a_run_without_a_checkpoint_is_told_why_by_its_own_settings() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", RESUMABLE);
    // A run that checkpoints by steps, stopped before its first.
    let steps = ["--set", "checkpoint.every=0", "--set", "checkpoint.every_steps=100000", "--set", "train.epochs=1"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "r"][..], &steps].concat(), d));
    let _ = std::fs::remove_dir_all(d.join("r/checkpoints"));
    refused(
        d,
        &["--set", "train.epochs=2"],
        &["r/checkpoints holds no checkpoint to resume from: the run stopped before its first checkpoint \
           (checkpoint.every_steps = 100000): start it again without --resume"],
    );
    let o = run(&["run", "--resume", "r", "--set", "train.epochs=2"], d);
    assert!(!text(&o).1.contains("set checkpoint.every"), "{}", text(&o).1);
    // A run that writes none.
    assert_ok(&run(&["run", "p.toml", "--out", "n", "--set", "checkpoint.every=0", "--set", "train.epochs=1"], d));
    let o = run(&["run", "--resume", "n", "--set", "train.epochs=2"], d);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "n/checkpoints holds no checkpoint to resume from: the run writes none: set checkpoint.every (epochs) or \
             checkpoint.every_steps (optimizer steps) and start a new run"
        ),
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
    assert_eq!(checkpoints.len(), 2, "epochs 3 and 4 kept: {checkpoints:?}");
    drop(disk);

    // Room for one checkpoint and a half: the second is refused before it is written.
    let disk = SmallDisk::new((needed - checkpoint / 2) / 1024).unwrap();
    let out = disk.0.path().join("o");
    let o = run(&["run", "p.toml", "--out", out.to_str().unwrap()], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not enough free space for the checkpoint of epoch 2"), "{err}");
    assert!(err.contains("the last good checkpoint (epoch 1) is kept"), "{err}");
    assert!(out.join("checkpoints/epoch-0001/index.json").is_file());
    let tmp: Vec<_> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect();
    assert!(tmp.is_empty(), "{tmp:?}");
}

/// A disk that holds the kept checkpoints but not the model written at the end: the run is
/// refused at the checkpoint that would leave no room for the model, not after all its training.
#[test]
fn a_disk_without_room_for_the_final_model_is_named_at_a_checkpoint_not_after_training() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", SIZED);
    assert_ok(&run(&["run", "p.toml", "--out", "full"], dir.path()));
    let full = dir.path().join("full");
    let model = full.join("model.safetensors").metadata().unwrap().len().div_ceil(4096) * 4096;
    // Room for everything the finished run holds but half its model.
    let disk = match SmallDisk::new((pages(&full) - model / 2) / 1024) {
        Ok(d) => d,
        Err(why) => {
            common::cannot_run(
                "a_disk_without_room_for_the_final_model",
                &format!("cannot mount a small tmpfs ({why})"),
            );
            return;
        }
    };
    let out = disk.0.path().join("o");
    let o = run(&["run", "p.toml", "--out", out.to_str().unwrap()], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("not enough free space for the checkpoint of epoch 2 and the model written at the run's end"),
        "{err}"
    );
    assert!(err.contains("the last good checkpoint (epoch 1) is kept"), "{err}");
    assert!(!out.join("checkpoints/epoch-0004").exists(), "the run trained to its end before failing");
}

/// Under FSDP (every rank writes its own rows of each tensor), a killed run resumed at the same
/// world size ends bit for bit as an uninterrupted one.
#[test]
fn a_killed_fsdp_run_resumed_ends_bit_identical_to_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &RESUMABLE.replace("[train]", "[wrap]\nstrategy = \"fsdp\"\n\n[train]"));
    assert_ok(&run(&["run", "p.toml", "--out", "whole"], dir.path()));
    run_and_kill(dir.path(), "cut", &[], 1);
    assert_ok(&run(&["run", "--resume", "cut"], dir.path()));
    common::assert_same_trace(&dir.path().join("whole"), &dir.path().join("cut"));
    let params = |d: &str| checkpoint_bytes(&dir.path().join(d), "epoch-0006");
    assert!(params("whole") == params("cut"), "final shards and optimizer state differ after resume");
    let model = |d: &str| std::fs::read(dir.path().join(d).join("model.safetensors")).unwrap();
    assert!(model("whole") == model("cut"), "model.safetensors differs after resume");
}
