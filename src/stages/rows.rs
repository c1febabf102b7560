//! What each rank measured over an interval, and its sampled steps, all-gathered so that rank 0
//! builds every rank's trace row and the global metrics.
use tch::Tensor;

use crate::dist::ProcessGroup;
use crate::trace::{EpochRow, StepRow};

/// A record of float64 fields that ranks all-gather as one tensor, in field order: the struct,
/// its field count and its conversions from one list of fields.
macro_rules! float_record {
    ($(#[$meta:meta])* $name:ident { $($(#[$fmeta:meta])* $field:ident,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default)]
        pub(super) struct $name {
            $($(#[$fmeta])* pub(super) $field: f64,)*
        }

        impl $name {
            const FIELDS: usize = [$(stringify!($field)),*].len();

            fn to_array(self) -> [f64; Self::FIELDS] {
                [$(self.$field),*]
            }

            fn from_slice(v: &[f64]) -> $name {
                assert_eq!(v.len(), Self::FIELDS, "{} values per {}", Self::FIELDS, stringify!($name));
                let mut values = v.iter().copied();
                // A struct expression evaluates its fields in the order written.
                $name { $($field: values.next().unwrap_or(f64::NAN),)* }
            }
        }
    };
}

float_record! {
    /// What one rank measured over an epoch. Ranks all-gather it as one float64 tensor, in the
    /// order of [`RankEpoch::to_array`]; NaN marks what a rank did not measure.
    RankEpoch {
        loss_sum,
        correct,
        samples,
        steps,
        epoch_s,
        comm_s,
        val_loss,
        val_acc,
        compute_s,
        bubble,
        /// The learning rate of the epoch's last optimizer step.
        lr,
        /// The global gradient norm before clipping, over the epoch's optimizer steps (NaN without
        /// clipping).
        grad_norm_mean,
        grad_norm_max,
        val_f1,
        val_rmse,
        val_mae,
        val_r2,
        /// The training state's bytes (see `strategy::StateBytes`) and the process's peak resident
        /// memory.
        param_bytes,
        grad_bytes,
        optim_bytes,
        peak_rss_bytes,
        /// Model FLOPs utilisation (NaN where unknown).
        mfu,
        /// Bytes sent per optimizer step along each mesh dimension (`strategy::MeshBytes`), the
        /// mean over the interval's steps this process trained.
        sent_data_bytes,
        sent_tensor_bytes,
        sent_pipeline_bytes,
    }
}

float_record! {
    /// One sampled step's phases on one rank, all-gathered as float64 values in field order.
    StepSample {
        epoch,
        step,
        batch_s,
        forward_s,
        loss_s,
        backward_s,
        sync_s,
        overlap_s,
        update_s,
        recompute_s,
    }
}

impl StepSample {
    fn row(self, rank: usize) -> StepRow {
        let StepSample {
            epoch,
            step,
            batch_s,
            forward_s,
            loss_s,
            backward_s,
            sync_s,
            overlap_s,
            update_s,
            recompute_s,
        } = self;
        StepRow {
            epoch: epoch as u32,
            step: step as u32,
            rank: rank as u32,
            batch_s,
            forward_s,
            loss_s,
            backward_s,
            sync_s,
            overlap_s,
            update_s,
            recompute_s,
        }
    }
}

/// Every rank's epoch values, all-gathered: rank 0 builds each rank's row and the global metrics.
/// In a pipeline (`stages` ranks per copy), the losses and accuracies are measured on each copy's
/// last rank and written on every row of the copy; the global ones sum over the copies.
pub(super) fn gather_epoch_rows(
    pg: &ProcessGroup,
    epoch: usize,
    step: usize,
    mine: &RankEpoch,
    stages: Option<usize>,
) -> anyhow::Result<Vec<EpochRow>> {
    let all = pg.all_gather(&Tensor::from_slice(&mine.to_array()))?;
    let v: Vec<RankEpoch> =
        all.iter().map(|t| RankEpoch::from_slice(&Vec::<f64>::try_from(t).expect("float64 values"))).collect();
    let measured_on = |r: usize| stages.map_or(r, |s| r / s * s + s - 1);
    let (g_loss, g_correct, g_samples) = (0..v.len())
        .filter(|&r| measured_on(r) == r)
        .fold((0.0, 0.0, 0.0), |a, r| (a.0 + v[r].loss_sum, a.1 + v[r].correct, a.2 + v[r].samples));
    let opt = |x: f64| (!x.is_nan()).then_some(x);
    Ok(v.iter()
        .enumerate()
        .map(|(r, f)| {
            let m = &v[measured_on(r)];
            EpochRow {
                epoch: epoch as u32,
                step: step as u64,
                rank: r as u32,
                world_size: v.len() as u32,
                train_loss: m.loss_sum / m.samples,
                train_acc: m.correct / m.samples,
                global_train_loss: g_loss / g_samples,
                global_train_acc: g_correct / g_samples,
                val_loss: opt(m.val_loss),
                val_acc: opt(m.val_acc),
                val_f1: opt(m.val_f1),
                val_rmse: opt(m.val_rmse),
                val_mae: opt(m.val_mae),
                val_r2: opt(m.val_r2),
                samples: f.samples as u64,
                steps: f.steps as u64,
                epoch_s: f.epoch_s,
                samples_per_s: f.samples / f.epoch_s,
                comm_s: f.comm_s,
                compute_s: f.compute_s,
                bubble: opt(f.bubble),
                perplexity: None,
                val_perplexity: None,
                tokens_per_s: None,
                mfu: opt(f.mfu),
                lr: f.lr,
                grad_norm_mean: opt(f.grad_norm_mean),
                grad_norm_max: opt(f.grad_norm_max),
                param_bytes: f.param_bytes as u64,
                grad_bytes: f.grad_bytes as u64,
                optim_bytes: f.optim_bytes as u64,
                peak_rss_bytes: f.peak_rss_bytes as u64,
                sent_data_bytes: f.sent_data_bytes,
                sent_tensor_bytes: f.sent_tensor_bytes,
                sent_pipeline_bytes: f.sent_pipeline_bytes,
            }
        })
        .collect())
}

/// Every rank's sampled steps (the same count on each rank), all-gathered.
pub(super) fn gather_step_rows(pg: &ProcessGroup, mine: &[StepSample]) -> anyhow::Result<Vec<StepRow>> {
    // Every rank samples the same batches: all or none of them have rows.
    if mine.is_empty() {
        return Ok(Vec::new());
    }
    let flat: Vec<f64> = mine.iter().flat_map(|s| s.to_array()).collect();
    let all = pg.all_gather(&Tensor::from_slice(&flat))?;
    Ok(all
        .iter()
        .enumerate()
        .flat_map(|(r, t)| {
            let v = Vec::<f64>::try_from(t).expect("float64 values");
            v.chunks(StepSample::FIELDS).map(|s| StepSample::from_slice(s).row(r)).collect::<Vec<_>>()
        })
        .collect())
}
