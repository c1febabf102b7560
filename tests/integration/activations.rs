//! `wrap.activation_checkpointing`: recomputing blocks in the backward pass gives the same bits
//! as keeping their activations (every trace column but the timings, and the final model's
//! bytes), with dropout, under DDP and FSDP at one and two ranks, in a pipeline and under tensor
//! parallelism, for a transformer and an MLP; the plan's refusals.
use crate::common;

use std::path::Path;

use common::{assert_ok, assert_same_trace, run, text, write};
use polars::prelude::{ParquetReader, SerReader};
use tch::{Kind, Tensor};

/// A small language model with dropout (in the embedding, the attention and the residual
/// branches): 64 training windows of 8 + 1 tokens, a trace row every step.
const LM: &str = r#"
[run]
name = "ac"
seed = 5
world_size = 1
timeout_s = 60

[load]
rows = 64
validation_rows = 8

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 32
d_model = 16
heads = 2
layers = 3
seq_len = 8
tied = false
dropout = 0.2

[train]
epochs = 1
batch_size = 8
optimizer = "adamw"
lr = 0.01

[trace]
log_every_steps = 1
"#;

/// Trains `p.toml` into `out` with `sets`.
fn train(dir: &Path, out: &str, sets: &[String]) {
    let mut args = vec!["run", "p.toml", "--out", out];
    for s in sets {
        args.extend(["--set", s.as_str()]);
    }
    assert_ok(&run(&args, dir));
}

/// The run in `out` equals the one in `base`: every trace column but the timings, and the final
/// model byte for byte.
fn assert_same_run(dir: &Path, base: &str, out: &str) {
    let (a, b) = (dir.join(base), dir.join(out));
    assert_same_trace(&a, &b);
    // Each tensor's bytes (the file's metadata names the run).
    let model = |d: &Path| -> Vec<(String, Vec<u8>)> {
        let tensors = Tensor::read_safetensors(d.join("model.safetensors")).expect("model.safetensors");
        let bytes = |t: &Tensor| Vec::<u8>::try_from(t.view_dtype(Kind::Uint8).flatten(0, -1)).unwrap();
        let mut named: Vec<(String, Vec<u8>)> = tensors.iter().map(|(name, t)| (name.clone(), bytes(t))).collect();
        named.sort();
        named
    };
    let (x, y) = (model(&a), model(&b));
    assert_eq!(x.len(), y.len(), "{out}: tensors");
    for ((name, p), (other, q)) in x.iter().zip(&y) {
        assert!(name == other && p == q, "{out}: `{name}` differs from {base}'s");
    }
}

/// Under `layout` (--set values), runs without checkpointing, with every block checkpointed and
/// with every second one, and for a transformer (`selective`) with every block's products kept
/// and the rest recomputed: the runs are the same bits.
fn assert_checkpointing_changes_nothing(dir: &Path, name: &str, layout: &[&str], selective: bool) {
    let sets = |extra: &[&str]| -> Vec<String> { layout.iter().chain(extra).map(|s| s.to_string()).collect() };
    train(dir, &format!("{name}-none"), &sets(&[]));
    train(dir, &format!("{name}-full"), &sets(&["wrap.activation_checkpointing.policy=\"full\""]));
    let every2 = ["wrap.activation_checkpointing.policy=\"full\"", "wrap.activation_checkpointing.every=2"];
    train(dir, &format!("{name}-every2"), &sets(&every2));
    let mut policies = vec!["full", "every2"];
    if selective {
        train(dir, &format!("{name}-selective"), &sets(&["wrap.activation_checkpointing.policy=\"selective\""]));
        policies.push("selective");
    }
    for policy in policies {
        assert_same_run(dir, &format!("{name}-none"), &format!("{name}-{policy}"));
    }
    // steps.parquet's recompute_s: the time spent recomputing, only where blocks are.
    let recompute = |run: &str| -> f64 {
        let file = std::fs::File::open(dir.join(run).join("steps.parquet")).expect("steps.parquet");
        let steps = ParquetReader::new(file).finish().unwrap();
        steps.column("recompute_s").unwrap().f64().unwrap().into_no_null_iter().sum()
    };
    assert_eq!(recompute(&format!("{name}-none")), 0.0, "{name}");
    assert!(recompute(&format!("{name}-full")) > 0.0, "{name}");
    if selective {
        assert!(recompute(&format!("{name}-selective")) > 0.0, "{name}");
    }
}

