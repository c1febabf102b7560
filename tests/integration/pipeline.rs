//! `wrap.strategy = "pipeline"` end to end: the layers split over real rank processes, activations
//! and gradients through real gloo send/recv, checked against one process training the whole model.
use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{assert_ok, run, text, trace, write, TINY};
use polars::prelude::*;
use tch::Tensor;

fn params(dir: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("model.safetensors")).expect("model.safetensors").into_iter().collect()
}

/// Four layers (5-16-16-16-3); batches of 18 cut into micro-batches of 5, 5, 4, 4, and the
/// epoch's last batch of 6 rows into 2, 2, 1, 1. Under 1F1B over 3 ranks, rank 0 (2 warm-up
/// forwards) and rank 1 (1) run every phase of the schedule.
const MODEL: &[&str] =
    &["--set", "wrap.model.hidden=[16, 16, 16]", "--set", "train.epochs=1", "--set", "train.batch_size=18"];

#[test]
fn a_pipeline_over_2_3_and_4_ranks_equals_one_process_training_the_whole_model() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let go = |out: &str, extra: &[&str]| {
        let o = run(&[&["run", "p.toml", "--out", out][..], MODEL, extra].concat(), dir.path());
        assert_ok(&o);
        o
    };
    go("one", &["--set", "run.world_size=1", "--set", "wrap.strategy=\"none\""]);
    let pipe = ["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.pipeline.micro_batches=4"];
    let o = go("two", &[&pipe[..], &["--set", "run.world_size=2"]].concat());
    let (stdout, _) = text(&o);
    assert!(stdout.contains("layers 0-1 (5-16-16): 368 parameters"), "{stdout}");
    assert!(stdout.contains("layers 2-3 (16-16-3): 323 parameters"), "{stdout}");
    go("four", &[&pipe[..], &["--set", "run.world_size=4"]].concat());
    go(
        "stages",
        &[&pipe[..], &["--set", "run.world_size=2", "--set", "wrap.pipeline.stages=[[0], [1, 2, 3]]"]].concat(),
    );
    let one_f_one_b = [&pipe[..], &["--set", "wrap.pipeline.schedule=\"1f1b\""]].concat();
    go("1f1b-4", &[&one_f_one_b[..], &["--set", "run.world_size=4"]].concat());
    go("1f1b-3", &[&one_f_one_b[..], &["--set", "run.world_size=3"]].concat());

    let reference = params(&dir.path().join("one"));
    assert_eq!(reference.len(), 8, "4 layers × weight and bias");
    for out in ["two", "four", "stages", "1f1b-4", "1f1b-3"] {
        let got = params(&dir.path().join(out));
        assert_eq!(got.keys().collect::<Vec<_>>(), reference.keys().collect::<Vec<_>>(), "{out}");
        for (name, want) in &reference {
            // Relative to the tensor's scale: elements near 0 differ by a few float32 ulps too.
            let diff = (&got[name] - want).abs().max().double_value(&[]);
            let rel = diff / want.abs().max().double_value(&[]);
            assert!(rel < 1e-5, "{out}: {name} differs by {diff:e} ({rel:e} of its largest element)");
        }
        let (a, b) = (trace(&dir.path().join(out)), trace(&dir.path().join("one")));
        let loss = |df: &DataFrame| df.column("global_train_loss").unwrap().f64().unwrap().get(0).unwrap();
        assert!(((loss(&a) - loss(&b)) / loss(&b)).abs() < 1e-5, "{out}: loss {} vs {}", loss(&a), loss(&b));
    }
}

#[test]
fn the_trace_has_every_rank_s_compute_time_and_bubble_and_the_pipeline_s_metrics_on_every_row() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let args =
        ["--set", "wrap.strategy=\"pipeline\"", "--set", "run.world_size=4", "--set", "wrap.pipeline.micro_batches=2"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "o"][..], MODEL, &args].concat(), dir.path()));
    let df = trace(&dir.path().join("o"));
    assert_eq!(df.height(), 4, "one row per rank");
    let f64s = |c: &str| df.column(c).unwrap().f64().unwrap().iter().collect::<Vec<_>>();
    for b in f64s("bubble") {
        assert!(b.is_some_and(|b| (0.0..1.0).contains(&b)), "bubble {b:?}");
    }
    assert!(f64s("compute_s").iter().all(|c| c.is_some_and(|c| c > 0.0)));
    // One model: its loss and validation (measured on the last rank) on every row.
    for col in ["train_loss", "global_train_loss", "val_loss", "val_acc"] {
        let v = f64s(col);
        assert!(v[0].is_some() && v.iter().all(|x| *x == v[0]), "{col}: {v:?}");
    }
    let samples: Vec<u64> = df.column("samples").unwrap().u64().unwrap().into_no_null_iter().collect();
    assert_eq!(samples, [600; 4], "every rank trains on every row");
}

