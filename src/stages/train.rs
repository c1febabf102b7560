//! Stage 5, train and validate: the loop over optimizer steps. A run is `total` optimizer steps
//! ([`Clock`]: `train.steps`, or the epochs' steps), cut into intervals that end in a trace row
//! (every epoch, or every `validate.every_steps`); an epoch is a way of counting steps. Each step
//! takes its batches where the [`Clock`] says (an epoch's shard, or random windows), lets the
//! strategy run forward, loss and backward (averaging gradients its way), and updates. Each row's
//! loss and correctness go into per-interval buffers, reduced once at the interval's end, then
//! all-gathered so that rank 0 holds every rank's row and the global (all-rank) metrics. The
//! buffers of an unfinished interval are part of a mid-interval checkpoint ([`Partial`]), so a
//! run resumed from any step writes the same rows as an uninterrupted one.
use std::ops::Range;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::recipe::{clip_grad_norm, Schedule};
use super::wrap::Wrapped;
use crate::data::normalize::Normalizer;
use crate::data::shard::{permutation, RankShard};
use crate::data::{Dataset, Rows};
use crate::device;
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::rundir::position::Position;
use crate::strategy::{MeshBytes, Micro};
use crate::trace::progress::Progress;
use crate::trace::{EpochRow, StepRow};

pub use super::clock::Clock;
use super::interval::{Buffers, TracedStep};
pub use super::interval::{Interval, Partial};
use super::rows::{gather_epoch_rows, gather_step_rows, RankEpoch, StepSample};

/// What one interval produced; rank 0 receives every rank's rows.
pub struct EpochOutput {
    pub rows: Vec<EpochRow>,
    pub steps: Vec<StepRow>,
}

/// One epoch's rows on a rank: gathered and normalised at once (rows in memory), or their
/// indices, read per batch (data read where it lies).
enum EpochRows {
    Gathered { x: Tensor, y: Tensor, w: Tensor },
    Indexed { indices: Vec<i64>, weights: Vec<f32> },
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
    pub clock: Clock,
    /// A transformer's model FLOPs utilisation, where the device's peak is known.
    pub mfu: Option<super::mfu::Mfu>,
    /// The epoch whose rows are ready, and its rows.
    epoch_rows: Option<(usize, EpochRows)>,
    /// The step's CUDA graph (`run.cuda_graphs`).
    graph: Option<super::graph::StepGraph>,
}

