//! Runs measured in optimizer steps, random windows, and checkpoints at any step: a run killed
//! after a mid-epoch (or mid-interval) checkpoint and resumed ends bit-identical to one never
//! interrupted, for random windows and epochs, DDP and a pipeline. Token shards read as one
//! stream; the split keys mean the same for every source; keys a source cannot use are refused.
use crate::common;

use std::path::Path;

use common::{assert_ok, assert_same_trace, run, run_and_kill_at, text, trace, write};

/// A small language model on a play (pipelines/data/tempest.txt), read as bytes, random windows.
const LM: &str = r#"
[run]
name = "lm"
seed = 1
world_size = 2
timeout_s = 20
abort_after_s = 2

[load]
source = "text"
path = "corpus.txt"
sampling = "random"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 256
d_model = 32
heads = 2
layers = 1
seq_len = 32
dropout = 0.1

[train]
steps = 240
batch_size = 8
optimizer = "adamw"
lr = 0.002

[validate]
every_steps = 60
batches = 2

[checkpoint]
every_steps = 25
keep = 3
"#;

/// An MLP over epochs with accumulation: 94 batches (47 optimizer steps) per rank per epoch.
const EPOCHS: &str = r#"
[run]
name = "ep"
seed = 2
world_size = 2
timeout_s = 20
abort_after_s = 2

[load]
rows = 3000
features = 6
classes = 3
validation_rows = 100

[wrap.model]
hidden = [32, 32]
dropout = 0.1

[train]
epochs = 4
batch_size = 16
accumulate = 2
optimizer = "adam"
lr = 0.01

[checkpoint]
every_steps = 30
keep = 2
"#;

fn corpus(dir: &Path) {
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/data/tempest.txt"), dir.join("corpus.txt"))
        .unwrap();
}

/// `whole` uninterrupted, `cut` killed once `marker` exists and resumed: the same trace and files.
fn resumes_bit_identical(dir: &Path, extra: &[&str], marker: &str, files: &[&str]) {
    assert_ok(&run(&[&["run", "p.toml", "--out", "whole"][..], extra].concat(), dir));
    run_and_kill_at(dir, "cut", extra, 1, marker);
    let o = run(&["run", "--resume", "cut"], dir);
    assert_ok(&o);
    assert_same_trace(&dir.join("whole"), &dir.join("cut"));
    for f in files {
        let read = |d: &str| std::fs::read(dir.join(d).join(f)).unwrap();
        assert!(read("whole") == read("cut"), "{f} differs after resume");
    }
}

#[test]
fn random_windows_resumed_from_a_mid_interval_checkpoint_end_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    corpus(dir.path());
    write(dir.path(), "p.toml", LM);
    resumes_bit_identical(
        dir.path(),
        &[],
        "step-00000025/index.json",
        &["model.safetensors", "checkpoints/step-00000240/rank-0.safetensors"],
    );
    // One row per rank per validation interval, with the step.
    let t = trace(&dir.path().join("whole"));
    let steps: Vec<u64> = t.column("step").unwrap().u64().unwrap().into_no_null_iter().collect();
    assert_eq!(steps, [60, 60, 120, 120, 180, 180, 240, 240]);
    let ranks: Vec<u32> = t.column("rank").unwrap().u32().unwrap().into_no_null_iter().collect();
    let val: Vec<Option<f64>> = t.column("val_loss").unwrap().f64().unwrap().iter().collect();
    assert!(ranks.iter().zip(&val).all(|(r, v)| *r != 0 || v.is_some()), "every interval validates on rank 0");
}

#[test]
fn thread_replicas_resumed_from_a_mid_interval_checkpoint_end_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    corpus(dir.path());
    write(dir.path(), "p.toml", LM);
    // Two replicas of one thread on each of the 2 ranks (without dropout, which they refuse).
    let replicas =
        ["--set", "wrap.model.dropout=0.0", "--set", "run.threads_per_rank=2", "--set", "wrap.threads_per_replica=1"];
    resumes_bit_identical(
        dir.path(),
        &replicas,
        "step-00000025/index.json",
        &["model.safetensors", "checkpoints/step-00000240/rank-0.safetensors"],
    );
}

#[test]
fn an_epoch_run_resumed_from_a_mid_epoch_checkpoint_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", EPOCHS);
    // Step 30 is in the middle of epoch 1 (47 steps), with accumulation over 2 batches.
    resumes_bit_identical(
        dir.path(),
        &[],
        "step-00000030/index.json",
        &["model.safetensors", "checkpoints/epoch-0004/rank-0.safetensors"],
    );
    let index = std::fs::read_to_string(dir.path().join("whole/checkpoints/epoch-0004/index.json")).unwrap();
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    assert_eq!(index["record"]["step"], 188);
}