#[test]
fn a_model_over_the_memory_a_rank_may_use_runs_split_over_4_ranks() {
    // Four layers of 65792 parameters (0.502 MiB of parameters and gradients each as float32,
    // SGD keeps no state), 2.008 MiB in all; a rank needs about 153 MiB besides (activations,
    // data, libtorch): the limit admits one layer's state, not four. tests/integration/config_errors.rs has
    // the refusals on one rank.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let big = [
        "--set",
        "load.features=256",
        "--set",
        "load.classes=256",
        "--set",
        "wrap.model.hidden=[256, 256, 256]",
        "--set",
        "run.memory_per_rank_mb=153.5",
        "--set",
        "train.epochs=1",
    ];
    let o = run(
        &[
            &["run", "p.toml", "--out", "o", "--set", "wrap.strategy=\"pipeline\"", "--set", "run.world_size=4"][..],
            &big,
        ]
        .concat(),
        dir.path(),
    );
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("layer 3 (256-256): 65792 parameters, 0.502 MiB of training state "), "{stdout}");
    let o = run(&[&["validate", "p.toml", "--set", "run.world_size=4"][..], &big].concat(), dir.path());
    assert_eq!(o.status.code(), Some(2), "DDP holds the whole model on every rank");
    assert!(
        text(&o).1.contains("each rank would need 155 MiB: 2.0 MiB (parameters 1.0 MiB, gradients 1.0 MiB"),
        "{}",
        text(&o).1
    );
}

#[test]
fn two_copies_of_a_pipeline_equal_one_process_on_their_two_batches() {
    // Pipeline × data parallel: 2 copies of a 2-stage pipeline on 4 ranks, each copy on its half of
    // the rows with batches of 16, each stage's gradients averaged over the copies; against one
    // process with batches of 32 (statistics of the whole training set in both).
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let both =
        ["--set", "wrap.model.hidden=[16, 16, 16]", "--set", "train.epochs=1", "--set", "normalize.scope=\"global\""];
    let one = ["--set", "run.world_size=1", "--set", "wrap.strategy=\"none\"", "--set", "train.batch_size=32"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "one"][..], &both, &one].concat(), dir.path()));
    let copies = [
        "--set",
        "run.world_size=4",
        "--set",
        "wrap.strategy=\"pipeline\"",
        "--set",
        "wrap.pipeline.replicas=2",
        "--set",
        "wrap.pipeline.micro_batches=4",
        "--set",
        "wrap.pipeline.schedule=\"1f1b\"",
        "--set",
        "train.batch_size=16",
    ];
    let o = run(&[&["run", "p.toml", "--out", "copies"][..], &both, &copies].concat(), dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("ranks 1, 3  4 × 16 from the stage before"), "{}", text(&o).0);
    let reference = params(&dir.path().join("one"));
    let got = params(&dir.path().join("copies"));
    for (name, want) in &reference {
        let diff = (&got[name] - want).abs().max().double_value(&[]);
        let rel = diff / want.abs().max().double_value(&[]);
        assert!(rel < 1e-5, "{name} differs by {diff:e} ({rel:e} of its largest element)");
    }
    let df = trace(&dir.path().join("copies"));
    let samples: Vec<u64> = df.column("samples").unwrap().u64().unwrap().into_no_null_iter().collect();
    assert_eq!(samples, [300; 4], "each copy trains on its half");
    let f64s = |c: &str| df.column(c).unwrap().f64().unwrap().iter().collect::<Vec<_>>();
    let val = f64s("val_loss");
    assert!(val[0].is_some() && val[1] == val[0] && val[2].is_none() && val[3].is_none(), "{val:?}");
    let (g, b) = (f64s("global_train_loss"), trace(&dir.path().join("one")));
    let want = b.column("global_train_loss").unwrap().f64().unwrap().get(0).unwrap();
    assert!(((g[0].unwrap() - want) / want).abs() < 1e-5, "loss {g:?} vs {want}");
}
