//! Stage 5, train and validate: the epoch loop. Each step slices the rank's epoch tensor (one
//! gather per epoch, no per-step copies), lets the strategy run forward, loss and backward
//! (averaging gradients its way), and updates. Each row's loss and correctness go into per-epoch
//! buffers, reduced once per epoch, then all-gathered so that rank 0 holds every rank's row and
//! the global (all-rank) metrics.
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::recipe::{clip_grad_norm, Accumulation, Schedule};
use super::wrap::Wrapped;
use crate::data::normalize::Normalizer;
use crate::data::shard::{permutation, RankShard};
use crate::data::Dataset;
use crate::device;
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::rundir::position::Position;
use crate::strategy::Micro;
use crate::trace::progress::Progress;
use crate::trace::{EpochRow, StepRow};

/// What one epoch produced; rank 0 receives every rank's rows.
pub struct EpochOutput {
    pub rows: Vec<EpochRow>,
    pub steps: Vec<StepRow>,
}

pub struct Trainer<'a, 'pg> {
    pub plan: &'a Plan,
    pub pg: &'pg ProcessGroup,
    /// Where the model, the data and the batches are (step timings synchronise it).
    pub device: tch::Device,
    pub data: &'a Dataset,
    pub normalizer: &'a Normalizer,
    pub wrapped: Wrapped<'pg>,
    pub progress: Progress,
    pub position: Position,
    /// Steps taken so far, over every epoch of this process (DDP's Reducer counts the same).
    pub iteration: usize,
}

