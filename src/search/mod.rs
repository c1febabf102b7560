//! Searches as pure functions: what to try next ([`Sampler`]: random or TPE) and when a trial
//! stops ([`Scheduler`]: every trial to the full budget, or successive halving, synchronous or
//! asynchronous), separate as Optuna's samplers and pruners are. Nothing here runs or reads
//! anything: a search's every proposal and decision is a function of its seed and its trials'
//! results, so that it is the same whatever ran the trials and in whichever order they finished.
//! `runner sweep` runs searches ([`crate::sweep::search`]); `runner report` rebuilds their tables
//! from the traces with [`halving::decide`].
pub mod budget;
pub mod halving;
pub mod math;
pub mod space;
pub mod spec;
pub mod tpe;

use crate::rng::Rng;
pub use halving::Outcome;
pub use space::{Distribution, Param, Space};
pub use tpe::{Observation, Tpe};

/// What to try next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampler {
    /// Each trial drawn independently (a countable space: no point twice).
    Random,
    /// The Tree-structured Parzen Estimator, random for its first trials.
    Tpe(Tpe),
}

/// When trials stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduler {
    /// Every trial runs the pipeline's whole budget.
    Full,
    /// Successive halving at the rungs' budgets (the last the full one), the best 1/η of each
    /// rung promoted by `rule` ([`halving`]).
    Halving { rungs: Vec<u64>, rule: halving::Rule },
}

impl Scheduler {
    /// How many budgets a trial may stop at.
    pub fn rungs(&self) -> usize {
        match self {
            Scheduler::Full => 1,
            Scheduler::Halving { rungs, .. } => rungs.len(),
        }
    }

    /// How rungs promote (without rungs: a reduction factor of 1, no trial stopped early).
    pub fn rule(&self) -> halving::Rule {
        match self {
            Scheduler::Full => halving::Rule { eta: 1, synchronous: false },
            Scheduler::Halving { rule, .. } => *rule,
        }
    }
}

/// The stream of a trial's draws: its own, so that a trial's values do not depend on how many
/// draws the trials before it took. Its start is hashed from the seed and the trial: `Rng::new`
/// with streams s and s + 1 of seed 0 starts one draw apart (SplitMix64's state advances by the
/// stream multiplier), and two trials would then draw the same values one draw apart.
fn trial_rng(seed: u64, trial: usize) -> Rng {
    let bytes: Vec<u8> = [seed, trial as u64, 0x5EA2_C400].iter().flat_map(|x| x.to_le_bytes()).collect();
    Rng::new(crate::rng::fnv1a(&bytes), 0)
}

impl Sampler {
    /// Trial `trial`'s point: `known` are the results the sampler may learn from (earlier
    /// trials, oldest first), `earlier` every earlier trial's point.
    pub fn propose(
        &self,
        space: &Space,
        seed: u64,
        trial: usize,
        known: &[Observation],
        earlier: &[Vec<f64>],
    ) -> Vec<f64> {
        let mut rng = trial_rng(seed, trial);
        if let Sampler::Tpe(tpe) = self {
            if let Some(point) = tpe.propose(space, known, &mut rng) {
                return point;
            }
        }
        // A countable space not yet exhausted gives each trial a point of its own.
        let unique = space.size().is_some_and(|n| (earlier.len() as u128) < n);
        loop {
            let point = space.random(&mut rng);
            if !unique || !earlier.contains(&point) {
                return point;
            }
        }
    }

