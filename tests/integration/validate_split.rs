//! `validate.on = "split"`: each rank validates its share of the rows at once and rank 0 measures
//! their outputs together. The oracle is `validate.on = "rank0"`, rank 0 alone over every row:
//! the same metrics, the same training (validation changes nothing it computes), at world size 2,
//! with shares of unequal size (101 rows over 2 ranks) and with thread replicas.
use crate::common;

use std::path::Path;

use common::{assert_ok, run, text, write, TINY};

fn column(dir: &Path, name: &str) -> Vec<f64> {
    let df = common::trace(dir);
    let rank0 = df.column("rank").unwrap().u32().unwrap().iter().map(|r| r == Some(0)).collect::<Vec<_>>();
    let values = df.column(name).unwrap().f64().unwrap().iter().collect::<Vec<_>>();
    values.into_iter().zip(rank0).filter(|(_, zero)| *zero).map(|(v, _)| v.unwrap_or(f64::NAN)).collect()
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} against {b:?}");
    assert!(!a.is_empty() && a.iter().all(|v| v.is_finite()), "{what}: {a:?}");
    for (x, y) in a.iter().zip(b) {
        assert!(((x - y) / y).abs() < 1e-6, "{what}: {a:?} against {b:?}");
    }
}

/// Runs `pipeline` twice at world size 2, validated on rank 0 alone and split, and compares.
fn split_equals_rank0(p: &Path, pipeline: &str, metrics: &[&str]) {
    let out = |on: &str| format!("{}-{on}", pipeline.trim_end_matches(".toml"));
    for on in ["rank0", "split"] {
        let set = format!("validate.on=\"{on}\"");
        let o = run(&["run", pipeline, "--out", &out(on), "--set", "run.world_size=2", "--set", &set], p);
        assert_ok(&o);
        let (plan, _) = text(&o);
        if on == "split" {
            assert!(plan.contains("each rank its share of the rows, measured on rank 0"), "{plan}");
        }
    }
    let (a, b) = (p.join(out("split")), p.join(out("rank0")));
    let bits = |v: Vec<f64>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(column(&a, "train_loss")),
        bits(column(&b, "train_loss")),
        "{pipeline}: validation changes nothing the training computes"
    );
    for m in metrics {
        assert_close(&column(&a, m), &column(&b, m), &format!("{pipeline}: {m}"));
    }
}

#[test]
fn split_validation_measures_what_rank_0_alone_measures() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    // Classification: loss, accuracy and macro-F1 from 101 rows, shared 51 + 50.
    write(p, "tiny.toml", &TINY.replace("validation_rows = 100", "validation_rows = 101"));
    split_equals_rank0(p, "tiny.toml", &["val_loss", "val_acc", "val_f1"]);

    // A language model whose ranks each compute as two thread replicas: 9 windows, 5 + 4, then
    // split again over the replicas.
    write(p, "book.txt", &common::book());
    write(p, "lm.toml", &common::SMALL_LM.replace("[validate]\nrows = 8", "[validate]\nrows = 9"));
    split_equals_rank0(p, "lm.toml", &["val_loss", "val_acc"]);
}

#[test]
fn split_validation_is_refused_where_it_cannot_share_the_rows() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "tiny.toml", TINY);
    for (set, key, says) in [
        (
            &["--set", "load.validation_rows=1"][..],
            "`validate.on` (--set validate.on=\"split\")",
            "\"split\" shares the 1 validation row(s) among 2 ranks, so some would have none; use \"rank0\", or hold out at least 2 rows",
        ),
        (
            &["--set", "wrap.strategy=\"none\""][..],
            "`validate.on` (--set validate.on=\"split\")",
            "\"split\" measures one model from every rank's share of the rows, but with wrap.strategy = \"none\" each rank trains a model of its own; use \"rank0\" (rank 0's model) or \"all\" (each rank's)",
        ),
        (
            &["--set", "wrap.strategy=\"pipeline\""][..],
            "`validate.on` (--set validate.on=\"split\")",
            "\"split\" shares the rows among replicas, but a pipeline is one model: its validation runs through every rank already; use \"rank0\"",
        ),
    ] {
        let o = run(&[&["validate", "tiny.toml", "--set", "validate.on=\"split\""][..], set].concat(), p);
        let (_, stderr) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{set:?}: {stderr}");
        assert!(stderr.contains(&format!("{key}: {says}")), "{set:?}: {stderr}");
    }
    // One rank: nothing to share, rank 0 validates.
    let o = run(&["validate", "tiny.toml", "--set", "validate.on=\"split\"", "--set", "run.world_size=1"], p);
    assert_ok(&o);
    assert!(text(&o).0.contains("on rank 0"), "{}", text(&o).0);
}
