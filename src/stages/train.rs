//! Stage 5, train and validate: the epoch loop. Each step slices the rank's epoch tensor (one
//! gather per epoch, no per-step copies), runs forward / loss / backward through DDP (or through
//! the pipeline's stages) and updates. Each row's loss and prediction go into per-epoch buffers,
//! reduced and read once per epoch, then all-gathered so that rank 0 holds every rank's row and
//! the global (all-rank) metrics.
use std::time::{Duration, Instant};

use tch::nn::ModuleT;
use tch::{Kind, Reduction, Tensor};

use super::load::Dataset;
use super::normalize::Normalizer;
use super::pipeline::{Stage, StepOut};
use super::shard::{permutation, RankShard};
use super::wrap::Wrapped;
use crate::config::schema::ValidateOn;
use crate::config::Plan;
use crate::device;
use crate::dist::ProcessGroup;
use crate::launch::position::Position;
use crate::trace::progress::Progress;
use crate::trace::{EpochRow, StepRow};

/// What one epoch produced; rank 0 receives every rank's rows.
pub struct EpochOutput {
    pub rows: Vec<EpochRow>,
    pub steps: Vec<StepRow>,
}

/// Values each rank contributes per epoch, all-gathered as one float64 tensor.
const EPOCH_FIELDS: usize = 10;
const STEP_FIELDS: usize = 8;

pub struct Trainer<'a, 'pg> {
    pub plan: &'a Plan,
    pub pg: &'pg ProcessGroup,
    /// Where the model, the data and the batches are (step timings synchronise it).
    pub device: tch::Device,
    pub data: &'a Dataset,
    pub normalizer: &'a Normalizer,
    pub wrapped: Wrapped<'pg>,
    /// This rank's stage, with wrap.strategy = "pipeline".
    pub pipeline: Option<Stage<'pg>>,
    pub progress: Progress,
    pub position: Position,
    /// Steps taken so far (the Reducer's iteration counter follows it).
    pub iteration: i64,
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
        // Each row's loss and prediction, written by its step and reduced once at the epoch's end:
        // two cheap copies per step instead of a chain of small reductions.
        let losses = Tensor::zeros([n], (Kind::Float, dev));
        let predictions = Tensor::zeros([n], (Kind::Int64, dev));
        let (mut comm_s, mut compute_s, mut wait_s) = (0.0, 0.0, 0.0);
        let mut step_rows = Vec::new();
        self.progress.start_epoch(epoch);
        let report_every = (steps / 40).max(1);
        let train_start = Instant::now();
        for step in 0..steps {
            self.position.set("train", epoch, step + 1);
            let t0 = device::now(dev);
            let len = b.min(n - step as i64 * b);
            let (xb, yb) = (x.narrow(0, step as i64 * b, len), y.narrow(0, step as i64 * b, len));
            let t1 = device::now(dev);
            let (s, averaged) = match &self.pipeline {
                Some(stage) => {
                    self.wrapped.optimizer.zero_grad()?;
                    let s = stage.train_step(&self.wrapped.model, &xb, &yb, len)?;
                    (s, stage.average_gradients(&self.wrapped.vs.trainable_variables())?)
                }
                None => (self.replica_step(&xb, &yb)?, Duration::ZERO),
            };
            let t2 = device::now(dev);
            self.wrapped.optimizer.step()?;
            let update = device::elapsed(dev, t2);
            self.iteration += 1;
            if let (Some(per_sample), Some(logits)) = (&s.per_sample, &s.logits) {
                tch::no_grad(|| {
                    losses.narrow(0, step as i64 * b, len).copy_(per_sample);
                    let _ = logits.argmax_out(&predictions.narrow(0, step as i64 * b, len), -1, false);
                });
            }
            let times = match self.wrapped.ddp.as_mut() {
                Some(ddp) => ddp.reducer_times(self.iteration)?,
                None => None,
            };
            comm_s += times.map_or(averaged.as_secs_f64(), |t| t.backward_comm.as_secs_f64());
            compute_s += (s.forward + s.loss + s.backward + update).as_secs_f64();
            wait_s += s.wait.as_secs_f64();
            if step_every > 0 && step % step_every == 0 {
                step_rows.push([
                    step as f64,
                    (t1 - t0).as_secs_f64(),
                    s.forward.as_secs_f64(),
                    s.loss.as_secs_f64(),
                    s.backward.as_secs_f64(),
                    times.map_or(s.wait.as_secs_f64(), |t| t.backward_comm.as_secs_f64()),
                    times.map_or(0.0, |t| t.overlap.as_secs_f64()),
                    update.as_secs_f64(),
                ]);
            }
            if rank == 0 && (step % report_every == 0 || step + 1 == steps) {
                let done = ((step + 1) as i64 * b).min(n) as f64;
                let loss = s.per_sample.as_ref().map(|p| p.mean(Kind::Double).double_value(&[]));
                self.progress.step(step + 1, loss, done / start.elapsed().as_secs_f64());
            }
        }
        let train_s = device::elapsed(dev, train_start).as_secs_f64();
        let epoch_s = start.elapsed().as_secs_f64();
        let samples = w.sum(Kind::Double).double_value(&[]);
        let loss_sum = (losses * &w).sum(Kind::Double);
        let correct = (predictions.eq_tensor(&y).to_kind(Kind::Float) * &w).sum(Kind::Double);

