//! `[wrap.mesh]` end to end: a pipeline's copies spelled as the mesh's data dimension run exactly
//! as `wrap.pipeline.replicas` ran (the same groups, the same bits), and the plan prints the mesh.
//! The mesh's refusals are in config_errors.rs.
use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{assert_ok, run, text, write, TINY};
use tch::Tensor;

/// The final model's tensors (the file's metadata names the run, which differs).
fn model(dir: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("model.safetensors")).expect("model.safetensors").into_iter().collect()
}

#[test]
fn a_pipeline_with_mesh_data_2_trains_bit_for_bit_as_two_replicas_did() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let both = [
        "--set",
        "wrap.model.hidden=[16, 16, 16]",
        "--set",
        "train.epochs=1",
        "--set",
        "run.world_size=4",
        "--set",
        "wrap.strategy=\"pipeline\"",
        "--set",
        "wrap.pipeline.micro_batches=2",
    ];
    let go = |out: &str, spelling: &[&str]| {
        let o = run(&[&["run", "p.toml", "--out", out][..], &both, spelling].concat(), dir.path());
        assert_ok(&o);
        o
    };
    go("replicas", &["--set", "wrap.pipeline.replicas=2"]);
    let o = go("mesh", &["--set", "wrap.mesh.data=2"]);
    let out = text(&o).0;
    assert!(out.contains("mesh: data 2 × tensor 1 × pipeline 2"), "{out}");
    assert!(
        out.contains("data groups (copies of the model, each on its own shard of the data): [0, 2] [1, 3]"),
        "{out}"
    );
    assert!(
        out.contains("pipeline groups (a pipeline's stages, activations sent between them): [0, 1] [2, 3]"),
        "{out}"
    );
    assert!(out.contains("ranks 1, 3  8 × 16 from the stage before"), "{out}");
    let (mesh, replicas) = (model(&dir.path().join("mesh")), model(&dir.path().join("replicas")));
    assert_eq!(mesh.keys().collect::<Vec<_>>(), replicas.keys().collect::<Vec<_>>());
    for (name, want) in &replicas {
        assert!(mesh[name].equal(want), "`{name}` differs between the two spellings");
    }
}

#[test]
fn the_pipeline_dimension_alone_gives_the_copies() {
    // data is worked out: 4 ranks / 2 stages = 2 copies.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let o = run(
        &[
            "validate",
            "p.toml",
            "--set",
            "run.world_size=4",
            "--set",
            "wrap.strategy=\"pipeline\"",
            "--set",
            "wrap.mesh.pipeline=2",
            "--set",
            "wrap.model.hidden=[16, 16, 16]",
        ],
        dir.path(),
    );
    assert_ok(&o);
    assert!(text(&o).0.contains("mesh: data 2 × tensor 1 × pipeline 2"), "{}", text(&o).0);
}

