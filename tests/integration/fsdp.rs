//! `wrap.strategy = "fsdp"` against DDP, its oracle: on the same data, every step's loss within
//! 1e-5 (relative) for each model kind, a parameter whose rows the world size does not divide
//! included; ZeRO-2 and ZeRO-3 bit for bit; the final model equal to DDP's; each rank's measured
//! training state DDP's ÷ N plus the padding and what is gathered at once; the plan's refusals.
use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{assert_ok, run, text, trace, write};
use polars::prelude::*;
use tch::Tensor;

/// 50 optimizer steps with a trace row after each (so each row's loss is one step's), on rows of
/// 7 features: layers 7 → 17 → 9 → 3, so weights of 17, 9 and 3 rows (none divides by 2 or 4)
/// and their biases are padded on every rank count.
const MLP: &str = r#"
[run]
name = "fsdp"
seed = 11
world_size = 2
timeout_s = 60

[load]
rows = 800
features = 7
classes = 3
validation_rows = 16

[wrap.model]
hidden = [17, 9]

[train]
steps = 50
batch_size = 8
optimizer = "adamw"
lr = 0.01
weight_decay = 0.1
weight_decay_on = "matrices"
clip_grad_norm = 0.5

[validate]
every_steps = 1
"#;

/// Rank 0's rows of `col`, in step order.
fn rank0(dir: &Path, col: &str) -> Vec<f64> {
    let df = trace(dir);
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    df.filter(&mask).unwrap().column(col).unwrap().f64().unwrap().into_no_null_iter().collect()
}

fn model(dir: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("model.safetensors")).expect("model.safetensors").into_iter().collect()
}

/// Runs `p.toml` in `dir` into `out` with `sets` (`key=value`).
fn train(dir: &Path, out: &str, sets: &[&str]) {
    let mut args = vec!["run", "p.toml", "--out", out];
    for s in sets {
        args.extend(["--set", s]);
    }
    assert_ok(&run(&args, dir));
}

/// Every step's global loss of `b` within `tol` (relative) of `a`'s, and the same count of steps.
fn assert_losses_close(a: &Path, b: &Path, tol: f64, what: &str) {
    let (x, y) = (rank0(a, "global_train_loss"), rank0(b, "global_train_loss"));
    assert_eq!(x.len(), y.len(), "{what}: steps");
    assert!(x.len() >= 20, "{what}: {} rows", x.len());
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        let rel = (p - q).abs() / p.abs().max(1e-12);
        assert!(rel <= tol, "{what}: step {} loss {q} against DDP's {p} ({rel:e} relative)", i + 1);
    }
}

fn assert_models_close(a: &Path, b: &Path, tol: f64, what: &str) {
    let (x, y) = (model(a), model(b));
    assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>(), "{what}");
    for (name, w) in &x {
        assert_eq!(w.size(), y[name].size(), "{what}: {name}");
        let diff = (&y[name] - w).abs().max().double_value(&[]);
        let scale = w.abs().max().double_value(&[]).max(1e-6);
        assert!(diff / scale <= tol, "{what}: {name} differs by {diff:e} ({:e} of its largest value)", diff / scale);
    }
}

#[test]
fn fsdp_gives_ddps_losses_and_model_at_two_and_four_ranks() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", MLP);
    for w in ["2", "4"] {
        let ws = format!("run.world_size={w}");
        train(dir.path(), &format!("ddp{w}"), &[&ws]);
        let o = run(
            &["run", "p.toml", "--out", &format!("fsdp{w}"), "--set", &ws, "--set", "wrap.strategy=\"fsdp\""],
            dir.path(),
        );
        assert_ok(&o);
        let (stdout, _) = text(&o);
        assert!(stdout.contains(&format!("FSDP (ZeRO-3): each rank holds 1/{w} of every parameter")), "{stdout}");
        let (a, b) = (dir.path().join(format!("ddp{w}")), dir.path().join(format!("fsdp{w}")));
        assert_losses_close(&a, &b, 1e-5, &format!("MLP at world size {w}"));
        assert_models_close(&a, &b, 1e-5, &format!("MLP at world size {w}"));
    }
}