impl Trainer<'_, '_> {
    pub fn epoch(&mut self, epoch: usize) -> anyhow::Result<EpochOutput> {
        let c = &self.plan.config;
        let rank = self.pg.rank();
        let start = Instant::now();
        // Dropout masks differ across ranks (as each torch rank draws its own) and depend only on
        // (seed, rank, epoch), so a run resumed at an epoch boundary draws the same ones.
        tch::manual_seed((c.run.seed as i64) ^ ((rank as i64) << 32) ^ (epoch as i64).wrapping_mul(0x9E37_79B9));
        let perm = permutation(c.run.seed, epoch, self.plan.layout.rows, c.shard.shuffle);
        let shard = RankShard::take(&self.plan.layout, &perm, self.plan.replica(rank));
        let dev = self.device;
        let idx = shard.index_tensor().to_device(dev);
        let x = self.normalizer.apply(&self.data.train_x.index_select(0, &idx));
        let y = self.data.train_y.index_select(0, &idx);
        let w = shard.weight_tensor().to_device(dev);

        let b = self.plan.batch_per_rank as i64;
        let n = self.plan.layout.per_rank as i64;
        let steps = self.plan.steps_per_epoch();
        let step_every = c.trace.step_every;
        // Each row's loss and correctness, written by its step and reduced once at the epoch's
        // end: two cheap copies per step instead of a chain of small reductions.
        let losses = Tensor::zeros([n], (Kind::Float, dev));
        let correct = Tensor::zeros([n], (Kind::Float, dev));
        let mut mine = RankEpoch { steps: steps as f64, ..RankEpoch::default() };
        let (mut comm, mut comm_measured, mut wait) = (Duration::ZERO, 0usize, Duration::ZERO);
        let mut step_rows = Vec::new();
        self.progress.start_epoch(epoch);
        let report_every = (steps / 40).max(1);
        let mut checked = 0;
        let train_start = Instant::now();
        let accumulation = Accumulation { k: c.train.accumulate, batch: b, rows: n, batches: steps };
        let schedule = Schedule::of(self.plan);
        let norm_group = self.wrapped.strategy.norm_group().map(|copies| (self.pg, copies));
        let mut norms = Vec::new();
        for step in 0..steps {
            self.position.set("train", epoch, step + 1);
            self.iteration += 1;
            let sampled = step_every > 0 && self.iteration.is_multiple_of(step_every);
            let t0 = device::now(dev);
            let len = b.min(n - step as i64 * b);
            let (xb, yb) = (x.narrow(0, step as i64 * b, len), y.narrow(0, step as i64 * b, len));
            let t1 = device::now(dev);
            let w_ = &mut self.wrapped;
            let (first, last, scale) = accumulation.batch(step);
            if first {
                w_.optimizer.zero_grad()?;
            }
            let micro = Micro { scale, sync: last };
            let s = w_.strategy.step(w_.model.as_ref(), &mut w_.optimizer, &xb, &yb, sampled, micro)?;
            let t2 = device::now(dev);
            if last {
                // The optimizer's step count is the schedule's clock: restored by a checkpoint.
                w_.optimizer.set_lr(schedule.lr(w_.optimizer.steps()));
                if let Some(max) = c.train.clip_grad_norm {
                    norms.push(clip_grad_norm(w_.optimizer.params(), Some(max), norm_group)?);
                }
                w_.optimizer.step()?;
            }
            let update = device::elapsed(dev, t2);
            if let (Some(per_sample), Some(right)) = (&s.per_sample, &s.correct) {
                tch::no_grad(|| {
                    losses.narrow(0, step as i64 * b, len).copy_(per_sample);
                    correct.narrow(0, step as i64 * b, len).copy_(right);
                });
            }
            if let Some(c) = s.comm {
                comm += c;
                comm_measured += 1;
            }
            mine.compute_s += (s.forward + s.loss + s.backward + update).as_secs_f64();
            wait += s.wait;
            if sampled {
                step_rows.push(StepSample {
                    step: step as f64,
                    batch_s: (t1 - t0).as_secs_f64(),
                    forward_s: s.forward.as_secs_f64(),
                    loss_s: s.loss.as_secs_f64(),
                    backward_s: s.backward.as_secs_f64(),
                    sync_s: s.comm.map_or(s.wait, |c| c + s.wait).as_secs_f64(),
                    overlap_s: s.overlap.as_secs_f64(),
                    update_s: update.as_secs_f64(),
                });
            }
            if step % report_every == 0 || step + 1 == steps {
                // A loss that is no longer finite stops the run here, not at the epoch's end.
                let to = ((step + 1) as i64 * b).min(n);
                check_finite(&losses.narrow(0, checked, to - checked), rank, epoch, checked / b + 1, step + 1)?;
                checked = to;
                if rank == 0 {
                    let loss = s.per_sample.as_ref().map(|p| p.mean(Kind::Double).double_value(&[]));
                    self.progress.step(step + 1, loss, to as f64 / start.elapsed().as_secs_f64());
                }
            }
        }
        let train_s = device::elapsed(dev, train_start).as_secs_f64();
        mine.lr = self.wrapped.optimizer.lr();
        (mine.grad_norm_mean, mine.grad_norm_max) = match norms.len() {
            0 => (f64::NAN, f64::NAN),
            k => (norms.iter().sum::<f64>() / k as f64, norms.iter().copied().fold(f64::MIN, f64::max)),
        };
        mine.epoch_s = start.elapsed().as_secs_f64();
        mine.samples = w.sum(Kind::Double).double_value(&[]);
        mine.loss_sum = (losses * &w).sum(Kind::Double).double_value(&[]);
        mine.correct = (correct * &w).sum(Kind::Double).double_value(&[]);
        // DDP's Reducer times only the steps it samples: the epoch's total is estimated from them.
        mine.comm_s = match comm_measured {
            0 => 0.0,
            // Gradients are averaged once per optimizer step (the last batch of each).
            k => comm.as_secs_f64() * self.plan.optimizer_steps_per_epoch() as f64 / k as f64,
        };

        let validate = c.validate.every > 0 && (epoch.is_multiple_of(c.validate.every) || epoch == c.train.epochs);
        let nan = f64::NAN;
        (mine.val_loss, mine.val_acc, mine.val_f1, mine.val_rmse, mine.val_mae, mine.val_r2) =
            (nan, nan, nan, nan, nan, nan);
        if validate {
            self.position.set("validate", epoch, 0);
            let w_ = &self.wrapped;
            if let Some(m) = w_.strategy.validate(self.plan, w_.model.as_ref(), self.data, self.normalizer)? {
                (mine.val_loss, mine.val_acc, mine.val_f1) = (m.loss, m.acc, m.f1);
                (mine.val_rmse, mine.val_mae, mine.val_r2) = (m.rmse, m.mae, m.r2);
            }
        }
        let stages = self.wrapped.strategy.pipeline_ranks(self.plan);
        mine.bubble = if stages.is_some() { wait.as_secs_f64() / train_s } else { f64::NAN };

        self.position.set("gather metrics", epoch, 0);
        let mut rows = gather_epoch_rows(self.pg, epoch, &mine, stages)?;
        if self.data.task.is_language_model() {
            rows.iter_mut().for_each(|r| r.language_model(self.plan.data.input[0]));
        }
        let steps = gather_step_rows(self.pg, epoch, &step_rows)?;
        Ok(EpochOutput { rows, steps })
    }
}

