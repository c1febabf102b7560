//! What a point's final epoch measured besides its losses, for the table: the throughput of the
//! whole run over a device mesh (each sample counted once, however many ranks pass it), the
//! bytes each rank sent per step along each mesh dimension, and the plan's memory estimate to put
//! beside the measured peak; and the most any one rank held or sent. Read from the trace's final
//! rows and the point's `plan.json`.
use anyhow::Context;
use polars::prelude::*;

use crate::plan::mesh::Shape;
use crate::plan::Plan;

/// The trace's bytes-sent columns, each with the mesh dimension it measures.
pub const SENT: [(&str, &str); 3] =
    [("sent_data_bytes", "data"), ("sent_tensor_bytes", "tensor"), ("sent_pipeline_bytes", "pipeline")];

/// The run's rate (samples or tokens per second) from each rank's rate in one epoch. The ranks of
/// a tensor group pass the same samples, and so do a pipeline's stages: outside a pipeline the
/// ranks' sum over the tensor degree; in a pipeline its slowest rank's rate (every stage waits for
/// it) times the copies of the pipeline.
pub fn throughput(rates: &[f64], pipeline: bool, mesh: Shape) -> f64 {
    if pipeline {
        rates.iter().copied().reduce(f64::min).unwrap_or(0.0) * mesh.data as f64
    } else {
        rates.iter().sum::<f64>() / mesh.tensor as f64
    }
}

/// The mesh a point ran on, from its plan (one rank's share of everything where there is no
/// plan to read: a run of an older runner, or one that failed before it planned).
pub fn mesh(plan: Option<&Plan>, world_size: usize) -> Shape {
    plan.map(Plan::mesh).unwrap_or(Shape { data: world_size.max(1), pipeline: 1, tensor: 1 })
}

/// The plan's estimate of one rank's whole process in the host's memory, in bytes (what the
/// measured peak resident memory is compared with); none where the plan could not size it.
pub fn estimate(plan: Option<&Plan>) -> Option<f64> {
    let plan = plan?;
    plan.memory.map(|m| m.on_host(plan.config.run.device).per_rank())
}

/// `column`'s per-rank values in `rows`, or none where the trace lacks the column or a rank's
/// value (a trace of an older runner; tokens/s of a model without tokens).
pub fn per_rank(rows: &DataFrame, column: &str) -> anyhow::Result<Option<Vec<f64>>> {
    let Ok(c) = rows.column(column) else { return Ok(None) };
    let values = c.cast(&DataType::Float64)?;
    Ok(values.f64()?.iter().collect())
}

/// The largest per-rank sum of `columns` in `rows` (one row per rank), or `None` where the trace
/// predates them: absent, not zero.
pub fn most_on_a_rank(rows: &DataFrame, columns: &[&str]) -> anyhow::Result<Option<f64>> {
    if columns.iter().any(|c| rows.column(c).is_err()) {
        return Ok(None);
    }
    let mut sums = vec![0.0; rows.height()];
    for c in columns {
        let values = rows.column(c)?.cast(&DataType::Float64)?;
        for (sum, v) in sums.iter_mut().zip(values.f64()?.iter()) {
            *sum += v.with_context(|| format!("a null {c}"))?;
        }
    }
    Ok(sums.into_iter().reduce(f64::max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_counts_once_however_many_ranks_pass_it() {
        let shape = |data, pipeline, tensor| Shape { data, pipeline, tensor };
        // DDP over 4 ranks: each its own samples.
        assert_eq!(throughput(&[10.0, 11.0, 12.0, 13.0], false, shape(4, 1, 1)), 46.0);
        // Tensor 4: the four ranks pass one batch.
        assert_eq!(throughput(&[10.0, 11.0, 12.0, 13.0], false, shape(1, 1, 4)), 11.5);
        // Data 2 × tensor 2.
        assert_eq!(throughput(&[10.0, 10.0, 12.0, 12.0], false, shape(2, 1, 2)), 22.0);
        // A pipeline of 2 stages × tensor 2: its slowest rank's rate.
        assert_eq!(throughput(&[10.0, 9.0, 11.0, 12.0], true, shape(1, 2, 2)), 9.0);
        // 2 copies of a 2-stage pipeline: both copies' samples.
        assert_eq!(throughput(&[10.0, 9.0, 11.0, 12.0], true, shape(2, 2, 1)), 18.0);
        assert_eq!(mesh(None, 3), shape(3, 1, 1));
        assert_eq!(estimate(None), None);
    }

    #[test]
    fn memory_is_the_rank_holding_the_most_and_absent_from_older_traces() {
        use crate::trace::{epochs_frame, EpochRow};
        let row = |rank: u32, param_bytes: u64, peak_rss_bytes: u64| -> EpochRow {
            serde_json::from_value(serde_json::json!({
                "epoch": 1, "rank": rank, "world_size": 2, "train_loss": 0.5, "train_acc": 0.5, "global_train_loss": 0.5,
                "global_train_acc": 0.5, "val_loss": null, "val_acc": null, "samples": 8, "steps": 1,
                "epoch_s": 1.0, "samples_per_s": 8.0, "comm_s": 0.1,
                "param_bytes": param_bytes, "grad_bytes": 10, "optim_bytes": 20, "peak_rss_bytes": peak_rss_bytes,
            }))
            .unwrap()
        };
        let df = epochs_frame("r", &[row(0, 100, 7000), row(1, 130, 5000)]).unwrap();
        assert_eq!(most_on_a_rank(&df, &["param_bytes", "grad_bytes", "optim_bytes"]).unwrap(), Some(160.0));
        assert_eq!(most_on_a_rank(&df, &["peak_rss_bytes"]).unwrap(), Some(7000.0));
        let older = df.drop_many(["param_bytes", "peak_rss_bytes"]);
        assert_eq!(most_on_a_rank(&older, &["param_bytes", "grad_bytes", "optim_bytes"]).unwrap(), None);
        assert_eq!(most_on_a_rank(&older, &["peak_rss_bytes"]).unwrap(), None);
    }
}