/// The recipe on the shards: bf16 autocast (fp32 shards and reductions), two micro-batches a
/// step, a warmup then a cosine schedule, and early stopping on the validation loss stop FSDP at
/// DDP's step with DDP's losses and learning rates.
#[test]
fn the_recipe_under_fsdp_bf16_accumulation_schedule_early_stopping_gives_ddps_run() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", MLP);
    let recipe = [
        "train.precision=\"bf16\"",
        "train.accumulate=2",
        "train.schedule.kind=\"cosine\"",
        "train.schedule.warmup_steps=5",
        "train.schedule.min_lr=0.001",
    ];
    train(dir.path(), "ddp", &recipe);
    let fsdp: Vec<&str> = recipe.iter().copied().chain(["wrap.strategy=\"fsdp\""]).collect();
    train(dir.path(), "fsdp", &fsdp);
    let (a, b) = (dir.path().join("ddp"), dir.path().join("fsdp"));
    assert_losses_close(&a, &b, 1e-5, "bf16, accumulation and a cosine schedule");
    assert_eq!(rank0(&a, "lr"), rank0(&b, "lr"), "the schedule's learning rates");
    // The weights within 5e-5: the two strategies sum gradients in another order (all-reduce of
    // buckets, reduce-scatter of units), and bf16's forward turns a last-bit difference into one
    // of 2e-5 over 50 steps (the cosine's last steps train above min_lr, as PyTorch's).
    assert_models_close(&a, &b, 5e-5, "bf16, accumulation and a cosine schedule");

    // Early stopping: the same validations, so the same stop.
    let stop = ["train.early_stop.patience=2", "train.early_stop.min_delta=0.05"];
    train(dir.path(), "ddp-stop", &stop);
    let fsdp: Vec<&str> = stop.iter().copied().chain(["wrap.strategy=\"fsdp\""]).collect();
    train(dir.path(), "fsdp-stop", &fsdp);
    let (a, b) = (dir.path().join("ddp-stop"), dir.path().join("fsdp-stop"));
    let (x, y) = (rank0(&a, "global_train_loss"), rank0(&b, "global_train_loss"));
    assert!(x.len() < 50, "early stopping should stop DDP before step 50: {} steps", x.len());
    assert_eq!(x.len(), y.len(), "FSDP stopped at another step than DDP");
    for (p, q) in x.iter().zip(&y) {
        assert!((p - q).abs() <= 1e-5 * p.abs(), "early stopping: loss {q} against DDP's {p}");
    }
}

#[test]
fn zero2_and_zero3_agree_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", MLP);
    let fsdp = "wrap.strategy=\"fsdp\"";
    train(dir.path(), "zero3", &[fsdp, "run.world_size=3"]);
    train(dir.path(), "zero2", &[fsdp, "run.world_size=3", "wrap.fsdp.reshard_after_forward=false"]);
    let (a, b) = (dir.path().join("zero3"), dir.path().join("zero2"));
    assert_eq!(rank0(&a, "global_train_loss"), rank0(&b, "global_train_loss"));
    assert_eq!(rank0(&a, "val_loss"), rank0(&b, "val_loss"));
    for (name, t) in model(&a) {
        assert!(t.equal(&model(&b)[&name]), "{name}");
    }
}

/// A small language model on synthetic tokens, 30 steps with a row after each.
const LM: &str = r#"
[run]
name = "lm"
seed = 5
world_size = 2
timeout_s = 60

[load]
rows = 128
validation_rows = 16

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 33
d_model = 16
heads = 2
layers = 3
seq_len = 8
tied = true
bias = false

[train]
steps = 30
batch_size = 4
optimizer = "adamw"
lr = 0.01
clip_grad_norm = 1.0

[validate]
every_steps = 1
"#;