#[test]
fn a_pipeline_resumed_from_a_mid_epoch_checkpoint_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", EPOCHS);
    let pipeline = ["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.pipeline.micro_batches=2"];
    resumes_bit_identical(
        dir.path(),
        &pipeline,
        "step-00000030/index.json",
        &[
            "model.safetensors",
            "checkpoints/epoch-0004/rank-0.safetensors",
            "checkpoints/epoch-0004/rank-1.safetensors",
        ],
    );
}

#[test]
fn train_steps_may_be_raised_on_resume_and_not_lowered_below_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    corpus(dir.path());
    write(dir.path(), "p.toml", LM);
    let short = ["--set", "train.steps=50", "--set", "validate.every_steps=50"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "r"][..], &short[..]].concat(), dir.path()));
    let o = run(&["run", "--resume", "r"], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("is at step 50: nothing is left to run; pass --set train.steps=N with N > 50"), "{err}");
    assert_ok(&run(&["run", "--resume", "r", "--set", "train.steps=100"], dir.path()));
    let steps: Vec<u64> =
        trace(&dir.path().join("r")).column("step").unwrap().u64().unwrap().into_no_null_iter().collect();
    assert_eq!(steps, [50, 50, 100, 100]);
    let config = std::fs::read_to_string(dir.path().join("r/config.toml")).unwrap();
    assert!(config.contains("steps = 100  # --set train.steps=100 (on resume)"), "{config}");
}

/// Token ids 0..50 in a pattern, as uint16.
fn ids(n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (((i * 7 + i / 13) % 50) as u16).to_le_bytes()).collect()
}

#[test]
fn a_glob_of_token_shards_trains_like_the_same_tokens_in_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let all = ids(30_000);
    std::fs::write(dir.path().join("all.bin"), &all).unwrap();
    std::fs::create_dir(dir.path().join("shards")).unwrap();
    // Cut at odd places (not at window boundaries), names sorting in stream order.
    for (i, part) in [&all[..10_002], &all[10_002..33_334], &all[33_334..]].iter().enumerate() {
        std::fs::write(dir.path().join(format!("shards/train-{i}.bin")), part).unwrap();
    }
    std::fs::write(dir.path().join("val.bin"), ids(4_000)).unwrap();
    let p = LM
        .replace(
            "source = \"text\"\npath = \"corpus.txt\"",
            "source = \"tokens\"\npath = \"all.bin\"\nvalidation_path = \"val.bin\"",
        )
        .replace("vocab = 256", "vocab = 50")
        .replace("steps = 240", "steps = 30")
        .replace("every_steps = 60", "every_steps = 15");
    write(dir.path(), "p.toml", &p);
    assert_ok(&run(&["run", "p.toml", "--out", "one"], dir.path()));
    let o = run(&["run", "p.toml", "--out", "glob", "--set", "load.path=\"shards/train-*.bin\""], dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("shards/train-0.bin and 2 more files (30000 tokens)"), "{stdout}");
    assert_same_trace(&dir.path().join("one"), &dir.path().join("glob"));
    // The list form, and the resolved files in config.toml.
    let list = "load.path=[\"shards/train-0.bin\", \"shards/train-1.bin\", \"shards/train-2.bin\"]";
    assert_ok(&run(&["run", "p.toml", "--out", "list", "--set", list], dir.path()));
    assert_same_trace(&dir.path().join("one"), &dir.path().join("list"));
    let config = std::fs::read_to_string(dir.path().join("glob/config.toml")).unwrap();
    assert!(config.contains("shards/train-2.bin\"]  # --set load.path=\"shards/train-*.bin\""), "{config}");
}

/// `runner validate`'s load row for `extra` settings.
fn load_row(dir: &Path, extra: &[&str]) -> String {
    let o = run(&[&["validate", "p.toml"][..], extra].concat(), dir);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    out.lines().find(|l| l.contains("1 load")).unwrap_or_default().to_owned()
}

