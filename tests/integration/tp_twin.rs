//! PyTorch's DTensor tensor parallelism beside the runner's: benches/reference/tp_torch.py
//! (`parallelize_module` with ColwiseParallel q, k, v and fc, RowwiseParallel proj and out, over
//! the "tp" dimension of a ("dp", "tp") device mesh; FSDP2 over "dp" where it has more than one
//! index) and the runner at `[wrap.mesh] tensor = 2`, from the same initial weights and the same
//! data order, give the same loss at every one of 20 optimizer steps within 1e-5 relative: TP
//! alone at 2 ranks, and torchtitan's FSDP2 × TP against the runner's DDP × TP at 2 × 2 ranks;
//! and with sequence parallelism (torchtitan's `SequenceParallel` norms and Shard(1) activations
//! against `wrap.mesh.sequence_parallel`) at 2 ranks, over windows of 16 tokens.
//! The recipe is fsdp2_twin.rs's (AdamW, decay on matrices, clipping that acts on some steps, a
//! cosine schedule after a warmup, a padded shard and short last batches at data 2), so the
//! global norm over split, sharded and replicated gradients is checked too.
use crate::common;

use std::path::Path;
use std::process::Command;

use common::{assert_ok, reference_python, run, write};
use polars::prelude::ChunkCompareEq;

const STEPS: usize = 20;
/// Training windows: 21 at data 1; 11 per data rank at data 2, one of them padding.
const ROWS: usize = 21;

const PIPELINE: &str = r#"
[run]
name = "tp-twin"
seed = 7
world_size = 2
timeout_s = 120
threads_per_rank = 1

[load]
source = "text"
path = "book.txt"
rows = 24                    # 21 training windows, then the 3 that validate.rows holds out

[normalize]
method = "none"

[wrap]
strategy = "ddp"
init = "init.npz"

[wrap.mesh]
tensor = 2

[wrap.model]
kind = "transformer"
vocab = 128
d_model = 32
heads = 4
layers = 3
seq_len = 15
tied = false

[train]
steps = 20
batch_size = 4
optimizer = "adamw"
lr = 0.003
betas = [0.9, 0.95]
weight_decay = 0.1
weight_decay_on = "matrices"
clip_grad_norm = 2.0

[train.schedule]
kind = "cosine"
warmup_steps = 3
min_lr = 0.0003

[validate]
every = 0                    # no validation, but a trace row after every step
every_steps = 1
rows = 3
"#;

/// The twin's loss at every step at `world` ranks, tensor 2, from its RESULT.json; it writes
/// its initial weights (under the runner's names, qkv fused) to init.npz, which the runner reads
/// as wrap.init. `sequence`: with sequence parallelism, over windows of 16 tokens (15 without).
fn twin_losses(dir: &Path, world: usize, sequence: bool) -> Vec<f64> {
    twin_losses_at(dir, world, sequence, if sequence { "16" } else { "15" })
}

/// [`twin_losses`] over windows of `seq_len` tokens.
fn twin_losses_at(dir: &Path, world: usize, sequence: bool, seq_len: &str) -> Vec<f64> {
    let sp = if sequence { &["--sequence-parallel"][..] } else { &[][..] };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/reference/tp_torch.py");
    let o = Command::new(reference_python())
        .args(["-m", "torch.distributed.run", "--standalone", &format!("--nproc_per_node={world}")])
        .arg(script)
        .args(["book.txt", "--tensor", "2", "--rows", &ROWS.to_string(), "--vocab", "128", "--d-model", "32"])
        .args(["--heads", "4", "--layers", "3", "--seq-len", seq_len, "--batch", "4", "--steps", &STEPS.to_string()])
        .args(sp)
        .args(["--row-every", "1", "--optimizer", "adamw", "--lr", "0.003", "--betas", "0.9", "0.95"])
        .args(["--weight-decay", "0.1", "--decay-on", "matrices", "--clip", "2.0", "--schedule", "cosine"])
        .args(["--warmup-steps", "3", "--min-lr", "0.0003", "--seed", "7", "--threads", "1"])
        .args(["--init-out", "init.npz", "--out", "twin.json"])
        .env("OMP_NUM_THREADS", "1")
        .current_dir(dir)
        .output()
        .expect("torchrun");
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "the twin failed:\n{out}\n{err}");
    let result: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("twin.json")).expect("twin.json")).unwrap();
    assert_eq!(result["mesh"], serde_json::json!({"data": world / 2, "tensor": 2}), "{result}");
    assert_eq!(result["sequence_parallel"], serde_json::json!(sequence), "{result}");
    let peaks = result["peak_rss_bytes"].as_array().expect("peak_rss_bytes");
    assert!(peaks.len() == world && peaks.iter().all(|p| p.as_f64().unwrap() > 0.0), "{result}");
    let rows = result["rows"].as_array().expect("rows");
    rows.iter().map(|r| r["loss"].as_f64().expect("a loss per row")).collect()
}