#[test]
fn transformers_tied_untied_with_and_without_bias_give_ddps_losses() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    let fsdp = "wrap.strategy=\"fsdp\"";
    // Tied head (it reads the embedding's unit), no biases, vocab 33 (odd rows), AdamW.
    for w in ["2", "4"] {
        let ws = format!("run.world_size={w}");
        train(dir.path(), &format!("ddp{w}"), &[&ws]);
        train(dir.path(), &format!("fsdp{w}"), &[&ws, fsdp]);
        let (a, b) = (dir.path().join(format!("ddp{w}")), dir.path().join(format!("fsdp{w}")));
        assert_losses_close(&a, &b, 1e-5, &format!("tied transformer at world size {w}"));
        assert_models_close(&a, &b, 1e-4, &format!("tied transformer at world size {w}"));
    }
    // Untied, with biases. SGD with momentum: a key's bias has a gradient of zero in exact
    // arithmetic (softmax ignores a shift shared by all keys), which Adam would scale from
    // rounding noise up to lr-sized steps, differently under any change of summation order.
    let untied = ["wrap.model.tied=false", "wrap.model.bias=true", "train.optimizer=\"sgd\"", "train.momentum=0.9"];
    train(dir.path(), "ddp-bias", &untied);
    train(dir.path(), "fsdp-bias", &[untied.as_slice(), &[fsdp]].concat());
    let (a, b) = (dir.path().join("ddp-bias"), dir.path().join("fsdp-bias"));
    assert_losses_close(&a, &b, 1e-5, "untied transformer with biases");
    assert_models_close(&a, &b, 1e-5, "untied transformer with biases");
}

/// A CNN with batch norm: its running statistics are rank 0's under FSDP as under DDP (broadcast
/// before each synchronised forward pass), and SyncBatchNorm works across the shards' ranks.
#[test]
fn a_cnn_with_batch_norm_gives_ddps_losses_and_statistics() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "p.toml",
        r#"
[run]
name = "cnn"
seed = 0
world_size = 2
timeout_s = 60

[load]
image = [1, 12, 12]
classes = 5
rows = 400
validation_rows = 40
noise = 2.0

[normalize]
method = "standard"

[wrap.model]
kind = "cnn"
conv = [
  { channels = 6, kernel = 3, padding = 1, batch_norm = true, pool = "max", pool_size = 2 },
  { channels = 5, kernel = 3, padding = 1, batch_norm = true, pool = "max", pool_size = 2 },
]
hidden = [13]

[train]
steps = 30
batch_size = 8
optimizer = "adam"
lr = 0.003

[validate]
every_steps = 1
"#,
    );
    let fsdp = "wrap.strategy=\"fsdp\"";
    for sync in ["false", "true"] {
        let s = format!("wrap.sync_batchnorm={sync}");
        train(dir.path(), &format!("ddp-{sync}"), &[&s]);
        train(dir.path(), &format!("fsdp-{sync}"), &[&s, fsdp]);
        let (a, b) = (dir.path().join(format!("ddp-{sync}")), dir.path().join(format!("fsdp-{sync}")));
        assert_losses_close(&a, &b, 1e-5, &format!("CNN, sync_batchnorm = {sync}"));
        assert_models_close(&a, &b, 1e-5, &format!("CNN, sync_batchnorm = {sync}"));
    }
}

/// A transformer of 8 blocks (each 1/8 of the model) whose vocabulary of 66 rows 4 ranks do not
/// divide: the memory checks' model.
const MEM: &str = r#"
[run]
name = "mem"
seed = 2
world_size = 2
timeout_s = 60

[load]
rows = 64
validation_rows = 8

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 66
d_model = 64
heads = 4
layers = 8
seq_len = 16
tied = false

[train]
steps = 4
batch_size = 4
optimizer = "adamw"

[validate]
every_steps = 2

# Kept by hand: these tests pick strategies by memory, where the plan
# would turn checkpointing on first.
[wrap.activation_checkpointing]
policy = "none"
"#;

/// Every rank's training-state bytes (parameters + gradients + optimizer) of each row.
fn state_bytes(dir: &Path) -> Vec<u64> {
    let df = trace(dir);
    let col = |c: &str| -> Vec<u64> { df.column(c).unwrap().u64().unwrap().into_no_null_iter().collect() };
    let (p, g, o) = (col("param_bytes"), col("grad_bytes"), col("optim_bytes"));
    (0..p.len()).map(|i| p[i] + g[i] + o[i]).collect()
}