#[test]
fn checkpointed_transformer_blocks_give_the_same_bits_under_ddp_at_one_and_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    assert_checkpointing_changes_nothing(dir.path(), "ddp1", &[], true);
    assert_checkpointing_changes_nothing(dir.path(), "ddp2", &["run.world_size=2", "train.batch_size=4"], true);
    // Under bf16 autocast the kept products are bfloat16, and their gradients return to float32
    // as a plain linear's do.
    let bf16 = "train.precision=\"bf16\"";
    train(dir.path(), "bf16-none", &[bf16.into()]);
    train(dir.path(), "bf16-selective", &[bf16.into(), "wrap.activation_checkpointing.policy=\"selective\"".into()]);
    assert_same_run(dir.path(), "bf16-none", "bf16-selective");
    // Llama's blocks (RMSNorm, kept; SwiGLU; no biases; one key and value head; RoPE), under bf16.
    let llama = LM.replace("kind = \"transformer\"", "kind = \"transformer\"\nfamily = \"llama\"\nkv_heads = 1");
    write(dir.path(), "p.toml", &llama);
    train(dir.path(), "llama-none", &[bf16.into()]);
    train(dir.path(), "llama-selective", &[bf16.into(), "wrap.activation_checkpointing.policy=\"selective\"".into()]);
    assert_same_run(dir.path(), "llama-none", "llama-selective");
}

#[test]
fn checkpointed_transformer_blocks_give_the_same_bits_under_fsdp_at_one_and_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    let fsdp = "wrap.strategy=\"fsdp\"";
    assert_checkpointing_changes_nothing(dir.path(), "fsdp1", &[fsdp], true);
    assert_checkpointing_changes_nothing(dir.path(), "fsdp2", &[fsdp, "run.world_size=2", "train.batch_size=4"], true);
    // ZeRO-2 keeps each layer gathered until its backward: the recomputation reads it there too.
    let zero2 = "wrap.fsdp.reshard_after_forward=false";
    let zero2 = [fsdp, zero2, "run.world_size=2", "train.batch_size=4"];
    assert_checkpointing_changes_nothing(dir.path(), "zero2", &zero2, true);
}

#[test]
fn checkpointed_blocks_give_the_same_bits_in_a_pipeline_and_in_an_mlp_with_bf16() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    let pipeline = ["wrap.strategy=\"pipeline\"", "run.world_size=2", "wrap.pipeline.micro_batches=2"];
    assert_checkpointing_changes_nothing(dir.path(), "pipe", &pipeline, true);
    // An MLP's hidden layers (activation, dropout, product), under autocast to bfloat16, on two
    // ranks: the recomputation casts as the forward did.
    let mlp = r#"
[run]
name = "ac-mlp"
seed = 3
world_size = 2
timeout_s = 60

[load]
rows = 256
features = 6
classes = 3
validation_rows = 16

[wrap.model]
hidden = [32, 32, 16]
dropout = 0.3

[train]
steps = 12
batch_size = 8
precision = "bf16"

[trace]
log_every_steps = 1
"#;
    write(dir.path(), "p.toml", mlp);
    assert_checkpointing_changes_nothing(dir.path(), "mlp", &[], false);
}

/// Under tensor parallelism the recomputation runs the block's collectives again (its
/// all-reduces, or under sequence parallelism its all-gathers and reduce-scatters): the same bits
/// under full and selective checkpointing at TP = 2, with and without sequence parallelism, under
/// FSDP × TP at 4 ranks, for Llama's blocks, and for an MLP's split pairs.
#[test]
fn checkpointed_blocks_give_the_same_bits_under_tensor_parallelism() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    let tp = ["run.world_size=2", "wrap.mesh.tensor=2"];
    assert_checkpointing_changes_nothing(dir.path(), "tp2", &tp, true);
    let sp = ["run.world_size=2", "wrap.mesh.tensor=2", "wrap.mesh.sequence_parallel=true"];
    assert_checkpointing_changes_nothing(dir.path(), "sp2", &sp, true);
    let fsdp_tp = ["run.world_size=4", "wrap.mesh.tensor=2", "wrap.strategy=\"fsdp\"", "train.batch_size=4"];
    assert_checkpointing_changes_nothing(dir.path(), "fsdp-tp", &fsdp_tp, true);
    // Llama's blocks (an RMSNorm's output kept, SwiGLU's gate and up split together), with
    // sequence parallelism.
    let llama = LM.replace("kind = \"transformer\"", "kind = \"transformer\"\nfamily = \"llama\"\nkv_heads = 2");
    write(dir.path(), "p.toml", &llama);
    assert_checkpointing_changes_nothing(dir.path(), "llama-sp2", &sp, true);
    let mlp = "[run]\nseed = 3\nworld_size = 2\n\n[load]\nrows = 128\nfeatures = 6\nclasses = 3\n\n\
               [wrap.model]\nhidden = [32, 32, 16]\ndropout = 0.3\n\n[wrap.mesh]\ntensor = 2\n\n\
               [train]\nsteps = 8\nbatch_size = 8\n\n[trace]\nlog_every_steps = 1\n";
    write(dir.path(), "p.toml", mlp);
    assert_checkpointing_changes_nothing(dir.path(), "mlp-tp", &[], false);
}