impl<'a, 'pg> Trainer<'a, 'pg> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        plan: &'a Plan,
        pg: &'pg ProcessGroup,
        device: tch::Device,
        data: &'a Dataset,
        normalizer: &'a Normalizer,
        wrapped: Wrapped<'pg>,
        progress: Progress,
        position: Position,
    ) -> Trainer<'a, 'pg> {
        let clock = Clock::of(plan);
        let mfu = super::mfu::Mfu::of(plan, device);
        let graph = super::graph::StepGraph::of(plan.config.run.cuda_graphs, device);
        Trainer { plan, pg, device, data, normalizer, wrapped, progress, position, clock, mfu, epoch_rows: None, graph }
    }

    /// Rows trained in steps `steps` of the interval starting at `start` (batch sizes vary at an
    /// epoch's end).
    fn rows_in(&self, steps: Range<usize>) -> usize {
        steps.map(|s| self.clock.batches(s).map(|b| self.clock.rows(b)).sum::<usize>()).sum()
    }

    /// Makes `epoch`'s rows ready (once per epoch).
    fn ready_epoch(&mut self, epoch: usize) -> anyhow::Result<()> {
        if self.clock.random || self.epoch_rows.as_ref().is_some_and(|(e, _)| *e == epoch) {
            return Ok(());
        }
        let c = &self.plan.config;
        let perm = permutation(c.run.seed, epoch, self.plan.layout.rows, c.shard.shuffle);
        let shard = RankShard::take(&self.plan.layout, &perm, self.plan.replica(self.pg.rank()));
        let rows = match &self.data.train {
            Rows::Memory { x, y } => {
                let idx = shard.index_tensor().to_device(self.device);
                EpochRows::Gathered {
                    x: self.normalizer.apply(&x.index_select(0, &idx)),
                    y: y.index_select(0, &idx),
                    w: shard.weight_tensor().to_device(self.device),
                }
            }
            _ => EpochRows::Indexed { indices: shard.indices, weights: shard.weights },
        };
        self.epoch_rows = Some((epoch, rows));
        Ok(())
    }

    /// Batch `b` of `epoch` (or the `b`-th random batch): inputs, targets and row weights.
    fn batch(&self, epoch: usize, b: usize) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
        let dev = self.device;
        if self.clock.random {
            let Rows::Windows(w) = &self.data.train else { unreachable!("random windows read a token stream") };
            // Batch b is micro-batch b % accumulate of step b / accumulate; of that step's global
            // batch, copy k of the model takes samples (micro × copies + k) × batch onwards.
            let (step, micro) = (b / self.clock.accumulate, b % self.clock.accumulate);
            let (copies, copy) = (self.plan.layout.world_size, self.plan.replica(self.pg.rank()));
            let first = ((micro * copies + copy) * self.clock.batch) as u64;
            let samples = first..first + self.clock.batch as u64;
            let (x, y) = w.random_step(self.plan.config.run.seed, step as u64, samples).map_err(anyhow::Error::msg)?;
            return Ok((
                x.to_device(dev),
                y.to_device(dev),
                Tensor::ones([self.clock.batch as i64], (Kind::Float, dev)),
            ));
        }
        let (e, rows) = self.epoch_rows.as_ref().expect("the epoch's rows are ready");
        debug_assert_eq!(*e, epoch);
        let (from, len) = (b * self.clock.batch, self.clock.rows(b));
        Ok(match rows {
            EpochRows::Gathered { x, y, w } => {
                let (f, l) = (from as i64, len as i64);
                (x.narrow(0, f, l), y.narrow(0, f, l), w.narrow(0, f, l))
            }
            EpochRows::Indexed { indices, weights } => {
                let (x, y) = self.data.train.gather(&indices[from..from + len])?;
                let x = self.normalizer.apply(&x.to_device(dev));
                (x, y.to_device(dev), Tensor::from_slice(&weights[from..from + len]).to_device(dev))
            }
        })
    }

    /// Starts the interval `steps` at step `from` (its first, or a checkpoint's), with the rows
    /// trained before `from` (a checkpoint's `partial` buffers; under another world size they
    /// may be more or fewer than this rank's share of those steps).
    pub fn begin(&self, steps: Range<usize>, from: usize, partial: Option<Partial>) -> Interval {
        let filled = partial.as_ref().map_or(0, |p| p.losses.len());
        let before = Duration::from_secs_f64(partial.as_ref().map_or(0.0, |p| p.seconds.max(0.0)));
        let rows = filled + self.rows_in(from..steps.end);
        let batches: usize = steps.clone().map(|s| self.clock.batches(s).len()).sum();
        Interval {
            buffers: Buffers::new(rows, partial, self.device),
            steps,
            filled,
            checked: filled,
            start: Instant::now(),
            before,
            train_s: Duration::ZERO,
            compute: device::Pending::default(),
            comm: Duration::ZERO,
            comm_measured: 0,
            wait: Duration::ZERO,
            step_rows: Vec::new(),
            report_every: (batches / 40).max(1),
            step_from: filled,
            step_measured: false,
            sent: MeshBytes::default(),
            sent_steps: 0,
        }
    }

    /// Trains optimizer steps `steps` of the interval `iv`.
    pub fn train(&mut self, iv: &mut Interval, steps: Range<usize>) -> anyhow::Result<()> {
        let dev = self.device;
        let schedule = Schedule::of(self.plan);
        let train_start = device::now(dev);
        for step in steps {
            let epoch = self.clock.epoch(step);
            self.ready_epoch(epoch)?;
            if step == iv.steps.start || self.clock.batches(step).start == 0 {
                self.progress.start_epoch(epoch);
            }
            let batches = self.clock.batches(step);
            (iv.step_from, iv.step_measured) = (iv.filled, false);
            let step_rows: usize = batches.clone().map(|b| self.clock.rows(b)).sum();
            let sent_before = self.wrapped.strategy.sent();
            for b in batches.clone() {
                let at = BatchAt { step, b, first: b == batches.start, last: b + 1 == batches.end, step_rows };
                self.train_batch(iv, &at, &schedule)?;
            }
            iv.sent = iv.sent + (self.wrapped.strategy.sent() - sent_before);
            iv.sent_steps += 1;
        }
        iv.train_s += device::elapsed(dev, train_start);
        Ok(())
    }

    /// One batch of an optimizer step: forward, backward, and on the step's last batch the update;
    /// its losses into the interval's buffers, its phase times into the step trace when sampled.
    fn train_batch(&mut self, iv: &mut Interval, at: &BatchAt, schedule: &Schedule) -> anyhow::Result<()> {
        let c = &self.plan.config;
        let (rank, dev) = (self.pg.rank(), self.device);
        let (step, b) = (at.step, at.b);
        let epoch = self.clock.epoch(step);
        self.position.set("train", epoch, b + 1);
        // Dropout masks differ across ranks (as each torch rank draws its own) and depend only
        // on (seed, rank, batch), so a run resumed at any step draws the same ones.
        let global = (step * self.clock.accumulate + b - self.clock.batches(step).start) as i64;
        let stream = self.plan.dropout_rank(rank) as i64;
        tch::manual_seed((c.run.seed as i64) ^ (stream << 32) ^ global.wrapping_mul(0x9E37_79B9));
        let sampled = c.trace.step_every > 0 && (global as usize).is_multiple_of(c.trace.step_every);
        let timer = device::StepClock::new(dev, sampled);
        let t0 = timer.mark();
        let (xb, yb, wb) = self.batch(epoch, b)?;
        let t1 = timer.mark();
        let len = yb.size()[0];
        let w_ = &mut self.wrapped;
        // A captured graph's backward pass writes the gradients it assigned when captured.
        if at.first && !self.graph.as_ref().is_some_and(|g| g.captured()) {
            w_.optimizer.zero_grad()?;
        }
        // Each batch's share of the step's mean loss: its rows over the step's rows.
        let scale = if self.clock.accumulate == 1 { 1.0 } else { len as f64 / at.step_rows as f64 };
        let micro = Micro { scale, sync: at.last };
        let recomputed = crate::dist::recompute_time();
        let (model, strategy, optimizer) = (w_.model.as_ref(), &mut w_.strategy, &mut w_.optimizer);
        let mut step = |x: &Tensor, y: &Tensor, timer| strategy.step(model, optimizer, x, y, timer, micro);
        let s = match self.graph.as_mut() {
            Some(graph) => graph.step(&xb, &yb, timer, step)?,
            None => step(&xb, &yb, timer)?,
        };
        let recompute = crate::dist::recompute_time().saturating_sub(recomputed);
        let t2 = timer.mark();
        if at.last {
            // The optimizer's step count is the schedule's clock: restored by a checkpoint.
            w_.optimizer.set_lr(schedule.lr(w_.optimizer.steps()));
            if let Some(max) = c.train.clip_grad_norm {
                let group = w_.strategy.norm_group(self.pg, w_.optimizer.names());
                iv.buffers.norms.push(clip_grad_norm(w_.optimizer.params(), Some(max), group)?);
            }
            w_.optimizer.step()?;
        }
        let update = timer.since(&t2);
        let at_row = iv.filled as i64;
        tch::no_grad(|| {
            iv.buffers.weights.narrow(0, at_row, len).copy_(&wb);
            if let (Some(per_sample), Some(right)) = (&s.per_sample, &s.correct) {
                iv.buffers.losses.narrow(0, at_row, len).copy_(per_sample);
                iv.buffers.correct.narrow(0, at_row, len).copy_(right);
                iv.step_measured = true;
            }
        });
        iv.filled += len as usize;
        if let Some(c) = s.comm {
            iv.comm += c;
            iv.comm_measured += 1;
        }
        iv.compute.push(s.forward.clone() + s.loss.clone() + s.backward.clone() + update.clone());
        iv.wait += s.wait;
        if sampled {
            iv.step_rows.push(TracedStep {
                epoch,
                step: b,
                batch: device::Span::between(&t0, &t1),
                forward: s.forward,
                loss: s.loss,
                backward: s.backward,
                sync: s.comm.map_or(s.wait, |c| c + s.wait),
                overlap: s.overlap,
                update,
                recompute,
            });
        }
        self.report(iv, at, s.per_sample.as_ref())
    }

    /// Every `report_every` batches and at the interval's last: the losses so far checked to be
    /// finite (a loss that is not stops the run here, not at the interval's end), and rank 0's
    /// progress line.
    fn report(&mut self, iv: &mut Interval, at: &BatchAt, per_sample: Option<&Tensor>) -> anyhow::Result<()> {
        let (step, b) = (at.step, at.b);
        let batches_done = self.batches_done(iv, step, b);
        if !(batches_done.is_multiple_of(iv.report_every) || (at.last && step + 1 == iv.steps.end)) {
            return Ok(());
        }
        let (rank, epoch) = (self.pg.rank(), self.clock.epoch(step));
        let (from, to) = (iv.checked as i64, iv.filled as i64);
        check_finite(&iv.buffers.losses.narrow(0, from, to - from), rank, epoch, step + 1)?;
        iv.checked = iv.filled;
        if rank == 0 {
            let loss = per_sample.map(|p| p.mean(Kind::Double).double_value(&[]));
            let done = if self.plan.config.train.steps.is_some() { step + 1 } else { b + 1 };
            let rate = self.samples_per_s(iv);
            self.progress.step(done, loss, rate, self.mfu.map(|m| m.at(rate)));
        }
        Ok(())
    }

    /// Fails, naming the first, when a parameter or buffer became non-finite by optimizer step
    /// `done`. Checked before anything is written of the model (each trace row, checkpoint and
    /// model file), not at every loss check: a non-finite parameter makes the next losses
    /// non-finite, which those checks catch. Three small reductions per variable: about 45 µs of
    /// CPU for the seed workload's MLP, 2–3% of its steps where they ran every seventh step.
    pub fn check_variables(&self, done: usize) -> anyhow::Result<()> {
        let held = self.wrapped.strategy.held(self.plan, &self.wrapped.vs);
        check_variables(held, self.pg.rank(), self.clock.epoch(done.max(1) - 1), done)
    }

    /// Batches done in the interval, counting batch `b` of `step`.
    fn batches_done(&self, iv: &Interval, step: usize, b: usize) -> usize {
        let before: usize = (iv.steps.start..step).map(|s| self.clock.batches(s).len()).sum();
        before + b - self.clock.batches(step).start + 1
    }

    fn samples_per_s(&self, iv: &Interval) -> f64 {
        iv.filled as f64 / iv.seconds()
    }

    /// Ends the interval: reduces its buffers, validates when due, and all-gathers every rank's row.
    pub fn finish(&mut self, iv: Interval) -> anyhow::Result<EpochOutput> {
        let c = &self.plan.config;
        let done = iv.steps.end;
        let epoch = self.clock.epoch(done - 1);
        self.check_variables(done)?;
        let mut mine = RankEpoch {
            steps: iv.steps.clone().map(|s| self.clock.batches(s).len()).sum::<usize>() as f64,
            ..RankEpoch::default()
        };
        mine.lr = self.wrapped.optimizer.lr();
        let norms = &iv.buffers.norms();
        (mine.grad_norm_mean, mine.grad_norm_max) = match norms.len() {
            0 => (f64::NAN, f64::NAN),
            k => (norms.iter().sum::<f64>() / k as f64, norms.iter().copied().fold(f64::MIN, f64::max)),
        };
        mine.epoch_s = iv.seconds();
        mine.compute_s = iv.compute.total().as_secs_f64();
        let b = &iv.buffers;
        mine.samples = b.weights.sum(Kind::Double).double_value(&[]);
        mine.loss_sum = (&b.losses * &b.weights).sum(Kind::Double).double_value(&[]);
        mine.correct = (&b.correct * &b.weights).sum(Kind::Double).double_value(&[]);
        // DDP's Reducer times only the steps it samples: the interval's total is estimated from them.
        mine.comm_s = match iv.comm_measured {
            0 => 0.0,
            // Gradients are averaged once per optimizer step (the last batch of each).
            k => iv.comm.as_secs_f64() * (iv.steps.len() as f64) / k as f64,
        };
        let validate = c.validate.every > 0
            && match c.train.steps {
                Some(_) => true,
                None => epoch.is_multiple_of(c.validate.every) || done == self.clock.total,
            };
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
        let w = &self.wrapped;
        let state = w.strategy.state_bytes(&w.vs, &w.optimizer, true)?;
        mine.param_bytes = state.parameters as f64;
        mine.grad_bytes = state.gradients as f64;
        mine.optim_bytes = state.optimizer as f64;
        mine.peak_rss_bytes = crate::dist::peak_resident_bytes() as f64;
        // Per step, over the steps this process trained (a resumed interval's since the resume).
        let per_step = |bytes: u64| if iv.sent_steps == 0 { 0.0 } else { bytes as f64 / iv.sent_steps as f64 };
        mine.sent_data_bytes = per_step(iv.sent.data);
        mine.sent_tensor_bytes = per_step(iv.sent.tensor);
        mine.sent_pipeline_bytes = per_step(iv.sent.pipeline);
        mine.mfu = self.mfu.map_or(f64::NAN, |m| m.at(mine.samples / mine.epoch_s));
        let stages = self.wrapped.strategy.pipeline_ranks(self.plan);
        let train_s = iv.train_s.as_secs_f64();
        mine.bubble = if stages.is_some() { iv.wait.as_secs_f64() / train_s } else { f64::NAN };

        self.position.set("gather metrics", epoch, 0);
        let mut rows = gather_epoch_rows(self.pg, epoch, done, &mine, stages)?;
        if self.data.task.is_language_model() {
            rows.iter_mut().for_each(|r| r.language_model(self.plan.data.input[0]));
        }
        let samples: Vec<StepSample> = iv.step_rows.iter().map(TracedStep::resolve).collect();
        let steps = gather_step_rows(self.pg, &samples)?;
        Ok(EpochOutput { rows, steps })
    }
}

