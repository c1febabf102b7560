//! The learning-rate schedule (`[train.schedule]`): the rate of optimizer step s, counted from 0
//! over the whole run, is a pure function of s, so a resumed run takes the same rates. The plan
//! checks it and prints its shape; the epoch loop (`stages::recipe`) asks it before each step.
use crate::config::schema::{LrSchedule, ScheduleKind, WarmupPeak};

/// The learning rate of every optimizer step of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub lr: f64,
    pub min_lr: f64,
    /// Optimizer steps of warmup.
    pub warmup: usize,
    /// Where the warmup's line reaches lr.
    pub peak: WarmupPeak,
    /// Optimizer steps in the whole run.
    pub total: usize,
    /// The step (0-based) where the decay reaches min_lr: by default `total`, one past the run's
    /// last step, as torch's `CosineAnnealingLR(T_max = total)` and Hugging Face's schedules
    /// (the last step trains above min_lr, never at 0).
    pub decay_end: usize,
    /// Whether `decay_end` is the run's length (no `decay_end` key): the rates then depend on it.
    pub decay_ends_with_run: bool,
    /// kind = step: steps per decay, and the factor.
    pub step_size: usize,
    pub gamma: f64,
}

impl Schedule {
    /// The schedule `s` over a run of `total` optimizer steps, `steps_per_epoch` of them an epoch
    /// (for the keys given in epochs).
    pub fn new(s: &LrSchedule, lr: f64, total: usize, steps_per_epoch: usize) -> Schedule {
        Schedule {
            kind: s.kind,
            lr,
            min_lr: s.min_lr,
            warmup: s.warmup_steps + s.warmup_epochs * steps_per_epoch,
            peak: s.warmup_peak,
            total,
            decay_end: s.decay_end.unwrap_or(total),
            decay_ends_with_run: s.decay_end.is_none(),
            step_size: s.step_size + s.step_epochs * steps_per_epoch,
            gamma: s.gamma.unwrap_or(0.1),
        }
    }

    pub fn of(plan: &super::Plan) -> Schedule {
        let t = &plan.config.train;
        Schedule::new(&t.schedule, t.lr, plan.total_steps(), plan.optimizer_steps_per_epoch())
    }