#[test]
fn the_plan_refuses_what_cannot_be_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    let refused = |sets: &[&str], want: &str| {
        let mut args = vec!["validate", "p.toml"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let o = run(&args, dir.path());
        let (_, stderr) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(want), "{stderr}");
    };
    let full = "wrap.activation_checkpointing.policy=\"full\"";
    refused(&["wrap.activation_checkpointing.policy=\"some\""], "`wrap.activation_checkpointing.policy` cannot be \"some\"; did you mean \"none\"? (one of: \"none\", \"full\", \"selective\")");
    refused(
        &[full, "wrap.activation_checkpointing.every=0"],
        "`wrap.activation_checkpointing.every` (--set wrap.activation_checkpointing.every=0): must be at least 1 (1: \
         every block, k: every k-th block)",
    );
    refused(
        &["wrap.activation_checkpointing.every=2"],
        "`wrap.activation_checkpointing.every` (--set wrap.activation_checkpointing.every=2): is only read with a \
         policy other than \"none\"; remove it",
    );
    write(dir.path(), "p.toml", "[load]\nrows = 64\nfeatures = 4\nclasses = 2\n\n[wrap.model]\nhidden = []\n");
    refused(
        &[full],
        "`wrap.activation_checkpointing.policy` (--set wrap.activation_checkpointing.policy=\"full\"): an MLP without hidden layers has no layer to recompute; set it to \
         \"none\" (a transformer's blocks and an MLP's hidden layers can be checkpointed)",
    );
    refused(
        &["wrap.activation_checkpointing.policy=\"selective\""],
        "`wrap.activation_checkpointing.policy` (--set wrap.activation_checkpointing.policy=\"selective\"): \
         \"selective\" recomputes a transformer block's norms and activation between its products, which an MLP's \
         layers do not have; set it to \"full\"",
    );
    let cnn = "[load]\nimage = [1, 8, 8]\nclasses = 3\nrows = 64\n\n[wrap.model]\nkind = \"cnn\"\n\
               conv = [{ channels = 4, kernel = 3, padding = 1, pool = \"max\" }]\n";
    write(dir.path(), "p.toml", cnn);
    refused(&[full], "a CNN's blocks cannot be recomputed (not implemented); set it to \"none\"");
}

/// The plan's activation model against the measured peak: a model whose activations are most
/// of its memory ([`long_lm`]), without checkpointing, with full and with selective. The
/// whole-process estimate holds within 15% of every rank's peak under each policy, the peak
/// falls by at least 60% of what the plan says checkpointing saves, and selective's peak lies
/// between the other two.
#[test]
fn the_estimate_holds_with_and_without_checkpointing_and_the_saving_is_measured() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &long_lm());
    train(dir.path(), "none", &[]);
    train(dir.path(), "full", &["wrap.activation_checkpointing.policy=\"full\"".into()]);
    train(dir.path(), "selective", &["wrap.activation_checkpointing.policy=\"selective\"".into()]);
    let (none, full, selective) = (dir.path().join("none"), dir.path().join("full"), dir.path().join("selective"));
    common::assert_estimate_holds(&none);
    common::assert_estimate_holds(&full);
    common::assert_estimate_holds(&selective);
    let activations = |d: &Path| -> f64 {
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("plan.json")).unwrap()).unwrap();
        plan["memory"]["activations"].as_f64().unwrap()
    };
    let peak = |d: &Path| -> f64 {
        let t = common::trace(d);
        t.column("peak_rss_bytes").unwrap().u64().unwrap().into_no_null_iter().max().unwrap() as f64
    };
    for policy in [&full, &selective] {
        let (planned, measured) = (activations(&none) - activations(policy), peak(&none) - peak(policy));
        let name = policy.display();
        assert!(planned > 0.0 && measured >= 0.6 * planned, "{name}: saved {measured:.0} bytes, planned {planned:.0}");
    }
    let mib = |d: &Path| peak(d) / 1048576.0;
    let (n, f, s) = (mib(&none), mib(&full), mib(&selective));
    assert!(f < s && s < n, "peaks: none {n:.0} MiB, selective {s:.0} MiB, full {f:.0} MiB");
}

