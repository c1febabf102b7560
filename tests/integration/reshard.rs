//! Resharding: a checkpoint resumes at another world size and under another strategy. With the
//! global batch kept, the resumed run ends where the uninterrupted one does (within float
//! rounding: sums are taken over other groupings of the same samples), and what each rank loads
//! is bit for bit what was saved. A kill in the middle of a checkpoint of several files leaves
//! the one before it whole, and the run removes the unfinished one itself. A resume that would
//! change the global batch is refused, saying which key keeps it. The documentation's Python
//! snippet loads a checkpoint into a state_dict equal to model.safetensors.
use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use common::{assert_close_runs, assert_ok, reference_python, run, runner, text, trace, write};
use tch::Tensor;

/// An MLP over epochs without dropout (dropout masks are drawn per rank): 3000 rows, a global
/// batch of 32, so 94 optimizer steps per epoch; a checkpoint every 30 steps, mid-epoch.
const RESHARD: &str = r#"
[run]
name = "reshard"
seed = 4
world_size = 2
timeout_s = 30
abort_after_s = 2

[load]
rows = 3000
features = 6
classes = 3
validation_rows = 200

[wrap.model]
hidden = [32, 32]

[train]
epochs = 3
batch_size = 16
optimizer = "adam"
lr = 0.005

[checkpoint]
every_steps = 30
keep = 2
"#;

/// Starts `runner run p.toml --out OUT EXTRA...` with rank `stall` stopping in the middle of the
/// checkpoint of step `step` (after writing its own file, before the checkpoint is committed),
/// and returns once that checkpoint is being written: the launcher, and the directory it is
/// written in.
fn stall_mid_checkpoint(dir: &Path, out: &str, extra: &[&str], stall: usize, step: usize) -> (Child, PathBuf) {
    let launcher = runner()
        .args([&["run", "p.toml", "--out", out][..], extra].concat())
        .env("RUNNER_TEST_STALL_CHECKPOINT", format!("{stall}:{step}"))
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ck = dir.join(out).join("checkpoints");
    let prefix = format!(".step-{step:08}.tmp-");
    let deadline = Instant::now() + Duration::from_secs(120);
    let staging = loop {
        let found = std::fs::read_dir(&ck)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix)));
        if let Some(s) = found {
            break s;
        }
        assert!(Instant::now() < deadline, "no checkpoint of step {step} being written");
        std::thread::sleep(Duration::from_millis(5));
    };
    // The stalled rank writes its file (if it holds pieces) and waits; the others wait for it.
    std::thread::sleep(Duration::from_millis(500));
    assert!(!staging.join("index.json").exists(), "the checkpoint was committed: the stall did not hold");
    (launcher, ck)
}

/// Waits for `launcher`: its exit code and stderr.
fn ended(mut launcher: Child) -> (Option<i32>, String) {
    let status = launcher.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(launcher.stderr.as_mut().unwrap(), &mut err).unwrap();
    (status.code(), err)
}

/// The entries of `dir` and of `dir/checkpoints` whose names say a write was cut short.
fn unfinished(run_dir: &Path) -> Vec<String> {
    [run_dir.to_path_buf(), run_dir.join("checkpoints")]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()))
        .filter(|n| n.contains(".tmp"))
        .collect()
}

/// Kills rank `victim` (SIGKILL) in the middle of the checkpoint of step `step`, which rank
/// `stall` holds up: the run fails, and its launcher removes the unfinished checkpoint.
fn kill_mid_checkpoint(dir: &Path, out: &str, extra: &[&str], stall: usize, step: usize, victim: usize) -> String {
    let (launcher, ck) = stall_mid_checkpoint(dir, out, extra, stall, step);
    let pid = common::children(launcher.id())
        .into_iter()
        .find(|p| {
            let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            env.split(|b| *b == 0).any(|v| v == format!("RANK={victim}").as_bytes())
        })
        .expect("the rank process");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let (code, err) = ended(launcher);
    assert_eq!(code, Some(1), "{err}");
    assert!(unfinished(&dir.join(out)).is_empty(), "{:?}", unfinished(&dir.join(out)));
    assert!(!ck.join(format!("step-{step:08}")).exists());
    err
}

/// Every tensor of the checkpoint in `dir`, whole, assembled from its pieces by its index.
fn checkpoint_tensors(dir: &Path) -> BTreeMap<String, Tensor> {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).unwrap()).unwrap();
    let mut files = BTreeMap::new();
    for f in index["files"].as_object().unwrap().keys() {
        let t: BTreeMap<String, Tensor> = Tensor::read_safetensors(dir.join(f)).unwrap().into_iter().collect();
        files.insert(f.clone(), t);
    }
    let mut out = BTreeMap::new();
    for (name, t) in index["tensors"].as_object().unwrap() {
        let parts: Vec<Tensor> = t["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| files[p["file"].as_str().unwrap()][name].shallow_clone())
            .collect();
        out.insert(name.clone(), if parts.len() == 1 { parts[0].shallow_clone() } else { Tensor::cat(&parts, 0) });
    }
    out
}