    /// Whether a trial's point depends on earlier trials' results.
    pub fn learns(&self) -> bool {
        matches!(self, Sampler::Tpe(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic objective with its optimum known: the validation loss of a learning rate, a
    /// weight decay and a width, smallest (0) at lr = 10^-2.5, decay = 0.02, width 64 (of 6
    /// choices), with two irrelevant keys.
    fn objective(p: &[f64]) -> f64 {
        let lr = (p[0].log10() + 2.5).powi(2);
        let decay = ((p[1] - 0.02) * 10.0).powi(2);
        let width = if p[2] == 3.0 { 0.0 } else { 0.3 };
        lr + decay + width + 0.0 * (p[3] + p[4])
    }

    fn space() -> Space {
        let p = |key: &str, dist| Param { key: key.into(), dist };
        Space(vec![
            p("train.lr", Distribution::LogUniform { low: 1e-5, high: 1.0 }),
            p("train.weight_decay", Distribution::Uniform { low: 0.0, high: 0.3 }),
            p("wrap.model.hidden", Distribution::Choice([8, 16, 32, 64, 128, 256].map(toml::Value::from).to_vec())),
            p("train.batch_size", Distribution::LogInt { low: 8, high: 512 }),
            p("run.seed", Distribution::Int { low: 0, high: 9 }),
        ])
    }

    /// The best value of a sequential search of `trials` trials.
    fn best(sampler: Sampler, seed: u64, trials: usize) -> f64 {
        let space = space();
        let (mut points, mut known) = (Vec::new(), Vec::new());
        for t in 0..trials {
            let point = sampler.propose(&space, seed, t, &known, &points);
            known.push(Observation { score: objective(&point), point: point.clone(), rung: 0 });
            points.push(point);
        }
        known.iter().map(|o| o.score).fold(f64::INFINITY, f64::min)
    }

    /// TPE against random search, 40 trials each, on 50 seeds: TPE's mean best is under 2/3 of
    /// random search's and TPE does better on at least 30 of the 50 seeds (measured: 0.175
    /// against 0.322, better on 34). Optuna 5.0's TPESampler and RandomSampler on the same
    /// objective, 200 seeds: 0.174 against 0.382 (these samplers on 200 seeds: 0.172 against 0.358).
    #[test]
    fn tpe_beats_random_search_on_a_known_objective() {
        let tpe = Sampler::Tpe(Tpe { startup: tpe::STARTUP });
        let (mut t, mut r, mut wins) = (0.0, 0.0, 0);
        for seed in 0..50 {
            let (a, b) = (best(tpe, seed, 40), best(Sampler::Random, seed, 40));
            t += a / 50.0;
            r += b / 50.0;
            wins += usize::from(a < b);
        }
        assert!(t < 2.0 / 3.0 * r && wins >= 30, "TPE's mean best {t:.4}, random's {r:.4}, TPE better on {wins} of 50");
    }

    #[test]
    fn neighbouring_trials_draw_unrelated_values() {
        let draws = |t: usize| -> Vec<u64> {
            let mut r = trial_rng(0, t);
            (0..64).map(|_| r.next_u64()).collect()
        };
        let (a, b) = (draws(5), draws(6));
        assert!(a.iter().all(|x| !b.contains(x)), "trial 6 repeats trial 5's draws");
    }

    #[test]
    fn proposals_depend_on_the_seed_and_the_trial_only() {
        let space = space();
        let a = Sampler::Random.propose(&space, 3, 5, &[], &[]);
        let b = Sampler::Random.propose(&space, 3, 5, &[], &[vec![0.0; 5]]);
        assert_eq!(a, b);
        assert_ne!(a, Sampler::Random.propose(&space, 3, 6, &[], &[]));
        assert_ne!(a, Sampler::Random.propose(&space, 4, 5, &[], &[]));
    }

    #[test]
    fn random_search_over_a_countable_space_draws_each_point_once() {
        let space =
            Space(vec![Param { key: "k".into(), dist: Distribution::Choice(vec![1.into(), 2.into(), 3.into()]) }]);
        let mut points: Vec<Vec<f64>> = Vec::new();
        for t in 0..3 {
            let p = Sampler::Random.propose(&space, 0, t, &[], &points);
            points.push(p);
        }
        points.sort_by(|a, b| a[0].total_cmp(&b[0]));
        assert_eq!(points, [[0.0], [1.0], [2.0]]);
    }
}