    /// The learning rate of optimizer step `step` (0-based, over the whole run).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            let ramp = match self.peak {
                WarmupPeak::LastWarmupStep => self.warmup,
                WarmupPeak::FirstDecayStep => self.warmup + 1,
            };
            return self.lr * (step + 1) as f64 / ramp as f64;
        }
        let after = step - self.warmup;
        // The fraction of the decay done: 0 at the first step after warmup, 1 at decay_end
        // (torch's T_cur / T_max).
        let span = self.decay_end.saturating_sub(self.warmup).max(1);
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

    /// Why some rate of the run is out of range, if one is: the parameters are float32, in which
    /// a rate past float32's largest value is infinite, and the warmup's rates are computed as
    /// lr × step / warmup, whose product must stay finite too.
    pub fn out_of_range(&self) -> Option<String> {
        let limit = f32::MAX as f64;
        if self.warmup > 0 && !(self.lr * self.warmup as f64).is_finite() {
            return Some(format!(
                "{:e} × {} warmup steps overflows: the warmup's rates would be infinite; give a rate below {limit:.1e}",
                self.lr, self.warmup
            ));
        }
        // Every schedule peaks at its first step after the warmup (or at its last warmup step).
        let peak = self.lr(self.warmup.min(self.total.saturating_sub(1)));
        // NaN too.
        (peak.is_nan() || peak > limit).then(|| {
            format!(
                "the schedule reaches {peak:e}, beyond float32's largest value ({limit:.1e}), in which the parameters \
                 are updated; give a rate below it"
            )
        })
    }

    /// Whether the rates depend on the run's length (train.epochs).
    pub fn depends_on_length(&self) -> bool {
        matches!(self.kind, ScheduleKind::Linear | ScheduleKind::Cosine) && self.decay_ends_with_run
    }

    /// The shape, for `runner validate`: "cosine 0.1 → 0.001 over 780 steps, after 78 warmup
    /// steps from 1.2821e-3; min_lr at step 859, one past the last (as torch's schedulers)".
    pub fn describe(&self) -> String {
        let warmup = match self.warmup {
            0 => String::new(),
            w => format!(", after {w} warmup step{} from {:.4e}", if w == 1 { "" } else { "s" }, self.lr(0)),
        };
        let decay = self.decay_end.saturating_sub(self.warmup).max(1);
        // Where min_lr is reached (1-based, as the plan counts steps).
        let end = match self.decay_end {
            e if e >= self.total => format!("; min_lr at step {}, one past the last (as torch's schedulers)", e + 1),
            e => format!("; min_lr from step {}", e + 1),
        };
        let shape = match self.kind {
            ScheduleKind::Constant => format!("constant {}", self.lr),
            ScheduleKind::Linear => format!("linear {} → {} over {decay} steps{warmup}{end}", self.lr, self.min_lr),
            ScheduleKind::Cosine => format!("cosine {} → {} over {decay} steps{warmup}{end}", self.lr, self.min_lr),
            ScheduleKind::Step => format!(
                "step {} × {} every {} steps (last {})",
                self.lr,
                self.gamma,
                self.step_size,
                self.lr(self.total.saturating_sub(1))
            ),
        };
        match self.kind {
            ScheduleKind::Linear | ScheduleKind::Cosine => shape,
            _ => format!("{shape}{warmup}"),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: ScheduleKind, warmup: usize) -> Schedule {
        let s = LrSchedule { kind, warmup_steps: warmup, min_lr: 0.01, step_size: 10, ..LrSchedule::default() };
        Schedule::new(&s, 0.1, 100, 10)
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
    fn linear_and_cosine_reach_min_lr_one_step_past_the_run() {
        for kind in [ScheduleKind::Linear, ScheduleKind::Cosine] {
            let s = sched(kind, 10);
            assert!((s.lr(10) - 0.1).abs() < 1e-12, "{kind:?} starts at lr after warmup");
            assert!(s.lr(99) > 0.01, "{kind:?}: the last step trains above min_lr");
            assert!((s.lr(100) - 0.01).abs() < 1e-12, "{kind:?} reaches min_lr at step `total`");
            assert!((1..100).all(|i| i <= 10 || s.lr(i) < s.lr(i - 1)), "{kind:?} falls");
        }
        // torch's CosineAnnealingLR(T_max = 100) at T_cur = 99 (the unit test of its closed form;
        // tests/integration/recipe.rs checks a run's trace against torch itself).
        let c = sched(ScheduleKind::Cosine, 0);
        let torch = 0.01 + (0.1 - 0.01) * (1.0 + (std::f64::consts::PI * 99.0 / 100.0).cos()) / 2.0;
        assert!((c.lr(99) - torch).abs() < 1e-15, "{} against {torch}", c.lr(99));
        assert!((c.lr(50) - 0.055).abs() < 1e-12, "cosine is halfway at the middle");
        assert!(
            c.describe().ends_with("min_lr at step 101, one past the last (as torch's schedulers)"),
            "{}",
            c.describe()
        );
    }

    /// nanoGPT's get_lr(it), written as train.py writes it.
    fn nanogpt_lr(it: usize, lr: f64, min_lr: f64, warmup: usize, decay_iters: usize) -> f64 {
        if it < warmup {
            return lr * (it + 1) as f64 / (warmup + 1) as f64;
        }
        if it > decay_iters {
            return min_lr;
        }
        let ratio = (it - warmup) as f64 / (decay_iters - warmup) as f64;
        min_lr + 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()) * (lr - min_lr)
    }

    #[test]
    fn nanogpt_s_warmup_and_cosine_are_expressible_exactly() {
        let keys = LrSchedule {
            kind: ScheduleKind::Cosine,
            warmup_steps: 100,
            min_lr: 1e-4,
            decay_end: Some(2000),
            warmup_peak: WarmupPeak::FirstDecayStep,
            ..LrSchedule::default()
        };
        let s = Schedule::new(&keys, 1e-3, 2000, 1);
        for it in 0..2000 {
            // The same formula; the cosine's factors multiply in another order (a rounding apart).
            let (ours, theirs) = (s.lr(it), nanogpt_lr(it, 1e-3, 1e-4, 100, 2000));
            assert!((ours - theirs).abs() <= 1e-15 * theirs, "step {it}: {ours} against {theirs}");
        }
        assert!(!s.depends_on_length());
        let longer = Schedule::new(&keys, 1e-3, 2500, 1);
        assert_eq!(longer.lr(2400), 1e-4, "min_lr after decay_end");
    }

    #[test]
    fn step_decays_by_gamma_every_step_size() {
        let s = sched(ScheduleKind::Step, 0);
        assert_eq!(s.lr(9), 0.1);
        assert!((s.lr(10) - 0.01).abs() < 1e-12);
        assert!((s.lr(25) - 0.001).abs() < 1e-12);
    }
}
