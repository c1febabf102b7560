//! Sequence parallelism (`wrap.mesh.sequence_parallel`): between a transformer's split layers
//! the activations are split along the sequence over the tensor group, and training stays the
//! one-process training, dropout included; the plan refuses what it cannot split.
use crate::common;

/// The tensor-parallel tests' language model, 16 optimizer steps long (two epochs).
fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::write(dir.path(), "p.toml", &crate::tensor_parallel::LM.replace("epochs = 2", "steps = 16"));
    dir
}

/// A trace row after every optimizer step, so that the runs compare step by step; dropout in the
/// embedding, the attention and the residuals (the masks one process draws).
const SHORT: [&str; 4] = ["--set", "validate.every_steps=1", "--set", "wrap.model.dropout=0.1"];

const SP: [&str; 6] =
    ["--set", "run.world_size=2", "--set", "wrap.mesh.tensor=2", "--set", "wrap.mesh.sequence_parallel=true"];

/// Runs `p.toml` in `dir` into `out` with `extra`; the run's stdout.
fn train(dir: &std::path::Path, out: &str, extra: &[&str]) -> String {
    let o = common::run(&[&["run", "p.toml", "--out", out][..], extra].concat(), dir);
    common::assert_ok(&o);
    common::text(&o).0
}

#[test]
fn gpt2_and_llama_with_sequence_parallelism_at_tensor_2_train_as_one_process_dropout_included() {
    let dir = setup();
    let llama =
        ["--set", "wrap.model.family=\"llama\"", "--set", "wrap.model.kv_heads=2", "--set", "wrap.model.mlp_hidden=24"];
    for (name, model) in [("gpt2", &[][..]), ("llama", &llama[..])] {
        let (one, split) = (format!("{name}-one"), format!("{name}-sp"));
        train(dir.path(), &one, &[model, &SHORT].concat());
        let stdout = train(dir.path(), &split, &[model, &SHORT, &SP].concat());
        assert!(stdout.contains("sequence parallel: between the split layers each tensor rank holds 1/2"), "{stdout}");
        assert!(stdout.contains("where tensor parallelism alone keeps"), "{stdout}");
        common::assert_close_runs(&dir.path().join(&split), &dir.path().join(&one), 1e-5);
    }
}

/// Without dropout: two copies of the model draw their own masks for their halves of the batch,
/// not the one process's (as under DDP).
#[test]
fn fsdp_and_ddp_times_tensor_with_sequence_parallelism_at_4_ranks_equal_one_process() {
    let dir = setup();
    let steps = ["--set", "validate.every_steps=1"];
    train(dir.path(), "one", &steps);
    let mesh = [
        "--set",
        "run.world_size=4",
        "--set",
        "wrap.mesh.tensor=2",
        "--set",
        "wrap.mesh.sequence_parallel=true",
        "--set",
        "wrap.strategy=\"fsdp\"",
        "--set",
        "train.batch_size=8",
    ];
    train(dir.path(), "fsdp-sp", &[&steps[..], &mesh].concat());
    common::assert_close_runs(&dir.path().join("fsdp-sp"), &dir.path().join("one"), 1e-5);
    // DDP across the copies instead.
    train(dir.path(), "ddp-sp", &[&steps[..], &mesh[..6], &mesh[8..]].concat());
    common::assert_close_runs(&dir.path().join("ddp-sp"), &dir.path().join("one"), 1e-5);
}

#[test]
fn a_sequence_the_tensor_ranks_cannot_split_and_sequence_parallelism_without_them_are_refused() {
    let dir = setup();
    let refused = |extra: &[&str]| {
        let o = common::run(&[&["validate", "p.toml"][..], extra].concat(), dir.path());
        assert_eq!(o.status.code(), Some(2), "{:?}", common::text(&o));
        common::text(&o).1
    };
    let stderr = refused(&[&SP[..], &["--set", "wrap.model.seq_len=9"]].concat());
    assert!(
        stderr.contains(
            "`wrap.mesh.sequence_parallel` (--set wrap.mesh.sequence_parallel=true): 2 tensor ranks cannot split \
             wrap.model.seq_len = 9 evenly along the sequence; the tensor degrees that divide it: 1, 3, 9"
        ),
        "{stderr}"
    );
    let stderr = refused(&["--set", "wrap.mesh.sequence_parallel=true"]);
    assert!(stderr.contains("but wrap.mesh.tensor = 1; set wrap.mesh.tensor above 1"), "{stderr}");
}
