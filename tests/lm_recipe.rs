//! nanoGPT's recipe: the optimizer and model keys it needs (betas, weight decay on matrices, a
//! transformer without biases) against the PyTorch twin, step by step at world sizes 1 and 2.
mod common;

use std::path::Path;
use std::process::Command;

use common::{assert_ok, reference_python, run, write};
use polars::prelude::ChunkCompareEq;

/// Windows of `SEQ` + 1 bytes: `ROWS` to train on, `VAL` held out.
const SEQ: usize = 16;
const ROWS: usize = 16;
const VAL: usize = 4;
const STEPS: usize = 20;

const TWIN: &str = r#"
[run]
name = "twin"
seed = 3
timeout_s = 60
threads_per_rank = 1

[load]
source = "text"
path = "book.txt"
rows = 16

[normalize]
method = "none"

[wrap]
init = "init.npz"

[wrap.model]
kind = "transformer"
vocab = 256
d_model = 32
heads = 4
layers = 2
seq_len = 16
tied = true
bias = false

[train]
epochs = 20
optimizer = "adamw"
lr = 0.002
betas = [0.9, 0.99]
weight_decay = 0.1
weight_decay_on = "matrices"

[validate]
every = 0
rows = 4
"#;

/// The twin's per-epoch losses (`epoch E loss L` lines).
fn twin_losses(dir: &Path, world: usize, batch: usize) -> Vec<f64> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/reference/transformer_torch.py");
    let o = Command::new(reference_python())
        .args(["-m", "torch.distributed.run", "--standalone", &format!("--nproc_per_node={world}")])
        .arg(script)
        .args(["book.txt", "--rows", &ROWS.to_string(), "--val", &VAL.to_string(), "--d-model", "32"])
        .args(["--heads", "4", "--layers", "2", "--seq-len", &SEQ.to_string(), "--tied", "--no-bias"])
        .args(["--batch", &batch.to_string(), "--epochs", &STEPS.to_string(), "--optimizer", "adamw"])
        .args(["--lr", "0.002", "--weight-decay", "0.1", "--decay-on", "matrices", "--betas", "0.9", "0.99"])
        .args(["--seed", "3", "--threads", "1", "--init-out", "init.npz"])
        .env("OMP_NUM_THREADS", "1")
        .current_dir(dir)
        .output()
        .expect("torchrun");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "the twin failed: {out}\n{}", String::from_utf8_lossy(&o.stderr));
    out.lines().filter_map(|l| l.strip_prefix("epoch ")?.split(" loss ").nth(1)?.parse().ok()).collect()
}

fn runner_losses(dir: &Path, out: &str) -> Vec<f64> {
    let df = common::trace(&dir.join(out));
    let rank = df.column("rank").unwrap().u32().unwrap().equal(0);
    let rows = df.filter(&rank).unwrap();
    rows.column("global_train_loss").unwrap().f64().unwrap().into_no_null_iter().collect()
}

#[test]
fn betas_decay_on_matrices_and_no_bias_match_the_pytorch_twin_step_by_step() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let text: String = (0..200).map(|i| format!("{i}: to be, or not to be, that is the question. ")).collect();
    write(p, "book.txt", &text[..(ROWS + VAL) * SEQ + 1]);
    write(p, "twin.toml", TWIN);
    for (world, batch) in [(1, 16), (2, 8)] {
        let theirs = twin_losses(p, world, batch);
        assert_eq!(theirs.len(), STEPS, "one step per epoch: {theirs:?}");
        let out = format!("w{world}");
        let o = run(
            &["run", "twin.toml", "--out", &out, "--set", &format!("run.world_size={world}"), "--set",
              &format!("train.batch_size={batch}")],
            p,
        );
        assert_ok(&o);
        let ours = runner_losses(p, &out);
        assert_eq!(ours.len(), STEPS);
        for (s, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(((a - b) / b).abs() < 1e-5, "world size {world}, step {}: runner {a}, torch {b}", s + 1);
        }
        assert!(ours[STEPS - 1] < ours[0] - 0.5, "the model learns: {ours:?}");
    }
}
