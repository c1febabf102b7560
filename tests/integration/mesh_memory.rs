//! The plan's whole-process memory estimate under every mesh shape, against each rank's measured
//! peak: tensor parallelism alone, DDP × TP, FSDP × TP, pipeline × TP (1F1B), pipeline × data
//! and the 3-D mesh at 8 ranks. A pipeline's ranks differ (each holds its stage's layers and
//! activations): the plan estimates each rank's own.
use crate::common;

use common::{assert_estimate_holds, assert_ok, run, text, write};

/// A GPT of 4 blocks over a context of 512 tokens: its activations are most of each rank's
/// memory beyond libtorch's, so a stage or a tensor slice estimated wrong shows in the peak.
const LM: &str = r#"
[run]
name = "mesh-memory"
seed = 5
world_size = 4

[load]
rows = 64
validation_rows = 8

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 64
d_model = 64
heads = 8
layers = 4
seq_len = 512
tied = false

[train]
steps = 1
batch_size = 16
optimizer = "sgd"
lr = 0.1
"#;

#[test]
fn the_estimate_holds_on_every_rank_under_every_mesh_shape() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    let pipeline = "wrap.strategy=\"pipeline\"";
    let one_f_one_b = ["wrap.pipeline.schedule=\"1f1b\"", "wrap.pipeline.micro_batches=4"];
    let shapes: [(&str, Vec<&str>); 6] = [
        ("tp4", vec!["wrap.mesh.tensor=4"]),
        ("ddp2xtp2", vec!["wrap.mesh.tensor=2"]),
        ("fsdp2xtp2", vec!["wrap.strategy=\"fsdp\"", "wrap.mesh.tensor=2"]),
        ("pp2xtp2", [&[pipeline, "wrap.mesh.pipeline=2", "wrap.mesh.tensor=2"][..], &one_f_one_b].concat()),
        ("pp2xdata2", vec![pipeline, "wrap.mesh.pipeline=2", "wrap.mesh.data=2"]),
        ("3d", vec!["run.world_size=8", pipeline, "wrap.mesh.pipeline=2", "wrap.mesh.tensor=2", "wrap.mesh.data=2"]),
    ];
    for (out, sets) in shapes {
        let mut args = vec!["run", "p.toml", "--out", out];
        for s in &sets {
            args.extend(["--set", s]);
        }
        let o = run(&args, dir.path());
        assert_ok(&o);
        assert_estimate_holds(&dir.path().join(out));
        if sets.contains(&pipeline) {
            // Each stage's own estimate (its layers, its micro-batches in flight), printed beside
            // its peak.
            let plan: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.path().join(out).join("plan.json")).unwrap())
                    .unwrap();
            let by_rank = plan["memory_by_rank"].as_array().expect("memory_by_rank");
            assert!(by_rank.iter().any(|e| e["activations"] != by_rank[0]["activations"]), "{out}: {by_rank:?}");
            assert!(text(&o).0.contains("peak memory: rank 0"), "{}", text(&o).0);
        }
    }
}

/// A GPT of 2 blocks over 256 tokens at 4 ranks, `wrap.strategy = "auto"`, its checkpointing
/// set to "none" by hand (the plan may not turn it on).
const AUTO: &str = r#"
[run]
name = "auto-pipeline"
seed = 5
world_size = 4

[load]
rows = 256
validation_rows = 8

[normalize]
method = "none"

[wrap]
strategy = "auto"

[wrap.activation_checkpointing]
policy = "none"

[wrap.model]
kind = "transformer"
vocab = 64
d_model = 64
heads = 8
layers = 2
seq_len = 256
tied = false

[train]
steps = 1
batch_size = 64
optimizer = "sgd"
lr = 0.1
"#;

/// At 220 MiB a rank no strategy over the whole world fits (the pipeline of 4 stages needs 237
/// MiB: one whole block on a rank), nor any shape without a pipeline (tensor 4: 229 MiB, every
/// rank keeping both blocks' replicated activations), nor a pipeline of 2 copies (246 MiB): only
/// a pipeline of 2 stages × tensor 2 does (210 MiB: half a block's split activations on each
/// rank). `auto` names every shape, picks it, and the run trains on it, within its estimate. At
/// 150 MiB nothing fits: refused, naming the smallest.
#[test]
fn auto_chooses_a_pipeline_times_tensor_mesh_where_only_it_fits_or_names_the_smallest() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", AUTO);
    let o = run(&["run", "p.toml", "--out", "fits", "--set", "run.memory_per_rank_mb=220"], dir.path());
    assert_ok(&o);
    let out = text(&o).0;
    for said in [
        "chose the mesh data 1 × tensor 2 × pipeline 2 (wrap.mesh.data = 1, wrap.mesh.tensor = 2, wrap.mesh.pipeline \
         = 2): a rank needs 210 MiB within run.memory_per_rank_mb = 220",
        "the pipeline would need 237 MiB",
        "data 1 × tensor 4 under DDP needs 229 MiB",
        "data 2 × tensor 1 × pipeline 2 needs 246 MiB",
        "mesh: data 1 × tensor 2 × pipeline 2",
    ] {
        assert!(out.contains(said), "the plan lacks {said:?}:\n{out}");
    }
    let run_dir = dir.path().join("fits");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("plan.json")).unwrap()).unwrap();
    let wrap = &plan["config"]["wrap"];
    assert_eq!(
        (wrap["strategy"].as_str(), wrap["mesh"]["tensor"].as_u64(), wrap["mesh"]["pipeline"].as_u64()),
        (Some("pipeline"), Some(2), Some(2))
    );
    assert_eq!(plan["sources"]["wrap.mesh.pipeline"], "wrap.strategy = \"auto\"");
    assert_estimate_holds(&run_dir);

    let o = run(&["validate", "p.toml", "--set", "run.memory_per_rank_mb=150"], dir.path());
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    let err = text(&o).1;
    assert!(err.contains("; the smallest, data 1 × tensor 2 × pipeline 2, needs 210 MiB"), "{err}");
}

/// `run.memory_per_rank_mb` under a configured strategy that does not fit: the refusal names the
/// mesh shapes of this world size that would, with what a rank needs there; where none would,
/// the one that needs the least.
#[test]
fn a_memory_limit_under_ddp_names_the_mesh_shapes_that_would_fit() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", AUTO);
    let refused = |limit: &str| {
        let limit = format!("run.memory_per_rank_mb={limit}");
        let o = run(&["validate", "p.toml", "--set", "wrap.strategy=\"ddp\"", "--set", &limit], dir.path());
        assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
        text(&o).1
    };
    let err = refused("220");
    assert!(
        err.contains(
            "; at this world size the mesh shape data 1 × tensor 2 × pipeline 2 (wrap.mesh.data = 1, wrap.mesh.tensor \
             = 2, wrap.mesh.pipeline = 2: 210 MiB a rank) fits (set wrap.strategy and [wrap.mesh] so, or wrap.strategy \
             = \"auto\" with no [wrap.mesh] chooses among them)"
        ),
        "{err}"
    );
    let err = refused("150");
    assert!(
        err.contains(
            "no mesh shape of this world size fits either (the smallest, data 1 × tensor 2 × pipeline 2, needs 210 MiB)"
        ),
        "{err}"
    );
}