#[test]
fn under_tensor_parallelism_the_plan_counts_the_data_ranks_not_every_rank() {
    // 4 ranks of data 2 × tensor 2: two copies read the rows, each split over two ranks.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let args = ["validate", "p.toml", "--set", "run.world_size=4", "--set", "wrap.mesh.tensor=2"];
    let o = run(&[&args[..], &["--set", "wrap.model.hidden=[16, 16]"]].concat(), dir.path());
    assert_ok(&o);
    let plan = text(&o).0;
    for said in [
        "DistributedSampler over 2 data ranks (the 2 ranks of a tensor group read the same rows)",
        "2 replicas, each split over 2 tensor ranks",
    ] {
        assert!(plan.contains(said), "the plan lacks {said:?}:\n{plan}");
    }
    let batch = plan.lines().find(|l| l.contains("5 train")).unwrap();
    let per_rank: usize = batch.split(" of ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(batch.contains(&format!("({} global)", 2 * per_rank)), "{batch}");
}

#[test]
fn a_mesh_spelled_pipeline_resumes_and_ends_as_the_uninterrupted_run() {
    // The resume plans again from the run's config.toml (wrap.mesh.data and replicas = 1 in it).
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let mesh = [
        "--set",
        "run.world_size=4",
        "--set",
        "wrap.strategy=\"pipeline\"",
        "--set",
        "wrap.mesh.data=2",
        "--set",
        "wrap.model.hidden=[16, 16]",
        "--set",
        "checkpoint.every=1",
    ];
    let go = |args: &[&str]| assert_ok(&run(args, dir.path()));
    go(&[&["run", "p.toml", "--out", "whole"][..], &mesh].concat());
    go(&[&["run", "p.toml", "--out", "cut", "--set", "train.epochs=1"][..], &mesh].concat());
    go(&["run", "--resume", "cut", "--set", "train.epochs=2"]);
    let (whole, cut) = (model(&dir.path().join("whole")), model(&dir.path().join("cut")));
    for (name, want) in &whole {
        assert!(cut[name].equal(want), "`{name}` differs from the uninterrupted run's");
    }
}

/// A tiny GPT (vocab 32, d_model 16, 4 heads, 2 blocks, context 8) on synthetic tokens, SGD
/// without clipping (whose global norm is one more reduction), 2 epochs of 4 or 8 steps.
const GPT: &str = r#"
[run]
name = "bytes"
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
vocab = 32
d_model = 16
heads = 4
layers = 2
seq_len = 8
tied = false

[train]
epochs = 2
batch_size = 16
optimizer = "sgd"
lr = 0.5
"#;

/// Each row's `sent_{data,tensor,pipeline}_bytes`, by (epoch, rank).
fn sent(run_dir: &Path) -> Vec<(u32, u32, [f64; 3])> {
    let df = common::trace(run_dir);
    let col = |name: &str| -> Vec<f64> { df.column(name).unwrap().f64().unwrap().into_no_null_iter().collect() };
    let u32s = |name: &str| -> Vec<u32> { df.column(name).unwrap().u32().unwrap().into_no_null_iter().collect() };
    let (data, tensor, pipeline) = (col("sent_data_bytes"), col("sent_tensor_bytes"), col("sent_pipeline_bytes"));
    let (epochs, ranks) = (u32s("epoch"), u32s("rank"));
    (0..df.height()).map(|i| (epochs[i], ranks[i], [data[i], tensor[i], pipeline[i]])).collect()
}

/// The plan's prediction of each rank's bytes per step (plan.json's `sent_per_step_predicted`).
fn predicted(run_dir: &Path) -> Vec<[f64; 3]> {
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("plan.json")).unwrap()).unwrap();
    let ranks = plan["sent_per_step_predicted"].as_array().unwrap_or_else(|| panic!("no prediction in {run_dir:?}"));
    let f = |s: &serde_json::Value, k: &str| s[k].as_f64().unwrap();
    ranks.iter().map(|s| [f(s, "data"), f(s, "tensor"), f(s, "pipeline")]).collect()
}