/// At N ranks a rank holds DDP's training state ÷ N, plus the padding of its shards (rows of
/// every parameter rounded up to a multiple of N, in the parameter, its gradient and Adam's two
/// moments), plus what is gathered at once: the largest layer's parameters with the all-gather
/// buffer they arrive in, and in the backward pass its gradients in the reduce-scatter's input
/// and in what the all-to-all that does gloo's reduce-scatter brings back.
#[test]
fn a_ranks_measured_state_is_ddps_over_n_plus_padding_and_one_gathered_layer() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", MEM);
    let (d, v, s) = (64i64, 66i64, 16i64);
    // Every parameter: (rows, values per row).
    let mut shapes = vec![(v, d), (s, d), (d, 1), (d, 1), (v, d)];
    let block = [
        (d, 1),
        (d, 1),
        (3 * d, d),
        (3 * d, 1),
        (d, d),
        (d, 1),
        (d, 1),
        (d, 1),
        (4 * d, d),
        (4 * d, 1),
        (d, 4 * d),
        (d, 1),
    ];
    for _ in 0..8 {
        shapes.extend(block);
    }
    let params: i64 = shapes.iter().map(|(r, c)| r * c).sum();
    let block_values: i64 = block.iter().map(|(r, c)| r * c).sum();
    for n in [2i64, 4] {
        let ws = format!("run.world_size={n}");
        train(dir.path(), &format!("ddp{n}"), &[&ws]);
        train(dir.path(), &format!("fsdp{n}"), &[&ws, "wrap.strategy=\"fsdp\""]);
        let ddp = state_bytes(&dir.path().join(format!("ddp{n}")));
        // Parameters, gradients and Adam's two moments, 4 bytes each.
        assert!(ddp.iter().all(|&b| b as i64 == 16 * params), "{ddp:?}");
        let padding: i64 = shapes.iter().map(|(r, c)| ((r + n - 1) / n * n - r) * c).sum();
        let expected = (16 * params / n + 16 * padding / n + 4 * 4 * block_values) as f64;
        for got in state_bytes(&dir.path().join(format!("fsdp{n}"))) {
            let off = (got as f64 - expected).abs() / expected;
            assert!(off <= 0.05, "{n} ranks: {got} bytes, {expected} expected ({:.1}% off)", 100.0 * off);
        }
    }
}

#[test]
fn auto_picks_ddp_zero2_zero3_or_the_pipeline_by_the_memory_limit_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", MEM);
    let validate = |limit: &str| {
        let args = [
            "validate",
            "p.toml",
            "--set",
            "wrap.strategy=\"auto\"",
            "--set",
            &format!("run.memory_per_rank_mb={limit}"),
        ];
        run(&args, dir.path())
    };
    for (limit, chose) in [
        // A rank needs 152 MiB besides its training state (activations, data, libtorch).
        ("160", "chose DDP: a rank needs 159 MiB, training state 6.2 MiB"),
        ("158", "chose FSDP (ZeRO-2): a rank needs 157 MiB, training state 4.9 MiB at once"),
        ("157", "chose FSDP (ZeRO-3): a rank needs 156 MiB, training state 3.9 MiB at once"),
        ("156", "chose the pipeline: a rank needs 154 MiB, training state 3.1 MiB"),
        // Each stage holds its own blocks' activations: less than the tensor-parallel mesh (155 MiB).
        ("155", "chose the pipeline: a rank needs 154 MiB, training state 3.1 MiB"),
    ] {
        let o = validate(limit);
        assert_ok(&o);
        let (stdout, _) = text(&o);
        assert!(stdout.contains(&format!("wrap.strategy = \"auto\": {chose}")), "{limit}: {stdout}");
        assert!(stdout.contains(&format!("within run.memory_per_rank_mb = {limit}")), "{limit}: {stdout}");
    }
    let o = validate("157");
    assert!(text(&o).0.contains(", while DDP would need 159 MiB, FSDP (ZeRO-2) would need 157 MiB"), "{}", text(&o).0);
    // And the chosen strategy is the one that runs.
    let o = run(
        &["run", "p.toml", "--out", "auto", "--set", "wrap.strategy=\"auto\"", "--set", "run.memory_per_rank_mb=157"],
        dir.path(),
    );
    assert_ok(&o);
    assert!(text(&o).0.contains("FSDP (ZeRO-3): each rank holds 1/2 of every parameter"), "{}", text(&o).0);

    let o = validate("153");
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim(),
        "error: p.toml: invalid configuration:\n  `wrap.strategy` (--set wrap.strategy=\"auto\"): no strategy fits \
         run.memory_per_rank_mb = 153 at world size 2: DDP would need 159 MiB, FSDP (ZeRO-2) would need 157 MiB, FSDP \
         (ZeRO-3) would need 156 MiB, the pipeline would need 154 MiB; the pipeline fits from run.world_size = 4 (152 \
         MiB a rank): raise run.world_size, or use a smaller model; no mesh shape fits either: data 1 × tensor 2 under DDP needs 155 MiB and sends 0.5 MiB a step of 4 \
         rows; the smallest, data 1 × tensor 2 under DDP, needs 155 MiB"
    );
}