/// What every rank of a resumed run loaded (`RUNNER_TEST_DUMP_LOADED`) is bit for bit the
/// saved checkpoint's: each tensor a rank holds, and between them every model and optimizer
/// tensor and the step count.
fn assert_loaded_exactly(saved: &BTreeMap<String, Tensor>, dump: &Path, ranks: usize) {
    let mut seen = std::collections::BTreeSet::new();
    for r in 0..ranks {
        let loaded = Tensor::read_safetensors(dump.join(format!("rank-{r}.safetensors"))).unwrap();
        for (name, t) in loaded {
            let s = saved.get(&name).unwrap_or_else(|| panic!("rank {r} loaded `{name}`, which was not saved"));
            assert!(t.kind() == s.kind() && t.equal(s), "rank {r}: `{name}` differs from the checkpoint's");
            seen.insert(name);
        }
    }
    let expected: std::collections::BTreeSet<String> =
        saved.keys().filter(|n| !n.starts_with("trace.")).cloned().collect();
    assert_eq!(seen, expected, "the ranks together loaded every tensor of the checkpoint");
}

/// The training samples of epoch `epoch` over the rows of the ranks that measure them (the
/// last of each `per_copy` ranks: a pipeline's stages each count their copy's samples).
fn samples_of_epoch(dir: &Path, epoch: u32, per_copy: u32) -> u64 {
    let df = trace(dir);
    let epochs = df.column("epoch").unwrap().u32().unwrap().clone();
    let ranks = df.column("rank").unwrap().u32().unwrap().clone();
    let samples = df.column("samples").unwrap().u64().unwrap().clone();
    (0..df.height())
        .filter(|&i| epochs.get(i) == Some(epoch) && ranks.get(i).is_some_and(|r| (r + 1) % per_copy == 0))
        .map(|i| samples.get(i).unwrap())
        .sum()
}

/// Kills `base`'s run mid-checkpoint of step 60 (step 30's is the last whole one), keeps a
/// copy of that checkpoint, and resumes it with `resume`; checks what each of `ranks` ranks
/// loaded, and that the result is within 1e-5 of the uninterrupted run `whole`.
fn reshard_and_compare(dir: &Path, base: &[&str], resume: &[&str], ranks: usize, per_copy: u32) {
    assert_ok(&run(&[&["run", "p.toml", "--out", "whole"][..], base].concat(), dir));
    kill_mid_checkpoint(dir, "cut", base, 1, 60, 1);
    let saved_dir = dir.join("cut/checkpoints/step-00000030");
    assert!(saved_dir.join("index.json").is_file(), "the checkpoint before the kill is whole");
    let saved = checkpoint_tensors(&saved_dir);
    let dump = dir.join("dump");
    std::fs::create_dir_all(&dump).unwrap();
    let o = runner()
        .args([&["run", "--resume", "cut"][..], resume].concat())
        .env("RUNNER_TEST_DUMP_LOADED", &dump)
        .current_dir(dir)
        .output()
        .unwrap();
    assert_ok(&o);
    assert!(text(&o).0.contains("resuming at step 30 with"), "{}", text(&o).0);
    assert_loaded_exactly(&saved, &dump, ranks);
    assert_close_runs(&dir.join("whole"), &dir.join("cut"), 1e-5);
    // The interval the checkpoint cut (epoch 1) counts every sample once after the fold.
    assert_eq!(samples_of_epoch(&dir.join("cut"), 1, per_copy), 3000);
    let manifest = std::fs::read_to_string(dir.join("cut/manifest.json")).unwrap();
    assert!(manifest.contains("\"reshards\"") && manifest.contains("\"step\": 30"), "{manifest}");
}

#[test]
fn ddp_at_2_ranks_resumed_at_4_with_half_the_batch_ends_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESHARD);
    // With a tracking key given too: taken as asked, with where it came from.
    let wider = ["--set", "run.world_size=4", "--set", "train.batch_size=8", "--set", "trace.log_every_steps=7"];
    reshard_and_compare(dir.path(), &[], &wider, 4, 1);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("cut/manifest.json")).unwrap()).unwrap();
    assert_eq!(
        manifest["reshards"],
        serde_json::json!([{
            "step": 30,
            "from": {"world_size": 2, "strategy": "ddp", "ranks_per_copy": 1},
            "to": {"world_size": 4, "strategy": "ddp", "ranks_per_copy": 1},
        }])
    );
    let config = std::fs::read_to_string(dir.path().join("cut/config.toml")).unwrap();
    assert!(config.contains("world_size = 4  # --set run.world_size=4 (on resume)"), "{config}");
    assert!(config.contains("batch_size = 8  # --set train.batch_size=8 (on resume)"), "{config}");
    assert!(config.contains("log_every_steps = 7  # --set trace.log_every_steps=7\n"), "{config}");
    // The run keeps its id: the first configuration's digest.
    let id = |d: &str| {
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(d).join("manifest.json")).unwrap()).unwrap();
        m["run_id"].as_str().unwrap().to_owned()
    };
    assert_eq!(id("cut"), id("whole"));
}

