//! The training recipe around each optimizer step: the learning-rate schedule (a pure function
//! of the step number, so a resumed run takes the same rates), gradient accumulation (which
//! batches make one step, and each batch's share of the step's mean loss), clipping by the global
//! gradient norm (after averaging, so every rank clips the same), mixed precision and early
//! stopping. The epoch loop asks it; the strategies only receive a loss scale and whether to sync.
use tch::{Kind, Tensor};

use crate::config::schema::{EarlyStop, LrSchedule, Precision, ScheduleKind, StopMode};
use crate::dist::{AutocastBf16, ProcessGroup, ReduceOp};
use crate::plan::Plan;

/// The learning rate of every optimizer step of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub lr: f64,
    pub min_lr: f64,
    /// Optimizer steps of warmup.
    pub warmup: usize,
    /// Optimizer steps in the whole run.
    pub total: usize,
    /// kind = step: steps per decay, and the factor.
    pub step_size: usize,
    pub gamma: f64,
}

impl Schedule {
    /// The schedule `s` over a run of `epochs` × `steps_per_epoch` optimizer steps.
    pub fn new(s: &LrSchedule, lr: f64, epochs: usize, steps_per_epoch: usize) -> Schedule {
        Schedule {
            kind: s.kind,
            lr,
            min_lr: s.min_lr,
            warmup: s.warmup_steps + s.warmup_epochs * steps_per_epoch,
            total: epochs * steps_per_epoch,
            step_size: s.step_size + s.step_epochs * steps_per_epoch,
            gamma: s.gamma.unwrap_or(0.1),
        }
    }

    pub fn of(plan: &Plan) -> Schedule {
        let t = &plan.config.train;
        Schedule::new(&t.schedule, t.lr, t.epochs, plan.optimizer_steps_per_epoch())
    }

    /// The learning rate of optimizer step `step` (0-based, over the whole run).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let after = step - self.warmup;
        // The fraction of the decay done: 0 at the first step after warmup, 1 at the last step.
        let span = self.total.saturating_sub(self.warmup + 1).max(1);
        let t = (after as f64 / span as f64).min(1.0);
        match self.kind {
            ScheduleKind::Constant => self.lr,
            ScheduleKind::Linear => self.min_lr + (self.lr - self.min_lr) * (1.0 - t),
            ScheduleKind::Cosine => {
                self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
            }
            ScheduleKind::Step => self.lr * self.gamma.powi((after / self.step_size.max(1)) as i32),
        }
    }

    /// Whether the rates depend on the run's length (train.epochs).
    pub fn depends_on_length(&self) -> bool {
        matches!(self.kind, ScheduleKind::Linear | ScheduleKind::Cosine)
    }

    /// The shape, for `runner validate`: "cosine 0.1 → 0.001 over 780 steps after 78 warmup steps".
    pub fn describe(&self) -> String {
        let warmup = match self.warmup {
            0 => String::new(),
            w => format!(", after {w} warmup step{} from {:.4e}", if w == 1 { "" } else { "s" }, self.lr(0)),
        };
        let decay = self.total.saturating_sub(self.warmup);
        let shape = match self.kind {
            ScheduleKind::Constant => format!("constant {}", self.lr),
            ScheduleKind::Linear => format!("linear {} → {} over {decay} steps", self.lr, self.min_lr),
            ScheduleKind::Cosine => format!("cosine {} → {} over {decay} steps", self.lr, self.min_lr),
            ScheduleKind::Step => format!(
                "step {} × {} every {} steps (last {})",
                self.lr,
                self.gamma,
                self.step_size,
                self.lr(self.total.saturating_sub(1))
            ),
        };
        format!("{shape}{warmup}")
    }

    /// A few (step, lr) points of the curve, for the plan's table.
    pub fn points(&self) -> String {
        let last = self.total.saturating_sub(1);
        let mut at: Vec<usize> = vec![0, self.warmup.min(last), last / 4, last / 2, 3 * last / 4, last];
        at.sort();
        at.dedup();
        at.iter().map(|&s| format!("{}: {:.4e}", s + 1, self.lr(s))).collect::<Vec<_>>().join(", ")
    }
}