#[test]
fn a_memory_limit_ddp_cannot_meet_names_where_fsdp_and_the_pipeline_fit() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", MEM);
    let o = run(&["validate", "p.toml", "--set", "run.memory_per_rank_mb=158.5"], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim(),
        "error: p.toml: invalid configuration:\n  `run.memory_per_rank_mb` (--set run.memory_per_rank_mb=158.5): each \
         rank would need 159 MiB (157 MiB with every block checkpointed): 6.2 MiB (parameters 1.6 MiB, gradients 1.6 \
         MiB, optimizer 3.1 MiB) of training state and 152 MiB besides (activations, data, libtorch), under DDP at \
         world size 2, more than the 158.5 MiB a rank may use; wrap.activation_checkpointing.policy = \"full\" fits at \
         this world size (157 MiB a rank; left out, the plan turns it on itself where needed), or wrap.strategy = \"fsdp\" fits at this world size (156 MiB a rank), or wrap.strategy = \"pipeline\" \
         fits at this world size (154 MiB on its heaviest rank); wrap.strategy = \"auto\" picks the first strategy \
         that fits; at this world size the mesh shape data 1 × tensor 2 under DDP (wrap.mesh.data = 1, \
         wrap.mesh.tensor = 2: 155 MiB a rank) fits (set wrap.strategy and [wrap.mesh] so, or wrap.strategy = \"auto\" \
         with no [wrap.mesh] chooses among them)"
    );
    // Under FSDP at 4 ranks it fits, and the plan says what a rank holds.
    let o = run(
        &[
            "validate",
            "p.toml",
            "--set",
            "run.memory_per_rank_mb=158.5",
            "--set",
            "run.world_size=4",
            "--set",
            "wrap.strategy=\"fsdp\"",
        ],
        dir.path(),
    );
    assert_ok(&o);
    assert!(text(&o).0.contains("training state under FSDP (ZeRO-3): 2.3 MiB"), "{}", text(&o).0);
}

#[test]
fn keys_of_other_strategies_are_refused_under_fsdp_and_fsdps_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", MLP);
    let refused = |sets: &[&str], want: &str| {
        let mut args = vec!["validate", "p.toml"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let o = run(&args, dir.path());
        assert_eq!(o.status.code(), Some(2), "{sets:?}");
        let (_, stderr) = text(&o);
        assert!(stderr.contains(want), "{sets:?}: {stderr}");
    };
    let fsdp = "wrap.strategy=\"fsdp\"";
    refused(&[fsdp, "wrap.pipeline.micro_batches=2"], "`wrap.pipeline.micro_batches` (--set wrap.pipeline.micro_batches=2): is only read by wrap.strategy = \"pipeline\"");
    refused(&[fsdp, "wrap.bucket_cap_mb=5"], "`wrap.bucket_cap_mb` (--set wrap.bucket_cap_mb=5): is only read by wrap.strategy = \"ddp\": FSDP reduce-scatters each layer's gradients as one bucket");
    refused(&["wrap.fsdp.reshard_after_forward=false"], "`wrap.fsdp.reshard_after_forward` (--set wrap.fsdp.reshard_after_forward=false): is only read by wrap.strategy = \"fsdp\"");
    refused(
        &["wrap.strategy=\"auto\"", "wrap.fsdp.reshard_after_forward=false"],
        "is chosen by wrap.strategy = \"auto\" itself (ZeRO-2 where it fits, else ZeRO-3)",
    );
    refused(
        &[fsdp, "run.threads_per_rank=2", "wrap.threads_per_replica=1"],
        "are for whole replicas (wrap.strategy = \"ddp\" or \"none\"), not a sharded model's layers",
    );
}
