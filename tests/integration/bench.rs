//! `runner bench`'s CNN and transformer workloads, the runner's side, without the PyTorch
//! reference (which the tests never install): a few samples of each, prepared as the bench
//! prepares them, train with DDP in fp32 and bf16; and the initial-weights file both sides load is
//! the runner's own initialisation, so a run from it and a run from run.seed alone agree exactly.
use crate::common;

use std::path::Path;

use common::{assert_ok, run};
use polars::prelude::*;
use runner::bench::workload::{self, Workload};
use runner::bench::{catalogue, files};

fn losses(dir: &Path) -> Vec<f64> {
    let df =
        ParquetReader::new(std::fs::File::open(dir.join("trace.parquet")).expect("trace.parquet")).finish().unwrap();
    let df = df.filter(&df.column("rank").unwrap().u32().unwrap().equal(0)).unwrap();
    df.column("global_train_loss").unwrap().f64().unwrap().into_no_null_iter().collect()
}

fn tiny(name: &str) -> Workload {
    let w = catalogue::all().into_iter().find(|w| w.name == name).expect("the workload");
    Workload { rows: 32, batch: 8, epochs: 2, ..w }
}

#[test]
fn the_cnn_and_transformer_workloads_train_from_the_shared_initial_weights() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["cnn", "transformer"] {
        let w = tiny(name);
        let files = files::prepare(&w, &dir.path().join(name)).unwrap();
        let pipeline = files.pipeline.to_str().unwrap();
        let threads = "run.threads_per_rank=1";

        // From the shared file, at world size 2, in fp32 and in bf16 (as `runner bench` runs them).
        let ddp = files.dir.join("ddp");
        assert_ok(&run(
            &["run", pipeline, "--set", "run.world_size=2", "--set", threads, "--out", ddp.to_str().unwrap()],
            dir.path(),
        ));
        let fp32 = losses(&ddp);
        assert_eq!(fp32.len(), 2, "{name}");
        assert!(fp32.iter().all(|l| l.is_finite() && *l > 0.0), "{name}: {fp32:?}");
        let bf16 = files.dir.join("bf16");
        let precision = "train.precision=\"bf16\"";
        let args = ["run", pipeline, "--set", "run.world_size=2", "--set", threads, "--set", precision];
        assert_ok(&run(&[&args[..], &["--out", bf16.to_str().unwrap()]].concat(), dir.path()));
        let bf16 = losses(&bf16);
        assert!(bf16.iter().zip(&fp32).all(|(b, f)| (b - f).abs() < 0.05 * f), "{name}: {bf16:?} against {fp32:?}");

        // The file holds the runner's own initial weights for run.seed: without it, the same losses.
        let text = std::fs::read_to_string(&files.pipeline).unwrap();
        assert!(text.contains("init = \"init.npz\"\n"), "{text}");
        let own = files.dir.join("own.toml");
        std::fs::write(&own, text.replace("init = \"init.npz\"\n", "")).unwrap();
        let out = files.dir.join("own");
        assert_ok(&run(
            &[
                "run",
                own.to_str().unwrap(),
                "--set",
                "run.world_size=2",
                "--set",
                threads,
                "--out",
                out.to_str().unwrap(),
            ],
            dir.path(),
        ));
        assert_eq!(losses(&out), fp32, "{name}");
    }
}

/// The FSDP2 workload's runner side: its pipeline (a token file, every window trained) under the
/// strategy it names (`workload::FSDP_STRATEGY`) gives the losses of the runner's own DDP at world
/// size 2, within 1e-5, as `runner bench --workload fsdp` runs them.
#[test]
fn the_fsdp_workload_trains_under_its_strategy_as_under_ddp() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny("fsdp");
    let files = files::prepare(&w, dir.path()).unwrap();
    let pipeline = files.pipeline.to_str().unwrap();
    let go = |out: &str, extra: &[&str]| {
        let args = ["run", pipeline, "--set", "run.world_size=2", "--set", "run.threads_per_rank=1", "--out", out];
        assert_ok(&run(&[&args[..], extra].concat(), dir.path()));
        losses(&dir.path().join(out))
    };
    let sharded = go("sharded", &[]);
    let ddp = go("ddp", &["--set", "wrap.strategy=\"ddp\""]);
    assert_eq!(sharded.len(), 2);
    for (e, (a, b)) in sharded.iter().zip(&ddp).enumerate() {
        assert!(((a - b) / b).abs() < 1e-5, "epoch {}: {} {a}, ddp {b}", e + 1, workload::FSDP_STRATEGY);
    }
}

/// The tp workload's runner side: its pipeline (the token file, `[wrap.mesh] tensor = 2`) at
/// world size 2, as `runner bench --workload tp` runs it, gives the losses of one process within
/// 1e-5.
#[test]
fn the_tp_workload_splits_over_2_tensor_ranks_as_one_process_trains() {
    let dir = tempfile::tempdir().unwrap();
    let w = tiny("tp");
    let files = files::prepare(&w, dir.path()).unwrap();
    let pipeline = files.pipeline.to_str().unwrap();
    let go = |out: &str, extra: &[&str]| {
        let args = ["run", pipeline, "--set", "run.threads_per_rank=1", "--out", out];
        assert_ok(&run(&[&args[..], extra].concat(), dir.path()));
        losses(&dir.path().join(out))
    };
    let split = go("tp", &["--set", "run.world_size=2"]);
    let one = go("one", &["--set", "run.world_size=1", "--set", "wrap.mesh.tensor=1"]);
    assert_eq!(split.len(), 2);
    for (e, (a, b)) in split.iter().zip(&one).enumerate() {
        assert!(((a - b) / b).abs() < 1e-5, "epoch {}: tensor 2 {a}, one process {b}", e + 1);
    }
}
