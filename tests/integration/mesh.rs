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