        let validate = c.validate.every > 0 && (epoch.is_multiple_of(c.validate.every) || epoch == c.train.epochs);
        let (val_loss, val_acc) = if validate && self.pipeline.is_some() {
            // The copies of a pipeline hold the same weights: the first one validates.
            if self.plan.replica(rank) == 0 {
                self.position.set("validate", epoch, 0);
                self.validate_pipeline()?
            } else {
                (f64::NAN, f64::NAN)
            }
        } else if validate && (rank == 0 || c.validate.on == ValidateOn::All) {
            self.position.set("validate", epoch, 0);
            self.validate()
        } else {
            (f64::NAN, f64::NAN)
        };

        self.position.set("gather metrics", epoch, 0);
        let bubble = if self.pipeline.is_some() { wait_s / train_s } else { f64::NAN };
        let mine = [
            loss_sum.double_value(&[]),
            correct.double_value(&[]),
            samples,
            steps as f64,
            epoch_s,
            comm_s,
            val_loss,
            val_acc,
            compute_s,
            bubble,
        ];
        let stages = self.pipeline.as_ref().map(|_| self.plan.pipeline_ranks());
        let rows = gather_epoch_rows(self.pg, epoch, &mine, stages)?;
        let steps = gather_step_rows(self.pg, epoch, &step_rows)?;
        Ok(EpochOutput { rows, steps })
    }

    /// One replica's forward, loss and backward (gradients averaged by DDP when wrapped in it).
    fn replica_step(&mut self, xb: &Tensor, yb: &Tensor) -> anyhow::Result<StepOut> {
        let dev = self.device;
        let t0 = device::now(dev);
        if let Some(ddp) = self.wrapped.ddp.as_mut() {
            ddp.prepare_forward()?;
        }
        let logits = self.wrapped.model.forward_t(xb, true);
        let t1 = device::now(dev);
        let per_sample = logits.cross_entropy_loss::<Tensor>(yb, None, Reduction::None, -100, 0.0);
        let loss = per_sample.mean(Kind::Float);
        let t2 = device::now(dev);
        if let Some(ddp) = self.wrapped.ddp.as_mut() {
            ddp.prepare_backward()?;
        }
        self.wrapped.optimizer.zero_grad()?;
        loss.f_backward()
            .map_err(|e| self.pg.explain(crate::dist::Error::new("backward (gradient all-reduce)", e.to_string())))?;
        Ok(StepOut {
            per_sample: Some(per_sample.detach()),
            logits: Some(logits.detach()),
            forward: t1 - t0,
            loss: t2 - t1,
            backward: device::elapsed(dev, t2),
            wait: Duration::ZERO,
        })
    }

    /// The validation rows through every stage; the loss and accuracy are measured on the last
    /// rank and sent to every row of the trace (`NAN` elsewhere, filled in by the gather).
    fn validate_pipeline(&self) -> anyhow::Result<(f64, f64)> {
        let stage = self.pipeline.as_ref().expect("a pipeline");
        let n = self.data.val_x.size()[0];
        if n == 0 {
            return Ok((f64::NAN, f64::NAN));
        }
        let x = if self.pg.rank() == 0 { self.normalizer.apply(&self.data.val_x) } else { Tensor::new() };
        let logits = stage.evaluate(&self.wrapped.model, &x, n, self.plan.batch_per_rank as i64)?;
        Ok(logits.map_or((f64::NAN, f64::NAN), |l| metrics(&l, &self.data.val_y)))
    }

    /// Mean loss and accuracy on the validation rows, normalised with this rank's statistics.
    fn validate(&self) -> (f64, f64) {
        if self.data.val_x.size()[0] == 0 {
            return (f64::NAN, f64::NAN);
        }
        let logits = tch::no_grad(|| self.wrapped.model.forward_t(&self.normalizer.apply(&self.data.val_x), false));
        metrics(&logits, &self.data.val_y)
    }
}

