//! The model against a real batch of the data, before any rank starts: a TorchScript module runs
//! on the first training rows at the training batch size ([`crate::model::torchscript::check`]),
//! and batch norm must have more than one value per channel in every training batch, as PyTorch
//! requires ("Expected more than 1 value per channel when training").
use crate::config::schema::{Config, WrapStrategy};
use crate::data::shard::ShardLayout;
use crate::data::DataSpec;
use crate::model::torchscript::Probe;
use crate::model::Architecture;

/// Rows of a training batch on one rank, and of the smallest one (an epoch's last, when a rank's
/// rows do not divide by the batch).
pub fn batch_rows(c: &Config, d: &DataSpec, l: &ShardLayout) -> (usize, usize) {
    let batch = l.split_batch.unwrap_or(c.train.batch_size).max(1);
    let smallest = match l.per_rank % batch {
        r if r > 0 && !d.random_windows() => r,
        _ => batch,
    };
    (batch, smallest)
}

/// The first training batch of the data (read as a rank reads it, not yet normalised), for a
/// TorchScript module; `None` when the data cannot be read (reported by the data's own checks).
pub fn torchscript_probe(c: &Config, d: &DataSpec, l: &ShardLayout) -> Option<Probe> {
    let (batch, smallest) = batch_rows(c, d, l);
    let dataset = crate::data::load(d).ok()?;
    let n = batch.min(dataset.train.len());
    if n == 0 {
        return None;
    }
    let (x, _) = dataset.train.gather(&(0..n as i64).collect::<Vec<_>>()).ok()?;
    Some(Probe { x, smallest: smallest.min(n), outputs: d.task.outputs(), timeout_s: c.run.timeout_s })
}

/// Batch norm over a training batch with one value per channel: PyTorch refuses it, and the
/// variance of one value is no statistic (the running variance becomes NaN).
pub fn batch_norm(
    c: &Config,
    d: &DataSpec,
    l: &ShardLayout,
    arch: &dyn Architecture,
    bad: &mut impl FnMut(&str, String),
) {
    let Some(per_sample) = arch.batch_norm_values() else { return };
    let (batch, smallest) = batch_rows(c, d, l);
    // SyncBatchNorm normalises by every rank's batch at once.
    let synced = c.wrap.sync_batchnorm
        && matches!(c.wrap.strategy, WrapStrategy::Ddp | WrapStrategy::Fsdp)
        && c.run.world_size > 1;
    let ranks = if synced { c.run.world_size } else { 1 };
    if smallest * ranks * per_sample > 1 {
        return;
    }
    let which = if smallest < batch {
        format!(
            "the last training batch of each epoch holds {smallest} row (a rank's {} rows in batches of {batch})",
            l.per_rank
        )
    } else {
        format!("a training batch holds {batch} row")
    };
    bad(
        "train.batch_size",
        format!(
            "{which} and {} has batch norm over 1 × 1 maps: one value per channel, from which batch norm cannot \
             compute a variance (PyTorch: \"Expected more than 1 value per channel when training\"); use a larger \
             batch{}",
            arch.describe(),
            if smallest < batch { ", or one that leaves no batch of 1 row" } else { "" }
        ),
    );
}
