//! `runner run` end to end: real rank processes, real c10d, traces read back with polars.
mod common;

use std::path::Path;

use common::{assert_ok, run, text, write, TINY};
use polars::prelude::*;

fn trace(dir: &Path) -> DataFrame {
    let file = std::fs::File::open(dir.join("trace.parquet")).expect("trace.parquet exists");
    ParquetReader::new(file).finish().unwrap()
}

/// The pinned schema of trace.parquet.
const SCHEMA: &[(&str, DataType)] = &[
    ("run_id", DataType::String),
    ("epoch", DataType::UInt32),
    ("rank", DataType::UInt32),
    ("world_size", DataType::UInt32),
    ("train_loss", DataType::Float64),
    ("train_acc", DataType::Float64),
    ("global_train_loss", DataType::Float64),
    ("global_train_acc", DataType::Float64),
    ("val_loss", DataType::Float64),
    ("val_acc", DataType::Float64),
    ("samples", DataType::UInt64),
    ("steps", DataType::UInt64),
    ("epoch_s", DataType::Float64),
    ("samples_per_s", DataType::Float64),
    ("comm_s", DataType::Float64),
];

fn f64s(df: &DataFrame, col: &str) -> Vec<Option<f64>> {
    df.column(col).unwrap().f64().unwrap().iter().collect()
}

#[test]
fn runs_at_world_sizes_1_2_and_3_with_a_pinned_trace_schema() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    for world in [1usize, 2, 3] {
        let out_dir = format!("out-{world}");
        let o = run(&["run", "p.toml", "--set", &format!("run.world_size={world}"), "--out", &out_dir], dir.path());
        assert_ok(&o);
        let run_dir = dir.path().join(&out_dir);
        let df = trace(&run_dir);
        let schema: Vec<(String, DataType)> = df.schema().iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
        let pinned: Vec<(String, DataType)> = SCHEMA.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
        assert_eq!(schema, pinned);
        assert_eq!(df.height(), world * 2, "one row per rank per epoch");
        // Every training row is counted once per epoch, whatever the split (600 = 3 × 200,
        // 2 × 300; at world size 3 nothing pads, so check the sum).
        let samples: u64 = df.column("samples").unwrap().u64().unwrap().into_no_null_iter().sum();
        assert_eq!(samples, 600 * 2);
        // Validation on rank 0 only.
        let val: Vec<Option<f64>> = f64s(&df, "val_loss");
        let ranks: Vec<u32> = df.column("rank").unwrap().u32().unwrap().into_no_null_iter().collect();
        for (v, r) in val.iter().zip(&ranks) {
            assert_eq!(v.is_some(), *r == 0, "val_loss on rank {r}: {v:?}");
        }
        let manifest = std::fs::read_to_string(run_dir.join("manifest.json")).unwrap();
        assert!(manifest.contains("\"status\": \"complete\""), "{manifest}");
        let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
        assert!(config.contains(&format!("world_size = {world}  # --set run.world_size={world}")), "{config}");
        assert!(config.contains("epochs = 2  # file"), "{config}");
        assert!(config.contains("bucket_cap_mb = 25.0  # default"), "{config}");
        let steps = ParquetReader::new(std::fs::File::open(run_dir.join("steps.parquet")).unwrap()).finish().unwrap();
        assert!(steps.height() > 0, "steps.parquet has sampled steps");
    }
}

#[test]
fn an_uneven_split_pads_without_counting_a_sample_twice() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    // 601 training rows over 3 ranks: 201 each, 2 of them padding.
    let o = run(&["run", "p.toml", "--set", "run.world_size=3", "--set", "load.rows=601", "--out", "o"], dir.path());
    assert_ok(&o);
    let df = trace(&dir.path().join("o"));
    let samples: Vec<u64> = df.column("samples").unwrap().u64().unwrap().into_no_null_iter().collect();
    assert_eq!(samples.iter().sum::<u64>(), 601 * 2, "{samples:?}");
    let (stdout, _) = text(&o);
    assert!(stdout.contains("2 padding rows (not counted in metrics)"), "{stdout}");
}

#[test]
fn a_rerun_reproduces_every_value_but_the_timings() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    assert_ok(&run(&["run", "p.toml", "--out", "a"], dir.path()));
    assert_ok(&run(&["run", "p.toml", "--out", "b"], dir.path()));
    let (a, b) = (trace(&dir.path().join("a")), trace(&dir.path().join("b")));
    let timing = ["epoch_s", "samples_per_s", "comm_s"];
    for name in a.get_column_names() {
        if timing.contains(&name.as_str()) {
            continue;
        }
        assert_eq!(a.column(name).unwrap(), b.column(name).unwrap(), "column {name} differs between reruns");
    }
}

#[test]
fn ddp_two_ranks_equal_one_rank_with_twice_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let common = ["--set", "normalize.scope=\"global\"", "--set", "train.epochs=3", "--set", "load.rows=640"];
    let two =
        [&["run", "p.toml", "--out", "two", "--set", "run.world_size=2", "--set", "train.batch_size=16"][..], &common]
            .concat();
    let one =
        [&["run", "p.toml", "--out", "one", "--set", "run.world_size=1", "--set", "train.batch_size=32"][..], &common]
            .concat();
    assert_ok(&run(&two, dir.path()));
    assert_ok(&run(&one, dir.path()));
    let rank0 = |d: &str| {
        let df = trace(&dir.path().join(d));
        let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
        f64s(&df.filter(&mask).unwrap(), "global_train_loss").into_iter().map(Option::unwrap).collect::<Vec<_>>()
    };
    let (l2, l1) = (rank0("two"), rank0("one"));
    assert_eq!(l2.len(), 3);
    for (e, (a, b)) in l2.iter().zip(&l1).enumerate() {
        assert!(((a - b) / b).abs() < 1e-5, "epoch {}: 2 ranks × 16 gave {a}, 1 rank × 32 gave {b}", e + 1);
    }
}

#[test]
fn the_seed_pipeline_learns() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let pipeline = root.join("pipelines/ddp.toml");
    let o = run(&["run", pipeline.to_str().unwrap(), "--set", "train.epochs=3", "--out", "o"], dir.path());
    assert_ok(&o);
    let df = trace(&dir.path().join("o"));
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    let r0 = df.filter(&mask).unwrap();
    let loss: Vec<f64> = f64s(&r0, "global_train_loss").into_iter().map(Option::unwrap).collect();
    let acc: Vec<f64> = f64s(&r0, "val_acc").into_iter().map(Option::unwrap).collect();
    assert!(loss.windows(2).all(|w| w[1] < w[0]), "loss must fall epoch over epoch: {loss:?}");
    assert!(acc[2] > acc[0] && acc[2] > 0.7, "validation accuracy must rise: {acc:?}");
    let (stdout, _) = text(&o);
    assert!(stdout.contains("DistributedSampler over 4 ranks") && stdout.contains("val accuracy"), "{stdout}");
}