/// Where a batch sits in its optimizer step.
struct BatchAt {
    step: usize,
    /// The batch's index in its epoch.
    b: usize,
    first: bool,
    last: bool,
    /// Rows of the whole step, all its batches.
    step_rows: usize,
}

/// Fails with where it happened when `losses` (up to optimizer step `step`, in `epoch`) hold a
/// NaN or an infinity: training on would only spread it.
fn check_finite(losses: &Tensor, rank: usize, epoch: usize, step: usize) -> anyhow::Result<()> {
    let finite = losses.isfinite().all().int64_value(&[]) == 1;
    if !finite {
        anyhow::bail!(
            "the training loss became {} on rank {rank} in epoch {epoch}, by optimizer step {step}: lower train.lr, \
             check the data for extreme values, or use another normalize.method",
            if losses.isnan().any().int64_value(&[]) == 1 { "NaN" } else { "infinite" }
        );
    }
    Ok(())
}

/// Fails, naming the first, when a parameter or buffer (batch norm's running statistics) of
/// those the rank holds (`held`, sorted by name) has a NaN or an infinity after optimizer step
/// `step`: the model written would be worthless.
fn check_variables(held: Vec<(String, Tensor)>, rank: usize, epoch: usize, step: usize) -> anyhow::Result<()> {
    for (name, t) in held {
        if tch::no_grad(|| t.isfinite().all().int64_value(&[])) == 0 {
            anyhow::bail!(
                "`{name}` became NaN or infinite on rank {rank} in epoch {epoch}, by optimizer step {step}: lower \
                 train.lr, check the data for extreme values, or use another normalize.method"
            );
        }
    }
    Ok(())
}
