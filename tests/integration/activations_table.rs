//! The committed `results/activations` table (experiments/activations.toml: one transformer at
//! contexts 256, 1024 and 2048 under activation checkpointing "none", "selective" and "full"):
//! `runner report` rebuilds it from the traces alone, each context's losses are the same bits
//! under every policy, every row's peak is within 15% of the plan's estimate and falls from
//! "none" to "selective" to "full" (at 1024 and 2048; full below none at 256 too), docs/memory.md
//! shows it, and every point reproduces bit for
//! bit here.
use crate::common;

use std::path::Path;

use common::committed::{assert_reports_as_committed, assert_reproduces, read, table_lines};
use polars::prelude::*;

/// A point's (train loss, val loss) at its epochs, and its peak resident memory.
fn measured(run_dir: &Path) -> (Vec<(f64, f64)>, f64) {
    let t = common::trace(run_dir);
    let col = |name: &str| -> Vec<f64> { t.column(name).unwrap().f64().unwrap().into_no_null_iter().collect() };
    let peak = t.column("peak_rss_bytes").unwrap().cast(&DataType::Float64).unwrap();
    let peak = peak.f64().unwrap().into_no_null_iter().fold(0.0, f64::max);
    (col("train_loss").into_iter().zip(col("val_loss")).collect(), peak)
}

/// The plan's whole-process estimate of a point's rank (plan.json's `memory`).
fn estimate(run_dir: &Path) -> f64 {
    let plan: serde_json::Value = serde_json::from_str(&read(&run_dir.join("plan.json"))).unwrap();
    ["model", "activations", "data", "base"].iter().map(|k| plan["memory"][k].as_f64().unwrap()).sum()
}

#[test]
fn the_committed_activations_table_agrees_reports_as_committed_and_reproduces() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let committed = root.join("results/activations");
    assert_reports_as_committed("activations");
    for context in [256, 1024, 2048] {
        let point = |policy: &str| committed.join(format!("seq_len={context},policy={policy}"));
        let (none, none_peak) = measured(&point("none"));
        let mut last_peak = none_peak;
        for policy in ["none", "selective", "full"] {
            let (losses, peak) = measured(&point(policy));
            assert_eq!(losses, none, "context {context}, {policy}: the losses are not policy none's");
            // The table was made by a release build, whose process the estimate counts.
            let (want, off) = (estimate(&point(policy)), (estimate(&point(policy)) - peak) / peak);
            assert!(off.abs() <= 0.15, "context {context}, {policy}: estimated {want:.0} B, peak {peak:.0} B");
            // At context 256 the activations are a few MiB: within the peak's noise.
            assert!(context < 1024 || peak <= last_peak, "context {context}, {policy}: the peak rose");
            last_peak = peak;
        }
        assert!(last_peak < none_peak, "context {context}: full checkpointing saved nothing");
    }
    let page = read(&root.join("docs/memory.md"));
    let table = read(&committed.join("table.md"));
    assert_eq!(table_lines(&page), table_lines(&table), "docs/memory.md shows the committed table");
    assert_reproduces("activations", 9);
}