#[test]
fn ddp_resumed_as_a_pipeline_ends_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESHARD);
    // One pipeline of 2 stages takes the whole global batch of 32 in 4 micro-batches.
    let pipeline = [
        "--set",
        "wrap.strategy=\"pipeline\"",
        "--set",
        "train.batch_size=32",
        "--set",
        "wrap.pipeline.micro_batches=4",
    ];
    reshard_and_compare(dir.path(), &[], &pipeline, 2, 2);
}

#[test]
fn a_pipeline_resumed_under_ddp_at_4_ranks_ends_as_the_uninterrupted_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESHARD);
    let pipeline = ["--set", "wrap.strategy=\"pipeline\"", "--set", "train.batch_size=32"];
    let ddp = ["--set", "wrap.strategy=\"ddp\"", "--set", "run.world_size=4", "--set", "train.batch_size=8"];
    // The pipeline's second stage stalls after writing its file: a checkpoint of two files, one
    // of them on disk, is cut.
    reshard_and_compare(dir.path(), &pipeline, &ddp, 4, 1);
    // At world size 1 with the whole global batch the checkpoint fits too: only, the run is done.
    let o = run(&["run", "--resume", "cut", "--set", "run.world_size=1", "--set", "train.batch_size=32"], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("nothing is left to run"), "{err}");
}

#[test]
fn a_resume_that_changes_the_global_batch_is_refused_saying_which_key_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &RESHARD.replace("epochs = 3", "epochs = 1"));
    assert_ok(&run(&["run", "p.toml", "--out", "r"], d));
    let cases: &[(&[&str], &str)] = &[
        (
            &["--set", "run.world_size=4"],
            "cannot resume with run.world_size = 4: its global batch (samples per optimizer step) was 32 \
             (train.batch_size 16 × 2 ranks), it would be 64 (train.batch_size 16 × 4 ranks); every step must cover \
             the same samples: set train.batch_size = 8",
        ),
        (
            &["--set", "run.world_size=3"],
            "it would be 48 (train.batch_size 16 × 3 ranks); every step must cover the same samples: no batch size \
             gives 32 over 3 data-parallel copies: choose a world size that divides 32",
        ),
        (
            &["--set", "wrap.strategy=\"pipeline\""],
            "it would be 16 (train.batch_size 16 × 1 pipeline copy); every step must cover the same samples: set \
             train.batch_size = 32",
        ),
        (
            &["--set", "train.accumulate=2"],
            "it would be 64 (train.batch_size 16 × 2 ranks × train.accumulate 2); every step must cover the same \
             samples: set train.batch_size = 8",
        ),
    ];
    for (args, expected) in cases {
        let o = run(&[&["run", "--resume", "r", "--set", "train.epochs=2"][..], args].concat(), d);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expected), "{args:?}:\n{err}\nexpected: {expected}");
    }
    // A run whose global batch is a key: a world size that does not divide it is refused as such.
    let split = RESHARD
        .replace("epochs = 3", "epochs = 1")
        .replace("batch_size = 16", "global_batch_size = 30")
        .replace("[train]", "[shard]\nstrategy = \"batch\"\n\n[train]");
    write(d, "s.toml", &split);
    assert_ok(&run(&["run", "s.toml", "--out", "s"], d));
    let o = run(&["run", "--resume", "s", "--set", "train.epochs=2", "--set", "run.world_size=4"], d);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "cannot resume at world size 4: its train.global_batch_size = 30 fixes the samples of every optimizer \
             step, and 4 ranks do not split 30 evenly; resume at a world size that divides it (1, 2, 3, 5, 6, 10, 15, \
             30)"
        ),
        "{err}"
    );
    assert_ok(&run(&["run", "--resume", "s", "--set", "train.epochs=2", "--set", "run.world_size=3"], d));
}

/// The first ```python block of docs/checkpoints.md.
fn docs_snippet() -> String {
    let page = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/checkpoints.md")).unwrap();
    let start = page.find("```python\n").expect("a Python block in docs/checkpoints.md") + "```python\n".len();
    page[start..start + page[start..].find("```").unwrap()].to_owned()
}