/// Rank 0's trace rows: the global training loss and the gradient norm before clipping, per step.
fn runner_rows(dir: &Path) -> (Vec<f64>, Vec<f64>) {
    let df = common::trace(dir);
    let rows = df.filter(&df.column("rank").unwrap().u32().unwrap().equal(0)).unwrap();
    let col = |c: &str| rows.column(c).unwrap().f64().unwrap().into_no_null_iter().collect::<Vec<f64>>();
    (col("global_train_loss"), col("grad_norm_max"))
}

/// The twin, then the runner at the same mesh (`world` ranks, tensor 2, `sequence` parallel),
/// step by step. With sequence parallelism, the twin with and without it: DTensor's
/// `SequenceParallel` drifts from its own plain tensor parallelism by up to 1.3e-5 relative over
/// these 20 steps (its float noise, which Adam magnifies: the same function), while the runner's
/// stays within 1e-7 of its plain one; so the runner is held within 1e-5 of DTensor's tensor
/// parallelism and within 2e-5 of its sequence parallelism.
fn side_by_side(world: usize, sequence: bool) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "book.txt", &common::book());
    write(p, "p.toml", PIPELINE);
    let mut twins = vec![(twin_losses(p, world, sequence), if sequence { 2e-5 } else { 1e-5 })];
    if sequence {
        std::fs::rename(p.join("twin.json"), p.join("twin-sp.json")).unwrap();
        let plain = twin_losses_at(p, world, false, "16");
        twins.push((plain, 1e-5));
    }
    for (theirs, _) in &twins {
        assert_eq!(theirs.len(), STEPS, "a row per step: {theirs:?}");
    }

    let mut args = vec!["run", "p.toml", "--out", "runner", "--set"];
    let world_size = format!("run.world_size={world}");
    args.push(&world_size);
    if sequence {
        args.extend(["--set", "wrap.mesh.sequence_parallel=true", "--set", "wrap.model.seq_len=16"]);
    }
    assert_ok(&run(&args, p));
    let (ours, norms) = runner_rows(&p.join("runner"));
    assert_eq!(ours.len(), STEPS, "a trace row per step: {ours:?}");
    for (theirs, tolerance) in &twins {
        for (s, (a, b)) in ours.iter().zip(theirs).enumerate() {
            assert!(((a - b) / b).abs() < *tolerance, "{world} ranks, step {}: runner {a}, DTensor {b}", s + 1);
        }
    }
    // Adam is blind to a scale common to every step: clipping shows only where it acts on some
    // steps and not on others.
    assert!(norms.iter().any(|n| *n > 2.0) && norms.iter().any(|n| *n < 2.0), "clipping acts at some steps: {norms:?}");
    assert!(ours[STEPS - 1] < ours[0] - 0.5, "the model learns: {ours:?}");
}

#[test]
fn the_runner_matches_dtensor_tensor_parallelism_step_by_step_at_2_ranks() {
    side_by_side(2, false);
}

#[test]
fn the_runner_s_ddp_times_tp_matches_torchtitan_s_fsdp2_times_tp_at_2_by_2_ranks() {
    side_by_side(4, false);
}

#[test]
fn the_runner_s_sequence_parallelism_matches_dtensor_s_step_by_step_at_2_ranks() {
    side_by_side(2, true);
}