#[test]
fn the_split_keys_mean_the_same_for_every_source_with_rows() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.bin"), ids(3_201)).unwrap();
    std::fs::write(dir.path().join("v.bin"), ids(641)).unwrap();
    let tokens = LM
        .replace(
            "source = \"text\"\npath = \"corpus.txt\"\nsampling = \"random\"",
            "source = \"tokens\"\npath = \"t.bin\"",
        )
        .replace("vocab = 256", "vocab = 50")
        .replace("[validate]\nevery_steps = 60\nbatches = 2", "[validate]");
    write(dir.path(), "p.toml", &tokens);
    // 100 windows of 32 + 1: 20% from the stream's end by default, or rows, or a fraction, or a file.
    assert!(load_row(dir.path(), &[]).contains("80 training + 20 validation windows"));
    assert!(load_row(dir.path(), &["--set", "validate.rows=7"]).contains("93 training + 7 validation windows"));
    assert!(load_row(dir.path(), &["--set", "validate.fraction=0.5"]).contains("50 training + 50 validation windows"));
    let file = ["--set", "load.validation_path=\"v.bin\""];
    assert!(load_row(dir.path(), &file).contains("100 training + 20 validation windows"));

    // Tensors: sorted by label, the split is stratified as a csv file's.
    let x = tch::Tensor::arange(200, (tch::Kind::Float, tch::Device::Cpu)).view([100, 2]);
    let y = tch::Tensor::arange(100, (tch::Kind::Int64, tch::Device::Cpu)).divide_scalar_mode(25, "floor");
    tch::Tensor::write_npz(&[("x", &x), ("y", &y)], dir.path().join("d.npz")).unwrap();
    let tensors = common::TINY.replace(
        "rows = 600\nfeatures = 5\nclasses = 3\nvalidation_rows = 100",
        "source = \"tensors\"\npath = \"d.npz\"",
    );
    write(dir.path(), "p.toml", &tensors);
    assert!(load_row(dir.path(), &[]).contains("80 training + 20 validation rows, 4 classes"));
    assert!(load_row(dir.path(), &["--set", "validate.rows=8"]).contains("92 training + 8 validation rows"));
    let o = run(&["run", "p.toml", "--out", "t", "--set", "run.world_size=1"], dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("d.npz"), "the data-flow table names the file:\n{stdout}");
    assert!(!stdout.contains("synthetic"), "{stdout}");
}

#[test]
fn keys_a_source_cannot_use_and_run_lengths_that_conflict_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    corpus(dir.path());
    write(dir.path(), "lm.toml", LM);
    write(dir.path(), "mlp.toml", common::TINY);
    std::fs::write(dir.path().join("d.csv"), "a,b,label\n1,2,0\n3,4,1\n5,6,0\n7,8,1\n9,1,0\n2,2,1\n").unwrap();
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "mlp.toml",
            &["--set", "load.sampling=\"random\""],
            "`load.sampling` (--set load.sampling=\"random\"): \"random\" draws windows from a token file: use source = \"tokens\" or \"text\"",
        ),
        (
            "mlp.toml",
            &["--set", "validate.rows=10"],
            "`validate.rows` (--set validate.rows=10): is not read by source = \"synthetic\", which generates load.validation_rows validation rows",
        ),
        (
            "lm.toml",
            &["--set", "load.validation_rows=10"],
            "`load.validation_rows` (--set load.validation_rows=10): is only read by source = \"synthetic\"; a token file's validation windows are validate.fraction (default 0.2), validate.rows or load.validation_path",
        ),
        (
            "lm.toml",
            &["--set", "train.epochs=3"],
            "`train.steps` (file lm.toml:27): and train.epochs = 3 (--set train.epochs=3) both set the run's length: keep one",
        ),
        (
            "mlp.toml",
            &["--set", "validate.every_steps=5"],
            "`validate.every_steps` (--set validate.every_steps=5): counts optimizer steps: give the run as train.steps, or validate every validate.every epochs",
        ),
        (
            "lm.toml",
            &["--set", "train.steps=0"],
            "`train.steps` (--set train.steps=0): must be at least 1 (leave it out for none)",
        ),
        (
            "lm.toml",
            &["--set", "load.path=\"nothing-*.bin\""],
            "nothing-*.bin matches no file (paths are relative to the pipeline file)",
        ),
        (
            "mlp.toml",
            &["--set", "load.source=\"csv\"", "--set", "load.path=\"d.csv\"", "--set", "load.target=\"label\"", "--set", "load.validation_rows=1000", "--set", "checkpoint.every_steps=0"],
            "`checkpoint.every_steps` (--set checkpoint.every_steps=0): must be at least 1 (leave it out for none)",
        ),
    ];
    for (file, args, expected) in cases {
        let o = run(&[&["validate", file][..], args].concat(), dir.path());
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expected), "{args:?}:\n{err}\nexpected: {expected}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // Random windows have no epochs: they need train.steps.
    let epochs = LM
        .replace("steps = 240", "epochs = 2")
        .replace("[validate]\nevery_steps = 60", "[validate]")
        .replace("every_steps = 25", "every = 1");
    write(dir.path(), "e.toml", &epochs);
    let o = run(&["validate", "e.toml"], dir.path());
    let (_, err) = text(&o);
    assert!(err.contains("`load.sampling` (file e.toml:12): \"random\" draws each step's windows anywhere in the stream, so a run has no epochs: give train.steps instead of train.epochs"), "{err}");
    // seq_len = 0 is refused on the plan, never divided by.
    let o = run(&["validate", "lm.toml", "--set", "wrap.model.seq_len=0"], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("`wrap.model.seq_len`") && !err.contains("panicked"), "{err}");
}