/// The bytes each rank sends per step along each mesh dimension are counted in the process
/// groups (DDP's Reducer and FSDP's collectives included) and equal what the model's shapes say:
/// DDP all-reduces every gradient (4 bytes × parameters); FSDP all-gathers each unit's shard in
/// the forward pass and again in the backward pass (but the last layer's, kept gathered), and
/// hands its whole padded gradient to the reduction; tensor parallelism all-reduces a block's
/// activations 4 times (the attention's and the MLP's outputs forward, their inputs' gradients
/// backward); a pipeline stage sends its activations forward, or its input's gradients back.
/// The plan predicts each (plan.json), and prints it under the mesh.
#[test]
fn bytes_sent_per_mesh_dimension_are_measured_equal_the_model_s_shapes_and_the_plan_s_prediction() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", GPT);
    let train = |out: &str, extra: &[&str]| {
        let o = run(&[&["run", "p.toml", "--out", out][..], extra].concat(), dir.path());
        assert_ok(&o);
        text(&o).0
    };
    train("ddp", &[]);
    train("fsdp", &["--set", "wrap.strategy=\"fsdp\""]);
    let tp = train("tp", &["--set", "wrap.mesh.tensor=2"]);
    let pp_tp = ["--set", "run.world_size=4", "--set", "wrap.mesh.tensor=2", "--set", "wrap.strategy=\"pipeline\""];
    train("pp-tp", &[&pp_tp[..], &["--set", "wrap.pipeline.micro_batches=2"]].concat());
    train("ddp-tp", &["--set", "run.world_size=4", "--set", "wrap.mesh.tensor=2"]);
    train("sp", &["--set", "wrap.mesh.tensor=2", "--set", "wrap.mesh.sequence_parallel=true"]);
    // Checkpointed blocks run their forward collectives again in the backward pass.
    let full = ["--set", "wrap.activation_checkpointing.policy=\"full\""];
    train("tp-ac", &[&["--set", "wrap.mesh.tensor=2"][..], &full].concat());
    let sp = ["--set", "wrap.mesh.tensor=2", "--set", "wrap.mesh.sequence_parallel=true"];
    train("sp-ac", &[&sp[..], &full, &["--set", "wrap.activation_checkpointing.every=2"]].concat());
    // Selective recomputes a LayerNorm and the all-gather after it.
    train("sp-sel", &[&sp[..], &["--set", "wrap.activation_checkpointing.policy=\"selective\""]].concat());
    // Under sequence parallelism a pipeline's stages send a tensor rank's part of the sequence.
    train("pp-sp", &[&pp_tp[..], &["--set", "wrap.pipeline.micro_batches=2"], &sp[2..]].concat());
    let said = "bytes sent per step per rank, predicted (the trace measures them: sent_data_bytes, sent_tensor_bytes, \
                sent_pipeline_bytes):\n      ranks 0, 1: data 0 B, tensor 64.0 KiB, pipeline 0 B";
    assert!(tp.contains(said), "{tp}");

    let weights = model(&dir.path().join("ddp"));
    let values = |keep: &dyn Fn(&str) -> bool| -> f64 {
        weights.iter().filter(|(n, _)| keep(n)).map(|(_, t)| t.numel() as f64).sum()
    };
    let all = values(&|_| true);
    // The last layer (the final norm and the head) stays gathered from its forward to its backward.
    let last = values(&|n: &str| n.starts_with("ln_f.") || n.starts_with("head."));
    // One block's activations at a tensor group's 16 rows: 16 × 8 tokens × 16 wide, float32.
    let activations = 16.0 * 8.0 * 16.0 * 4.0;
    let expect = |run: &str, want: Option<[f64; 3]>| {
        let plan = predicted(&dir.path().join(run));
        for (epoch, rank, got) in sent(&dir.path().join(run)) {
            let rank = rank as usize;
            if let Some(want) = want {
                assert_eq!(plan[rank], want, "{run}: the plan's prediction for rank {rank} is not the shapes'");
            }
            // The one tolerance: c10d's Reducer broadcasts its rebuilt bucket order from its
            // group's rank 0 once, in the run's second step (a few hundred bytes, unpredicted),
            // which the first epoch's mean holds.
            if got[0] != plan[rank][0] && epoch == 1 && run.starts_with("ddp") {
                assert!(got[0] > plan[rank][0] && got[0] < plan[rank][0] + 256.0, "{run} epoch 1 rank {rank}: {got:?}");
                continue;
            }
            assert_eq!(got, plan[rank], "{run}: epoch {epoch} rank {rank} sent (data, tensor, pipeline) {got:?}");
        }
    };
    expect("ddp", Some([4.0 * all, 0.0, 0.0]));
    // Every parameter's rows divide by 2: no padding.
    expect("fsdp", Some([4.0 * (all / 2.0 + (all - last) / 2.0 + all), 0.0, 0.0]));
    expect("tp", Some([0.0, 2.0 * 4.0 * activations, 0.0]));
    expect("pp-tp", Some([0.0, 4.0 * activations, activations]));
    // Each data group all-reduces a tensor rank's slices; the tensor groups see 16 rows each.
    expect("ddp-tp", None);
    expect("sp", None);
    // Both blocks' two partial outputs all-reduced again.
    expect("tp-ac", Some([0.0, (2.0 * 4.0 + 2.0 * 2.0) * activations, 0.0]));
    expect("sp-ac", None);
    expect("sp-sel", None);
    expect("pp-sp", None);
    assert_eq!(predicted(&dir.path().join("pp-sp"))[0][2], activations / 2.0, "a tensor rank's half of the sequence");
}