/// Which batches of an epoch make one optimizer step: groups of `k` consecutive batches (the last
/// group may be shorter).
#[derive(Debug, Clone, Copy)]
pub struct Accumulation {
    pub k: usize,
    /// Rows per batch, and rows in the rank's epoch.
    pub batch: i64,
    pub rows: i64,
    pub batches: usize,
}

impl Accumulation {
    /// Whether batch `i` starts an optimizer step (zero the gradients), ends one (sync, clip,
    /// update), and its loss's share of the step: its rows over the step's rows, so the k batches'
    /// gradients add up to those of the mean loss over all of them.
    pub fn batch(&self, i: usize) -> (bool, bool, f64) {
        let start = i / self.k * self.k;
        let end = (start + self.k).min(self.batches);
        let rows = |from: usize, to: usize| (to as i64 * self.batch).min(self.rows) - from as i64 * self.batch;
        let scale = if self.k == 1 { 1.0 } else { rows(i, i + 1) as f64 / rows(start, end) as f64 };
        (i == start, i + 1 == end, scale)
    }
}

/// Clips `params`' gradients (already averaged) to a global L2 norm of `max` when they exceed it,
/// as `torch.nn.utils.clip_grad_norm_`; returns the norm before clipping. `group`: the ranks
/// holding the other parts of the model (a pipeline's stages, each copy holding the same
/// averaged gradients `copies` times), whose squared norms add up to the global one.
pub fn clip_grad_norm(
    params: &[Tensor],
    max: Option<f64>,
    group: Option<(&ProcessGroup, usize)>,
) -> anyhow::Result<f64> {
    let grads: Vec<Tensor> = params.iter().map(Tensor::grad).filter(Tensor::defined).collect();
    let norm = tch::no_grad(|| -> anyhow::Result<f64> {
        let mut sq = match grads.len() {
            0 => Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)),
            _ => Tensor::stack(&grads.iter().map(|g| g.norm()).collect::<Vec<_>>(), 0)
                .square()
                .sum(Kind::Float)
                .view([1]),
        };
        if let Some((pg, copies)) = group {
            pg.all_reduce(&mut sq, ReduceOp::Sum)?;
            if copies > 1 {
                sq /= copies as f64;
            }
        }
        Ok(sq.sqrt().double_value(&[0]))
    })?;
    if let Some(max) = max {
        let coef = max / (norm + 1e-6);
        if coef < 1.0 {
            tch::no_grad(|| {
                for g in &grads {
                    let _ = g.shallow_clone().g_mul_scalar_(coef);
                }
            });
        }
    }
    Ok(norm)
}

/// Runs `f` (a forward pass) in the run's precision: bf16 autocasts it to bfloat16.
pub fn in_precision<T>(precision: Precision, f: impl FnOnce() -> T) -> anyhow::Result<T> {
    match precision {
        Precision::Fp32 => Ok(f()),
        Precision::Bf16 => {
            let _guard = AutocastBf16::enter()?;
            Ok(f())
        }
        // Refused on the plan: CPU runs only.
        Precision::Fp16 => anyhow::bail!("train.precision = \"fp16\" needs CUDA"),
    }
}

/// Early stopping's state: the best value of the metric and when it was seen. It is rebuilt from
/// the trace rows on resume, so it needs no checkpoint of its own.
#[derive(Debug, Clone)]
pub struct EarlyStopper {
    pub rule: EarlyStop,
    pub best: Option<(usize, f64)>,
    /// Validations since the best one.
    pub since: usize,
}

/// What one validation meant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Improved,
    Waiting,
    Stop,
}

impl EarlyStopper {
    pub fn new(rule: &EarlyStop) -> EarlyStopper {
        EarlyStopper { rule: rule.clone(), best: None, since: 0 }
    }

    /// Records epoch `epoch`'s metric value.
    pub fn observe(&mut self, epoch: usize, value: f64) -> Verdict {
        let better = match self.best {
            None => true,
            Some((_, best)) => match self.rule.mode() {
                StopMode::Min => value < best - self.rule.min_delta,
                StopMode::Max => value > best + self.rule.min_delta,
            },
        };
        if better {
            self.best = Some((epoch, value));
            self.since = 0;
            Verdict::Improved
        } else {
            self.since += 1;
            if self.since >= self.rule.patience {
                Verdict::Stop
            } else {
                Verdict::Waiting
            }
        }
    }

