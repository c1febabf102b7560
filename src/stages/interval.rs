//! The state of a training interval on a rank, between its trace rows: the per-sample losses and
//! weights on the device, the gradient norms, the phases' times as the device ran them
//! (`device::clock`), the traced steps, and what a mid-interval checkpoint saves of it.
use std::ops::Range;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::rows::StepSample;
use crate::device;
use crate::strategy::MeshBytes;

/// The per-sample buffers of an interval not yet finished, saved in a mid-interval checkpoint:
/// each rank's losses, correctness and weights of the rows trained so far, and the gradient norms.
#[derive(Debug, Default)]
pub struct Partial {
    pub losses: Vec<f32>,
    pub correct: Vec<f32>,
    pub weights: Vec<f32>,
    pub norms: Vec<f64>,
    /// Seconds the interval has trained for so far (this rank's, or rank 0's read back).
    pub seconds: f64,
}

/// The state of the interval in progress: filled step by step, restored from a checkpoint.
pub(super) struct Buffers {
    pub(super) losses: Tensor,
    pub(super) correct: Tensor,
    pub(super) weights: Tensor,
    /// The gradient norms of the steps, on the device: read at the interval's end.
    pub(super) norms: Vec<Tensor>,
}

impl Buffers {
    pub(super) fn new(rows: usize, partial: Option<Partial>, device: tch::Device) -> Buffers {
        let zeros = || Tensor::zeros([rows as i64], (Kind::Float, device));
        let b = Buffers { losses: zeros(), correct: zeros(), weights: zeros(), norms: Vec::new() };
        match partial {
            None => b,
            Some(p) => {
                for (t, v) in [(&b.losses, &p.losses), (&b.correct, &p.correct), (&b.weights, &p.weights)] {
                    tch::no_grad(|| t.narrow(0, 0, v.len() as i64).copy_(&Tensor::from_slice(v)));
                }
                let norms = p.norms.iter().map(|&n| Tensor::from_slice(&[n as f32]).to_device(device)).collect();
                Buffers { norms, ..b }
            }
        }
    }

    /// The gradient norms, read from the device.
    pub(super) fn norms(&self) -> Vec<f64> {
        match self.norms.len() {
            0 => Vec::new(),
            _ => Vec::<f64>::try_from(Tensor::cat(&self.norms, 0).to_kind(Kind::Double).to_device(tch::Device::Cpu))
                .expect("float64"),
        }
    }

    /// The first `rows` rows' values, and the norms: what a checkpoint saves.
    pub fn partial(&self, rows: usize) -> Partial {
        let take = |t: &Tensor| {
            Vec::<f32>::try_from(t.narrow(0, 0, rows as i64).to_device(tch::Device::Cpu)).expect("float32")
        };
        Partial {
            losses: take(&self.losses),
            correct: take(&self.correct),
            weights: take(&self.weights),
            norms: self.norms(),
            seconds: 0.0,
        }
    }
}

/// A traced step's phases, read from the device at the interval's end.
pub(super) struct TracedStep {
    pub(super) epoch: usize,
    pub(super) step: usize,
    pub(super) batch: device::Span,
    pub(super) forward: device::Span,
    pub(super) loss: device::Span,
    pub(super) backward: device::Span,
    pub(super) sync: Duration,
    pub(super) overlap: Duration,
    pub(super) update: device::Span,
    pub(super) recompute: Duration,
}

impl TracedStep {
    pub(super) fn resolve(&self) -> StepSample {
        StepSample {
            epoch: self.epoch as f64,
            step: self.step as f64,
            batch_s: self.batch.resolve().as_secs_f64(),
            forward_s: self.forward.resolve().as_secs_f64(),
            loss_s: self.loss.resolve().as_secs_f64(),
            backward_s: self.backward.resolve().as_secs_f64(),
            sync_s: self.sync.as_secs_f64(),
            overlap_s: self.overlap.as_secs_f64(),
            update_s: self.update.resolve().as_secs_f64(),
            recompute_s: self.recompute.as_secs_f64(),
        }
    }
}

/// The interval in progress on a rank.
pub struct Interval {
    pub(super) buffers: Buffers,
    /// Its optimizer steps.
    pub steps: Range<usize>,
    /// Rows trained so far (their losses are in the buffers), and rows checked to be finite.
    pub(super) filled: usize,
    pub(super) checked: usize,
    pub(super) start: Instant,
    /// The time an earlier attempt trained the interval for, up to the checkpoint this one
    /// resumed from: the steps after it are timed here, each step once.
    pub(super) before: Duration,
    pub(super) train_s: Duration,
    /// Forward, loss, backward and update of every batch, as the device ran them.
    pub(super) compute: device::Pending,
    pub(super) comm: Duration,
    pub(super) comm_measured: usize,
    pub(super) wait: Duration,
    pub(super) step_rows: Vec<TracedStep>,
    pub(super) report_every: usize,
    /// Where the last optimizer step's rows start in the buffers, and whether this rank
    /// computed their losses.
    pub(super) step_from: usize,
    pub(super) step_measured: bool,
    /// Bytes sent along each mesh dimension by the optimizer steps trained here, and their count.
    pub(super) sent: MeshBytes,
    pub(super) sent_steps: usize,
}

impl Interval {
    /// This rank's training metrics of its last optimizer step (the trackers' `step/...`).
    pub fn last_step(&self, lr: f64) -> super::track::StepMetrics {
        let b = &self.buffers;
        let (from, len) = (self.step_from as i64, (self.filled - self.step_from) as i64);
        let loss = (self.step_measured && len > 0).then(|| {
            let w = b.weights.narrow(0, from, len);
            let sum = (b.losses.narrow(0, from, len) * &w).sum(Kind::Double).double_value(&[]);
            sum / w.sum(Kind::Double).double_value(&[])
        });
        super::track::StepMetrics { loss, lr, grad_norm: b.norms.last().map(|n| n.double_value(&[0])) }
    }

    /// What a checkpoint in the middle of the interval saves of it.
    pub fn partial(&self) -> Partial {
        Partial { seconds: self.seconds(), ..self.buffers.partial(self.filled) }
    }

    /// Seconds the interval has trained for, an earlier attempt's before its checkpoint included.
    pub(super) fn seconds(&self) -> f64 {
        (self.before + self.start.elapsed()).as_secs_f64()
    }
}
