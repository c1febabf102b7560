//! The five stages a rank runs: load → shard → normalize → wrap → train/validate. Each stage
//! receives what the previous one produced and the part of the plan it owns.
pub mod checkpoint;
mod clock;
mod graph;
mod interval;
pub mod mfu;
pub mod preempt;
pub mod recipe;
mod rows;
mod run;
pub mod track;
pub mod train;
pub mod wrap;

pub use run::run;

use crate::config::schema::NormalizeScope;
use crate::data::{self, normalize, shard};
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::trace::EpochRow;
use track::Tracker;

/// About the bytes of the model file written at the run's end (its tensors, and room for its
/// header).
fn model_file_bytes(plan: &Plan, w: &wrap::Wrapped) -> u64 {
    let tensors = w.strategy.model_tensors(plan, &w.vs);
    let bytes =
        |t: &crate::strategy::ModelTensor| t.shape.iter().product::<i64>() as u64 * t.kind.elt_size_in_bytes() as u64;
    tensors.iter().map(bytes).sum::<u64>() + 64 * 1024
}

/// Fitted once, on the rank's first-epoch shard (training rows only); token ids are never scaled.
fn fit_normalizer(
    plan: &Plan,
    pg: &ProcessGroup,
    data: &data::Dataset,
    device: tch::Device,
) -> anyhow::Result<normalize::Normalizer> {
    let c = &plan.config;
    if c.normalize.method == crate::config::schema::NormalizeMethod::None {
        return Ok(normalize::Normalizer::identity());
    }
    let first = shard::RankShard::take(
        &plan.layout,
        &shard::permutation(c.run.seed, 1, plan.layout.rows, c.shard.shuffle),
        plan.replica(pg.rank()),
    );
    // The ranks of a single pipeline all hold the whole training set: their own statistics are
    // the global ones.
    let scope =
        if plan.is_pipeline() && plan.layout.world_size == 1 { NormalizeScope::Rank } else { c.normalize.scope };
    let (x, _) = data.train.gather(&first.indices)?;
    Ok(normalize::Normalizer::fit(
        c.normalize.method,
        scope,
        &x.to_device(device),
        &first.weight_tensor().to_device(device),
        pg,
    )?)
}

/// Whether a checkpoint is written after `done` optimizer steps: at the epochs `checkpoint.every`
/// names, every `checkpoint.every_steps` steps, and at the run's end when either is set.
fn checkpoint_due(plan: &Plan, clock: &train::Clock, done: usize) -> bool {
    let k = &plan.config.checkpoint;
    let last = done == clock.total;
    let by_epoch =
        k.every > 0 && plan.config.train.steps.is_none() && done.is_multiple_of(clock.steps_per_epoch.max(1)) && {
            let epoch = done / clock.steps_per_epoch.max(1);
            epoch.is_multiple_of(k.every) || last
        };
    let by_step = k.every_steps.is_some_and(|n| done.is_multiple_of(n) || last);
    by_epoch || by_step
}

/// Rank 0's line at the end of an interval.
fn interval_line(plan: &Plan, clock: &train::Clock, done: usize, rows: &[EpochRow]) -> String {
    let c = &plan.config;
    let r0 = &rows[0];
    let val = match (r0.val_loss, r0.val_acc, r0.val_rmse) {
        (Some(l), Some(a), _) => {
            let f1 = r0.val_f1.map(|f| format!("  val f1 {f:.4}")).unwrap_or_default();
            format!("  val loss {l:.4}  val acc {a:.4}{f1}")
        }
        (Some(l), None, Some(rmse)) => {
            format!("  val loss {l:.4}  val rmse {rmse:.4}  val r2 {:.4}", r0.val_r2.unwrap_or(f64::NAN))
        }
        _ => String::new(),
    };
    // Regression has no accuracy.
    let acc = if r0.global_train_acc.is_nan() { String::new() } else { format!("  acc {:.4}", r0.global_train_acc) };
    let bubbles: Vec<f64> = rows.iter().filter_map(|r| r.bubble).collect();
    let bubble = match bubbles.len() {
        0 => String::new(),
        n => format!("  bubble {:.0}%", 100.0 * bubbles.iter().sum::<f64>() / n as f64),
    };
    let lm = match r0.tokens_per_s {
        Some(tokens) => format!(
            "  ppl {:.2}{}  {tokens:.0} tokens/s per rank{}",
            r0.global_train_loss.exp(),
            r0.val_perplexity.map(|p| format!("  val ppl {p:.2}")).unwrap_or_default(),
            r0.mfu.map(|m| format!("  MFU {:.1}%", 100.0 * m)).unwrap_or_default()
        ),
        None => String::new(),
    };
    let at = match c.train.steps {
        Some(total) => format!("step {done}/{total}"),
        None => format!("epoch {}/{}", clock.epoch(done - 1), c.train.epochs),
    };
    format!(
        "{at}  loss {:.4}{acc}{val}  {:.2}s  {:.0} samples/s per rank{bubble}{lm}",
        r0.global_train_loss, r0.epoch_s, r0.samples_per_s
    )
}

/// The early-stopping metric of a trace row (rank 0's), where the epoch validated.
fn stop_metric(stopper: &recipe::EarlyStopper, row: &EpochRow) -> Option<f64> {
    match stopper.rule.metric {
        crate::config::schema::StopMetric::ValLoss => row.val_loss,
        crate::config::schema::StopMetric::ValAcc => row.val_acc,
    }
}