/// A transformer whose activations are most of its memory: context 512, 6 blocks of width 128,
/// batches of 4 windows (the plan: 290 MiB a rank without checkpointing, 206 MiB with every
/// block checkpointed).
fn long_lm() -> String {
    LM.replace("d_model = 16", "d_model = 128")
        .replace("heads = 2", "heads = 4")
        .replace("layers = 3", "layers = 6")
        .replace("seq_len = 8", "seq_len = 512")
        .replace("vocab = 32", "vocab = 512")
        .replace("dropout = 0.2", "dropout = 0.0")
        .replace("rows = 64", "rows = 8")
        .replace("validation_rows = 8", "validation_rows = 4")
        .replace("batch_size = 8", "batch_size = 4")
}

/// `run.memory_per_rank_mb` and `wrap.strategy = "auto"` turn checkpointing on before another
/// strategy or more ranks: selective where it fits (it recomputes no product), else full on the
/// fewest blocks that fit, and say so, under tensor parallelism too; a policy set by hand is kept (and the refusal says
/// checkpointing would fit); the run checkpoints as the plan chose.
#[test]
fn a_memory_limit_turns_checkpointing_on_before_another_strategy_or_more_ranks() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &long_lm());
    let validate = |sets: &[&str]| {
        let mut args = vec!["validate", "p.toml"];
        for s in sets {
            args.extend(["--set", s]);
        }
        run(&args, dir.path())
    };
    let o = validate(&["run.memory_per_rank_mb=250"]);
    assert_ok(&o);
    let out = text(&o).0;
    assert!(out.contains("activation checkpointing: selective, every block (6 of 6 keeping"), "{out}");
    assert!(
        out.contains(
            "run.memory_per_rank_mb = 250 turned it on: a rank needs 248 MiB with it, 290 MiB without, under DDP at \
             world size 1"
        ),
        "{out}"
    );
    // Less room: full, on every block (every 2nd would need 254 MiB).
    let o = validate(&["run.memory_per_rank_mb=230"]);
    assert_ok(&o);
    let out = text(&o).0;
    assert!(out.contains("activation checkpointing: full, every block (6 of 6 recomputed"), "{out}");
    assert!(out.contains("a rank needs 206 MiB with it, 290 MiB without"), "{out}");
    // auto tries checkpointing under DDP before FSDP.
    let o = validate(&["run.memory_per_rank_mb=250", "wrap.strategy=\"auto\"", "run.world_size=2", "load.rows=16"]);
    assert_ok(&o);
    let out = text(&o).0;
    assert!(
        out.contains(
            "wrap.strategy = \"auto\": chose DDP with activation checkpointing (selective, every block): a rank \
             needs 248 MiB"
        ),
        "{out}"
    );
    assert!(out.contains("where keeping every activation it would need 290 MiB"), "{out}");
    // Under tensor parallelism too (the recomputation runs the block's collectives again).
    let o = validate(&["run.memory_per_rank_mb=225", "run.world_size=2", "wrap.mesh.tensor=2"]);
    assert_ok(&o);
    let out = text(&o).0;
    assert!(out.contains("activation checkpointing: selective, every block (6 of 6 keeping"), "{out}");
    assert!(out.contains("a rank needs 215 MiB with it, 242 MiB without"), "{out}");
    // "none" set by hand stays: the refusal says what checkpointing would need.
    let o = validate(&["run.memory_per_rank_mb=250", "wrap.activation_checkpointing.policy=\"none\""]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o).1;
    assert!(err.contains("each rank would need 290 MiB (206 MiB with every block checkpointed)"), "{err}");
    assert!(
        err.contains("wrap.activation_checkpointing.policy = \"full\" fits at this world size (206 MiB a rank"),
        "{err}"
    );
    // The run recomputes, and records the policy the plan chose.
    train(dir.path(), "limited", &["run.memory_per_rank_mb=250".into()]);
    let config = std::fs::read_to_string(dir.path().join("limited/config.toml")).unwrap();
    assert!(config.contains("policy = \"selective\""), "{config}");
    let file = std::fs::File::open(dir.path().join("limited/steps.parquet")).expect("steps.parquet");
    let steps = ParquetReader::new(file).finish().unwrap();
    let recompute: f64 = steps.column("recompute_s").unwrap().f64().unwrap().into_no_null_iter().sum();
    assert!(recompute > 0.0, "recompute_s {recompute}");
}