/// Fails with where it happened when `losses` (steps `first`..=`last` of `epoch`) hold a NaN or
/// an infinity: training on would only spread it.
fn check_finite(losses: &Tensor, rank: usize, epoch: usize, first: i64, last: usize) -> anyhow::Result<()> {
    let finite = losses.isfinite().all().int64_value(&[]) == 1;
    if !finite {
        anyhow::bail!(
            "the training loss became {} on rank {rank} in epoch {epoch}, steps {first}-{last}: lower train.lr, \
             check the data for extreme values, or use another normalize.method",
            if losses.isnan().any().int64_value(&[]) == 1 { "NaN" } else { "infinite" }
        );
    }
    Ok(())
}

/// What one rank measured over an epoch. Ranks all-gather it as one float64 tensor, in the
/// order of [`RankEpoch::to_array`]; NaN marks what a rank did not measure.
#[derive(Debug, Clone, Copy, Default)]
struct RankEpoch {
    loss_sum: f64,
    correct: f64,
    samples: f64,
    steps: f64,
    epoch_s: f64,
    comm_s: f64,
    val_loss: f64,
    val_acc: f64,
    compute_s: f64,
    bubble: f64,
    /// The learning rate of the epoch's last optimizer step.
    lr: f64,
    /// The global gradient norm before clipping, over the epoch's optimizer steps (NaN without
    /// clipping).
    grad_norm_mean: f64,
    grad_norm_max: f64,
    val_f1: f64,
    val_rmse: f64,
    val_mae: f64,
    val_r2: f64,
}

impl RankEpoch {
    fn to_array(self) -> [f64; 17] {
        let RankEpoch {
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
            lr,
            grad_norm_mean,
            grad_norm_max,
            val_f1,
            val_rmse,
            val_mae,
            val_r2,
        } = self;
        [
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
            lr,
            grad_norm_mean,
            grad_norm_max,
            val_f1,
            val_rmse,
            val_mae,
            val_r2,
        ]
    }

    fn from_slice(v: &[f64]) -> RankEpoch {
        let [loss_sum, correct, samples, steps, epoch_s, comm_s, val_loss, val_acc, compute_s, bubble, lr, grad_norm_mean, grad_norm_max, val_f1, val_rmse, val_mae, val_r2] =
            v.try_into().expect("17 values per rank");
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
            lr,
            grad_norm_mean,
            grad_norm_max,
            val_f1,
            val_rmse,
            val_mae,
            val_r2,
        }
    }
}

/// One sampled step's phases on one rank, all-gathered as float64 values in field order.
#[derive(Debug, Clone, Copy)]
struct StepSample {
    step: f64,
    batch_s: f64,
    forward_s: f64,
    loss_s: f64,
    backward_s: f64,
    sync_s: f64,
    overlap_s: f64,
    update_s: f64,
}

impl StepSample {
    const FIELDS: usize = 8;

    fn to_array(self) -> [f64; Self::FIELDS] {
        let StepSample { step, batch_s, forward_s, loss_s, backward_s, sync_s, overlap_s, update_s } = self;
        [step, batch_s, forward_s, loss_s, backward_s, sync_s, overlap_s, update_s]
    }

    fn row(v: &[f64], epoch: usize, rank: usize) -> StepRow {
        let [step, batch_s, forward_s, loss_s, backward_s, sync_s, overlap_s, update_s] =
            v.try_into().expect("8 values per step");
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
        }
    }
}

/// Every rank's epoch values, all-gathered: rank 0 builds each rank's row and the global metrics.
/// In a pipeline (`stages` ranks per copy), the losses and accuracies are measured on each copy's
/// last rank and written on every row of the copy; the global ones sum over the copies.
fn gather_epoch_rows(
    pg: &ProcessGroup,
    epoch: usize,
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
                rank: r as u32,
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
                lr: f.lr,
                grad_norm_mean: opt(f.grad_norm_mean),
                grad_norm_max: opt(f.grad_norm_max),
            }
        })
        .collect())
}

/// Every rank's sampled steps (the same count on each rank), all-gathered.
fn gather_step_rows(pg: &ProcessGroup, epoch: usize, mine: &[StepSample]) -> anyhow::Result<Vec<StepRow>> {
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
            v.chunks(StepSample::FIELDS).map(|s| StepSample::row(s, epoch, r)).collect::<Vec<_>>()
        })
        .collect())
}
