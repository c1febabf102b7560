//! Stage 5, train and validate: the epoch loop. Each step slices the rank's epoch tensor (one
//! gather per epoch, no per-step copies), runs forward / loss / backward through DDP and updates.
//! Metrics accumulate on tensors and are read once per epoch, then all-gathered so that rank 0
//! holds every rank's row and the global (all-rank) metrics.
use std::time::Instant;

use tch::nn::ModuleT;
use tch::{Kind, Reduction, Tensor};

use super::load::Dataset;
use super::normalize::Normalizer;
use super::shard::{permutation, RankShard};
use super::wrap::Wrapped;
use crate::config::schema::ValidateOn;
use crate::config::Plan;
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
const EPOCH_FIELDS: usize = 8;
const STEP_FIELDS: usize = 8;

pub struct Trainer<'a, 'pg> {
    pub plan: &'a Plan,
    pub pg: &'pg ProcessGroup,
    pub data: &'a Dataset,
    pub normalizer: &'a Normalizer,
    pub wrapped: Wrapped<'pg>,
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
        let shard = RankShard::take(&self.plan.layout, &perm, rank);
        let idx = shard.index_tensor();
        let x = self.normalizer.apply(&self.data.train_x.index_select(0, &idx));
        let y = self.data.train_y.index_select(0, &idx);
        let w = shard.weight_tensor();

        let b = self.plan.batch_per_rank as i64;
        let n = self.plan.layout.per_rank as i64;
        let steps = self.plan.steps_per_epoch();
        let step_every = c.trace.step_every;
        // Each row's loss and prediction, written by its step and reduced once at the epoch's end:
        // two cheap copies per step instead of a chain of small reductions.
        let losses = Tensor::zeros([n], (Kind::Float, tch::Device::Cpu));
        let predictions = Tensor::zeros([n], (Kind::Int64, tch::Device::Cpu));
        let mut comm_s = 0.0;
        let mut step_rows = Vec::new();
        self.progress.start_epoch(epoch);
        let report_every = (steps / 40).max(1);
        for step in 0..steps {
            self.position.set("train", epoch, step + 1);
            let t0 = Instant::now();
            let len = b.min(n - step as i64 * b);
            let (xb, yb) = (x.narrow(0, step as i64 * b, len), y.narrow(0, step as i64 * b, len));
            let t1 = Instant::now();
            if let Some(ddp) = self.wrapped.ddp.as_mut() {
                ddp.prepare_forward()?;
            }
            let logits = self.wrapped.model.forward_t(&xb, true);
            let t2 = Instant::now();
            let per_sample = logits.cross_entropy_loss::<Tensor>(&yb, None, Reduction::None, -100, 0.0);
            let loss = per_sample.mean(Kind::Float);
            let t3 = Instant::now();
            if let Some(ddp) = self.wrapped.ddp.as_mut() {
                ddp.prepare_backward()?;
            }
            self.wrapped.optimizer.zero_grad()?;
            loss.f_backward().map_err(|e| {
                self.pg.explain(crate::dist::Error::new("backward (gradient all-reduce)", e.to_string()))
            })?;
            let t4 = Instant::now();
            self.wrapped.optimizer.step()?;
            let t5 = Instant::now();
            self.iteration += 1;
            tch::no_grad(|| {
                losses.narrow(0, step as i64 * b, len).copy_(&per_sample);
                let _ = logits.argmax_out(&predictions.narrow(0, step as i64 * b, len), -1, false);
            });
            let times = match self.wrapped.ddp.as_mut() {
                Some(ddp) => ddp.reducer_times(self.iteration)?,
                None => None,
            };
            comm_s += times.map_or(0.0, |t| t.backward_comm.as_secs_f64());
            if step_every > 0 && step % step_every == 0 {
                step_rows.push([
                    step as f64,
                    (t1 - t0).as_secs_f64(),
                    (t2 - t1).as_secs_f64(),
                    (t3 - t2).as_secs_f64(),
                    (t4 - t3).as_secs_f64(),
                    times.map_or(0.0, |t| t.backward_comm.as_secs_f64()),
                    times.map_or(0.0, |t| t.overlap.as_secs_f64()),
                    (t5 - t4).as_secs_f64(),
                ]);
            }
            if rank == 0 && (step % report_every == 0 || step + 1 == steps) {
                let done = ((step + 1) as i64 * b).min(n) as f64;
                self.progress.step(step + 1, Some(loss.double_value(&[])), done / start.elapsed().as_secs_f64());
            }
        }
        let epoch_s = start.elapsed().as_secs_f64();
        let samples = w.sum(Kind::Double).double_value(&[]);
        let loss_sum = (losses * &w).sum(Kind::Double);
        let correct = (predictions.eq_tensor(&y).to_kind(Kind::Float) * &w).sum(Kind::Double);

        let validate = c.validate.every > 0 && (epoch.is_multiple_of(c.validate.every) || epoch == c.train.epochs);
        let (val_loss, val_acc) = if validate && (rank == 0 || c.validate.on == ValidateOn::All) {
            self.position.set("validate", epoch, 0);
            self.validate()
        } else {
            (f64::NAN, f64::NAN)
        };

        self.position.set("gather metrics", epoch, 0);
        let mine = [
            loss_sum.double_value(&[]),
            correct.double_value(&[]),
            samples,
            steps as f64,
            epoch_s,
            comm_s,
            val_loss,
            val_acc,
        ];
        let rows = gather_epoch_rows(self.pg, epoch, &mine)?;
        let steps = gather_step_rows(self.pg, epoch, &step_rows)?;
        Ok(EpochOutput { rows, steps })
    }

    /// Mean loss and accuracy on the validation rows, normalised with this rank's statistics.
    fn validate(&self) -> (f64, f64) {
        if self.data.val_x.size()[0] == 0 {
            return (f64::NAN, f64::NAN);
        }
        tch::no_grad(|| {
            let logits = self.wrapped.model.forward_t(&self.normalizer.apply(&self.data.val_x), false);
            let loss = logits.cross_entropy_for_logits(&self.data.val_y).double_value(&[]);
            let acc = logits
                .argmax(-1, false)
                .eq_tensor(&self.data.val_y)
                .to_kind(Kind::Double)
                .mean(Kind::Double)
                .double_value(&[]);
            (loss, acc)
        })
    }
}

/// Every rank's epoch values, all-gathered: rank 0 builds each rank's row and the global metrics.
fn gather_epoch_rows(pg: &ProcessGroup, epoch: usize, mine: &[f64; EPOCH_FIELDS]) -> anyhow::Result<Vec<EpochRow>> {
    let all = pg.all_gather(&Tensor::from_slice(mine))?;
    let v: Vec<Vec<f64>> = all.iter().map(|t| Vec::<f64>::try_from(t).expect("float64 values")).collect();
    let (g_loss, g_correct, g_samples) = v.iter().fold((0.0, 0.0, 0.0), |a, r| (a.0 + r[0], a.1 + r[1], a.2 + r[2]));
    let opt = |x: f64| (!x.is_nan()).then_some(x);
    Ok(v.iter()
        .enumerate()
        .map(|(r, f)| EpochRow {
            epoch: epoch as u32,
            rank: r as u32,
            train_loss: f[0] / f[2],
            train_acc: f[1] / f[2],
            global_train_loss: g_loss / g_samples,
            global_train_acc: g_correct / g_samples,
            val_loss: opt(f[6]),
            val_acc: opt(f[7]),
            samples: f[2] as u64,
            steps: f[3] as u64,
            epoch_s: f[4],
            samples_per_s: f[2] / f[4],
            comm_s: f[5],
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