    /// Why the run stopped, for the manifest.
    pub fn reason(&self, epoch: usize) -> String {
        let (best_epoch, best) = self.best.expect("stopped after a validation");
        format!(
            "early stop after epoch {epoch}: {:?} did not improve by more than {} for {} validations (best {best} at \
             epoch {best_epoch})",
            self.rule.metric, self.rule.min_delta, self.rule.patience
        )
        .replace("ValLoss", "val_loss")
        .replace("ValAcc", "val_acc")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: ScheduleKind, warmup: usize) -> Schedule {
        let s = LrSchedule { kind, warmup_steps: warmup, min_lr: 0.01, step_size: 10, ..LrSchedule::default() };
        Schedule::new(&s, 0.1, 10, 10)
    }

    #[test]
    fn warmup_rises_linearly_to_lr() {
        let s = sched(ScheduleKind::Constant, 10);
        assert!((s.lr(0) - 0.01).abs() < 1e-12);
        assert!((s.lr(4) - 0.05).abs() < 1e-12);
        assert_eq!(s.lr(9), 0.1);
        assert_eq!(s.lr(50), 0.1);
    }

    #[test]
    fn linear_and_cosine_end_at_min_lr() {
        for kind in [ScheduleKind::Linear, ScheduleKind::Cosine] {
            let s = sched(kind, 10);
            assert!((s.lr(10) - 0.1).abs() < 1e-12, "{kind:?} starts at lr after warmup");
            assert!((s.lr(99) - 0.01).abs() < 1e-12, "{kind:?} ends at min_lr");
            assert!((1..100).all(|i| i <= 10 || s.lr(i) <= s.lr(i - 1)), "{kind:?} falls");
        }
        let c = sched(ScheduleKind::Cosine, 0);
        assert!((c.lr(99 / 2) - 0.055).abs() < 2e-3, "cosine is halfway at the middle");
    }

    #[test]
    fn step_decays_by_gamma_every_step_size() {
        let s = sched(ScheduleKind::Step, 0);
        assert_eq!(s.lr(9), 0.1);
        assert!((s.lr(10) - 0.01).abs() < 1e-12);
        assert!((s.lr(25) - 0.001).abs() < 1e-12);
    }

    #[test]
    fn accumulation_shares_add_up_to_one_per_step() {
        // 10 rows in batches of 3: 4 batches (3, 3, 3, 1); k = 3 makes steps of 9 and 1 rows.
        let a = Accumulation { k: 3, batch: 3, rows: 10, batches: 4 };
        let v: Vec<_> = (0..4).map(|i| a.batch(i)).collect();
        assert_eq!(v[0], (true, false, 3.0 / 9.0));
        assert_eq!(v[2], (false, true, 3.0 / 9.0));
        assert_eq!(v[3], (true, true, 1.0));
    }

    #[test]
    fn early_stop_waits_patience_validations() {
        let rule = EarlyStop { patience: 2, min_delta: 0.01, ..EarlyStop::default() };
        let mut e = EarlyStopper::new(&rule);
        assert_eq!(e.observe(1, 1.0), Verdict::Improved);
        assert_eq!(e.observe(2, 0.995), Verdict::Waiting, "within min_delta");
        assert_eq!(e.observe(3, 0.5), Verdict::Improved);
        assert_eq!(e.observe(4, 0.6), Verdict::Waiting);
        assert_eq!(e.observe(5, 0.6), Verdict::Stop);
        assert_eq!(e.best, Some((3, 0.5)));
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let p = Tensor::from_slice(&[3.0f32, 4.0]).set_requires_grad(true);
        (&p * &p).sum(Kind::Float).backward(); // gradient (6, 8), norm 10
        let norm = clip_grad_norm(std::slice::from_ref(&p), Some(5.0), None).unwrap();
        assert!((norm - 10.0).abs() < 1e-5);
        let g = Vec::<f32>::try_from(p.grad()).unwrap();
        assert!((g[0] - 3.0).abs() < 1e-4 && (g[1] - 4.0).abs() < 1e-4, "{g:?}");
    }
}