/// An MLP of two split pairs (5 → 16 → 16 → 16 → 3) with `train.clip_grad_norm`, on 600 rows in
/// batches of 16 (a short last batch each epoch): the plan's prediction, the epoch's mean per
/// step, equals what each rank measured under TP = 2 (with and without activation
/// checkpointing), DDP × TP (2 × 2) and two copies of a 2-stage pipeline.
#[test]
fn an_mlp_s_predicted_bytes_equal_the_measured_with_clipping_and_short_batches() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let both = ["--set", "wrap.model.hidden=[16, 16, 16]", "--set", "train.clip_grad_norm=1.0"];
    let four = ["--set", "run.world_size=4"];
    let runs: [(&str, Vec<&str>); 4] = [
        ("tp", vec!["--set", "wrap.mesh.tensor=2"]),
        // Each recomputed row-parallel layer all-reduces its partial outputs again.
        ("tp-ac", vec!["--set", "wrap.mesh.tensor=2", "--set", "wrap.activation_checkpointing.policy=\"full\""]),
        ("ddp-tp", [&four[..], &["--set", "wrap.mesh.tensor=2"]].concat()),
        ("pp-copies", [&four[..], &["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.mesh.data=2"]].concat()),
    ];
    for (out, extra) in runs {
        let o = run(&[&["run", "p.toml", "--out", out][..], &both, &extra].concat(), dir.path());
        assert_ok(&o);
        let (plan, measured) = (predicted(&dir.path().join(out)), sent(&dir.path().join(out)));
        for (epoch, rank, got) in measured {
            let want = plan[rank as usize];
            // Both are a total over the epoch's steps divided by their count: equal but for rounding.
            let close = (0..3).all(|i| (got[i] - want[i]).abs() <= 1e-9 * want[i].max(1.0));
            // DDP's one broadcast of its rebuilt buckets, in the first epoch (see above).
            let ddp_once = out == "ddp-tp" && epoch == 1 && got[0] > want[0] && got[0] < want[0] + 256.0;
            assert!(close || ddp_once, "{out}: epoch {epoch} rank {rank} sent {got:?}, the plan predicted {want:?}");
            assert!(want.iter().any(|&b| b > 0.0), "{out}: rank {rank} predicted to send nothing");
        }
    }
}

/// A GPT of one block over a context of 1024 tokens, whose activations (8 heads' attention
/// matrices) outgrow a rank under every strategy over the whole world at 4 ranks: `auto` under
/// `run.memory_per_rank_mb`.
const LONG: &str = r#"
[run]
name = "auto-mesh"
seed = 5
world_size = 4

[load]
rows = 256
validation_rows = 8

[normalize]
method = "none"

[wrap]
strategy = "auto"

[wrap.model]
kind = "transformer"
vocab = 64
d_model = 64
heads = 8
layers = 1
seq_len = 1024
tied = true

[train]
steps = 1
batch_size = 32
optimizer = "sgd"
lr = 0.1
"#;

/// At 300 MiB a rank, no strategy over the whole world fits (DDP and FSDP need about 361 MiB,
/// every block checkpointed 369; the tied head takes no pipeline), two mesh shapes do: data 2 ×
/// tensor 2 (277 MiB) and tensor 4 (250 MiB). `auto` names each and picks the one that sends the
/// least per row trained (data 2 × tensor 2: about the same bytes a step for twice the rows),
/// and the run trains on it. At 100 MiB nothing fits: refused, naming the smallest.
#[test]
fn auto_chooses_the_mesh_shape_that_fits_and_sends_least_or_names_the_smallest() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LONG);
    let o = run(&["run", "p.toml", "--out", "fits", "--set", "run.memory_per_rank_mb=300"], dir.path());
    assert_ok(&o);
    let out = text(&o).0;
    for said in [
        "chose the mesh data 2 × tensor 2 under DDP (wrap.mesh.data = 2, wrap.mesh.tensor = 2): a rank needs 277 MiB \
         within run.memory_per_rank_mb = 300",
        "no strategy over the whole world fits (DDP would need 361 MiB",
        "considered: data 2 × tensor 2 under DDP needs 277 MiB and sends 32 MiB a step of 64 rows, data 2 × tensor 2 \
         under FSDP (ZeRO-3) needs 277 MiB and sends 33 MiB a step of 64 rows, data 1 × tensor 4 under DDP needs 250 \
         MiB and sends 32 MiB a step of 32 rows",
        "mesh: data 2 × tensor 2 × pipeline 1",
    ] {
        assert!(out.contains(said), "the plan lacks {said:?}:\n{out}");
    }
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("fits/plan.json")).unwrap()).unwrap();
    let wrap = &plan["config"]["wrap"];
    assert_eq!(
        (wrap["strategy"].as_str(), wrap["mesh"]["data"].as_u64(), wrap["mesh"]["tensor"].as_u64()),
        (Some("ddp"), Some(2), Some(2))
    );
    assert_eq!(plan["sources"]["wrap.mesh.tensor"], "wrap.strategy = \"auto\"");
    let o = run(&["validate", "p.toml", "--set", "run.memory_per_rank_mb=100"], dir.path());
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    let err = text(&o).1;
    assert!(
        err.contains("`wrap.strategy` (file p.toml:15): no strategy fits run.memory_per_rank_mb = 100 at world size 4"),
        "{err}"
    );
    assert!(
        err.contains("; no mesh shape fits either: data 2 × tensor 2 under DDP needs 277 MiB")
            && err.contains("; the smallest, data 1 × tensor 4 under DDP, needs 250 MiB"),
        "{err}"
    );
}