#[test]
fn the_documented_python_loads_a_checkpoint_of_several_files_as_model_safetensors_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &RESHARD.replace("epochs = 3", "epochs = 1"));
    let pipeline = ["--set", "wrap.strategy=\"pipeline\"", "--set", "train.batch_size=32"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "r"][..], &pipeline].concat(), d));
    // The run's last checkpoint holds the trained model, in the two stages' files.
    let last = d.join("r/checkpoints/epoch-0001");
    assert!(last.join("rank-1.safetensors").is_file());
    let check = format!(
        "{}\n\
         import sys\n\
         from safetensors.torch import load_file\n\
         state = load_checkpoint(sys.argv[1])\n\
         model = load_file(sys.argv[2])\n\
         assert sorted(state) == sorted(model), (sorted(state), sorted(model))\n\
         for k in model:\n\
         \x20   assert torch.equal(state[k], model[k]), k\n\
         optim = load_checkpoint(sys.argv[1], roles=(\"optimizer\",))\n\
         assert 'optim.exp_avg.layer0.weight' in optim and int(optim['optim.steps']) == 94, sorted(optim)\n\
         print('ok', len(state))\n",
        docs_snippet()
    );
    write(d, "check.py", &check);
    let o = std::process::Command::new(reference_python())
        .args(["check.py", last.to_str().unwrap(), d.join("r/model.safetensors").to_str().unwrap()])
        .current_dir(d)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success() && out.contains("ok 6"), "{out}\n{err}");
}

#[test]
fn a_sigterm_in_the_middle_of_a_checkpoint_leaves_nothing_unfinished_and_the_one_before_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &RESHARD.replace("epochs = 3", "epochs = 1"));
    let pipeline = ["--set", "wrap.strategy=\"pipeline\"", "--set", "train.batch_size=32"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "whole"][..], &pipeline].concat(), d));
    // Stage 1 has written its file of step 60 and waits; stage 0 waits for it.
    let (launcher, ck) = stall_mid_checkpoint(d, "cut", &pipeline, 1, 60);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(launcher.id() as i32), nix::sys::signal::Signal::SIGTERM)
        .unwrap();
    let (code, err) = ended(launcher);
    assert_eq!(code, Some(143), "{err}");
    assert!(unfinished(&d.join("cut")).is_empty(), "{:?}", unfinished(&d.join("cut")));
    let left: Vec<String> =
        std::fs::read_dir(&ck).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, ["step-00000030"]);
    assert_ok(&run(&["run", "--resume", "cut"], d));
    common::assert_same_trace(&d.join("whole"), &d.join("cut"));
    for f in
        ["model.safetensors", "checkpoints/epoch-0001/rank-0.safetensors", "checkpoints/epoch-0001/rank-1.safetensors"]
    {
        let read = |r: &str| std::fs::read(d.join(r).join(f)).unwrap();
        assert!(read("whole") == read("cut"), "{f} differs after resume");
    }
}

#[test]
fn ddp_at_2_ranks_resumed_under_fsdp_at_4_ends_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESHARD);
    let fsdp = ["--set", "wrap.strategy=\"fsdp\"", "--set", "run.world_size=4", "--set", "train.batch_size=8"];
    reshard_and_compare(dir.path(), &[], &fsdp, 4, 1);
}

/// Every rank of an FSDP run writes its own file of the checkpoint: the kill in the middle of
/// one leaves files of the unfinished checkpoint on disk, and the one before it whole.
#[test]
fn fsdp_at_2_ranks_killed_mid_checkpoint_resumed_under_ddp_at_4_ends_as_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESHARD);
    let fsdp = ["--set", "wrap.strategy=\"fsdp\""];
    let ddp = ["--set", "wrap.strategy=\"ddp\"", "--set", "run.world_size=4", "--set", "train.batch_size=8"];
    reshard_and_compare(dir.path(), &fsdp, &ddp, 4, 1);
    // Under FSDP each rank's file holds its rows of every tensor: the pieces tile them.
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("whole/checkpoints/epoch-0003/index.json")).unwrap(),
    )
    .unwrap();
    let pieces = &index["tensors"]["layer0.weight"]["pieces"];
    assert_eq!(pieces.as_array().unwrap().len(), 2, "{pieces}");
    assert_eq!(pieces[1]["offset"], 16, "{pieces}");
}

#[test]
fn a_pipeline_resumed_under_fsdp_ends_as_the_uninterrupted_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RESHARD);
    let pipeline = ["--set", "wrap.strategy=\"pipeline\"", "--set", "train.batch_size=32"];
    let fsdp = ["--set", "wrap.strategy=\"fsdp\"", "--set", "run.world_size=2", "--set", "train.batch_size=16"];
    reshard_and_compare(dir.path(), &pipeline, &fsdp, 2, 1);
}