/// Mean cross-entropy and accuracy of `logits` against the labels `y`.
fn metrics(logits: &Tensor, y: &Tensor) -> (f64, f64) {
    tch::no_grad(|| {
        let loss = logits.cross_entropy_for_logits(y).double_value(&[]);
        let acc = logits.argmax(-1, false).eq_tensor(y).to_kind(Kind::Double).mean(Kind::Double).double_value(&[]);
        (loss, acc)
    })
}

/// Every rank's epoch values, all-gathered: rank 0 builds each rank's row and the global metrics.
/// In a pipeline (`stages` ranks per copy), the losses and accuracies are measured on each copy's
/// last rank and written on every row of the copy; the global ones sum over the copies.
fn gather_epoch_rows(
    pg: &ProcessGroup,
    epoch: usize,
    mine: &[f64; EPOCH_FIELDS],
    stages: Option<usize>,
) -> anyhow::Result<Vec<EpochRow>> {
    let all = pg.all_gather(&Tensor::from_slice(mine))?;
    let v: Vec<Vec<f64>> = all.iter().map(|t| Vec::<f64>::try_from(t).expect("float64 values")).collect();
    let measured_on = |r: usize| stages.map_or(r, |s| r / s * s + s - 1);
    let (g_loss, g_correct, g_samples) = (0..v.len())
        .filter(|&r| measured_on(r) == r)
        .fold((0.0, 0.0, 0.0), |a, r| (a.0 + v[r][0], a.1 + v[r][1], a.2 + v[r][2]));
    let opt = |x: f64| (!x.is_nan()).then_some(x);
    Ok(v.iter()
        .enumerate()
        .map(|(r, f)| {
            let m = &v[measured_on(r)];
            EpochRow {
                epoch: epoch as u32,
                rank: r as u32,
                train_loss: m[0] / m[2],
                train_acc: m[1] / m[2],
                global_train_loss: g_loss / g_samples,
                global_train_acc: g_correct / g_samples,
                val_loss: opt(m[6]),
                val_acc: opt(m[7]),
                samples: f[2] as u64,
                steps: f[3] as u64,
                epoch_s: f[4],
                samples_per_s: f[2] / f[4],
                comm_s: f[5],
                compute_s: f[8],
                bubble: opt(f[9]),
            }
        })
        .collect())
}

/// Every rank's sampled steps (the same count on each rank), all-gathered.
fn gather_step_rows(pg: &ProcessGroup, epoch: usize, mine: &[[f64; STEP_FIELDS]]) -> anyhow::Result<Vec<StepRow>> {
    if mine.is_empty() {
        return Ok(Vec::new());
    }
    let flat: Vec<f64> = mine.iter().flatten().copied().collect();
    let all = pg.all_gather(&Tensor::from_slice(&flat))?;
    Ok(all
        .iter()
        .enumerate()
        .flat_map(|(r, t)| {
            let v = Vec::<f64>::try_from(t).expect("float64 values");
            v.chunks(STEP_FIELDS)
                .map(|s| StepRow {
                    epoch: epoch as u32,
                    step: s[0] as u32,
                    rank: r as u32,
                    batch_s: s[1],
                    forward_s: s[2],
                    loss_s: s[3],
                    backward_s: s[4],
                    sync_s: s[5],
                    overlap_s: s[6],
                    update_s: s[7],
                })
                .collect::<Vec<_>>()
        })
        .collect())
}
