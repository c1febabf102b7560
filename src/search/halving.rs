//! Successive halving, decided at fixed points. Trials run to a rung's budget; the best 1/η of a
//! rung go on to the next one, the others stop there. Two rules ([`Rule`]):
//!
//! - **Asynchronous** (ASHA, Li et al. 2018) promotes a trial as soon as it is in the top 1/η of
//!   what its rung has seen, so which trials a rung has seen depends on which finished first.
//!   Here a rung sees its trials in the order they entered it (rung 0: the trials' order; each
//!   later rung: the order of promotion) and decides after each prefix of that order: once the
//!   first j entrants of a rung have their results, its best ⌊j/η⌋ of them are promoted, best
//!   first. That is ASHA's rule on a fixed order, so the promotions are a function of the results
//!   alone, whatever finishes first; a promotion waits only for the results of the trials that
//!   entered the rung before it.
//! - **Synchronous** (successive halving, Jamieson & Talwalkar 2016) waits until a rung is whole
//!   (every trial has entered it and has its result), then promotes its best ⌊n/η⌋ of n, best
//!   first. It compares each trial with every other of its rung, where ASHA compares it with
//!   those that entered before it; the price is the wait at each rung for its slowest trial.
//!
//! The search's state is its trials' results; [`decide`] recomputes every decision from them.

/// Which trials a rung promotes, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// The reduction factor η: a rung promotes 1/η of its trials (1: none stop early).
    pub eta: usize,
    /// Whether a rung promotes only once it is whole (successive halving) rather than after each
    /// prefix of its entrants (ASHA).
    pub synchronous: bool,
}

/// A trial's result at a rung.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// The metric at the rung's budget.
    Value(f64),
    /// The run failed before it reached the rung's budget.
    Failed,
}

/// The budgets trials stop at to be compared: `min`, `min × eta`, ... below `max`, then `max`.
pub fn rungs(min: u64, max: u64, eta: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut r = min;
    while r < max {
        out.push(r);
        r = r.saturating_mul(eta);
    }
    out.push(max);
    out
}

/// What the results decide so far.
#[derive(Debug, Clone, PartialEq)]
pub struct Decisions {
    /// Each rung's trials, in the order they entered it.
    pub entrants: Vec<Vec<usize>>,
    /// Whether each rung is settled: it will take no more trials and each of its trials has a
    /// result (a trial of a settled rung that was not promoted has stopped there).
    pub settled: Vec<bool>,
}

/// Where a trial stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// It has to run to this rung (it has not, or it is running).
    Pending(usize),
    /// It has this rung's result and may still be promoted.
    Waiting(usize),
    /// Not promoted from this rung: it stops there.
    Stopped(usize),
    /// It failed on its way to this rung.
    Failed(usize),
    /// It reached the last rung.
    Complete,
}

/// Lower is better: the metric, negated when it is maximised; a failure or NaN is worst.
pub fn score(outcome: Outcome, minimize: bool) -> f64 {
    match outcome {
        Outcome::Value(v) if v.is_nan() => f64::INFINITY,
        Outcome::Value(v) if minimize => v,
        Outcome::Value(v) => -v,
        Outcome::Failed => f64::INFINITY,
    }
}

/// Every promotion the results decide under `rule`: `results[t][k]` is trial t's result at rung
/// k (rung 0 is the first budget), where known; `planned` trials will enter rung 0 in all, the
/// first `results.len()` of them so far.
pub fn decide(rule: Rule, results: &[Vec<Option<Outcome>>], planned: usize, minimize: bool) -> Decisions {
    let rungs = results.first().map_or(1, |r| r.len());
    let eta = rule.eta.max(1);
    let mut entrants: Vec<Vec<usize>> = vec![(0..results.len()).collect()];
    let mut settled = vec![results.len() == planned && results.iter().all(|r| r[0].is_some())];
    for k in 0..rungs - 1 {
        let mut promoted: Vec<usize> = Vec::new();
        // The rung's prefix with results (under the synchronous rule: the whole rung, once it is
        // settled), each trial's score and place in it.
        let mut seen: Vec<(f64, usize, usize)> = Vec::new();
        for (place, &t) in entrants[k].iter().enumerate() {
            let Some(outcome) = results[t][k] else { break };
            seen.push((score(outcome, minimize), place, t));
            let quota = match rule.synchronous {
                false => seen.len() / eta,
                true if settled[k] && seen.len() == entrants[k].len() => seen.len() / eta,
                true => 0,
            };
            while promoted.len() < quota {
                // The best not yet promoted; ties to the earlier entrant. One exists: fewer than
                // `quota` of the top `quota` are promoted.
                let best = seen
                    .iter()
                    .filter(|(_, _, t)| !promoted.contains(t))
                    .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
                    .map(|(_, _, t)| *t)
                    .expect("a trial left to promote");
                promoted.push(best);
            }
        }
        let done = settled[k] && promoted.iter().all(|&t| results[t][k + 1].is_some());
        settled.push(done);
        entrants.push(promoted);
    }
    Decisions { entrants, settled }
}

impl Decisions {
    /// Where trial `t` stands, with its `results`.
    pub fn status(&self, t: usize, results: &[Option<Outcome>]) -> Status {
        let rung = (0..self.entrants.len()).rev().find(|&k| self.entrants[k].contains(&t)).unwrap_or(0);
        match results[rung] {
            None => Status::Pending(rung),
            Some(Outcome::Failed) => Status::Failed(rung),
            Some(_) if rung + 1 == self.entrants.len() => Status::Complete,
            Some(_) if self.settled[rung] => Status::Stopped(rung),
            Some(_) => Status::Waiting(rung),
        }
    }

    /// The runs still to do, each a trial and the rung it runs to: the highest rungs first, each
    /// in the order of its entrants (ASHA's preference for promotions over new trials).
    pub fn pending(&self, results: &[Vec<Option<Outcome>>]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (k, rung) in self.entrants.iter().enumerate().rev() {
            out.extend(rung.iter().filter(|&&t| results[t][k].is_none()).map(|&t| (t, k)));
        }
        out
    }

    /// Whether every rung is settled: nothing is left to run or decide.
    pub fn finished(&self) -> bool {
        self.settled.iter().all(|s| *s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Outcome::*;

    const ASHA3: Rule = Rule { eta: 3, synchronous: false };
    const SHA3: Rule = Rule { eta: 3, synchronous: true };

    #[test]
    fn rungs_grow_by_eta_up_to_the_full_budget() {
        assert_eq!(rungs(10, 90, 3), [10, 30, 90]);
        assert_eq!(rungs(10, 100, 3), [10, 30, 90, 100]);
        assert_eq!(rungs(5, 5, 2), [5]);
    }

    /// Nine trials, η = 3, rungs at 1, 3 and 9 steps: the decisions worked by hand.
    #[test]
    fn promotions_follow_the_rung_order_not_the_finishing_order() {
        let r0 = [0.9, 0.5, 0.7, 0.2, 0.8, 0.6, 0.4, 0.3, 0.1];
        let mut results: Vec<Vec<Option<Outcome>>> = r0.iter().map(|v| vec![Some(Value(*v)), None, None]).collect();
        let d = decide(ASHA3, &results, 9, true);
        // After 3 entrants (0.9, 0.5, 0.7): the best, trial 1. After 6 (… 0.2, 0.8, 0.6): one
        // more, the best not promoted: trial 3. After 9 (… 0.4, 0.3, 0.1): trial 8.
        assert_eq!(d.entrants[1], [1, 3, 8]);
        assert!(d.entrants[2].is_empty());
        assert_eq!(d.status(0, &results[0]), Status::Stopped(0));
        assert_eq!(d.status(1, &results[1]), Status::Pending(1));
        assert_eq!(d.pending(&results), [(1, 1), (3, 1), (8, 1)]);
        // Trial 8 finished its rung 1 before trials 1 and 3: nothing is decided at rung 1 yet.
        results[8][1] = Some(Value(0.05));
        let d = decide(ASHA3, &results, 9, true);
        assert!(d.entrants[2].is_empty());
        results[1][1] = Some(Value(0.45));
        results[3][1] = Some(Value(0.15));
        let d = decide(ASHA3, &results, 9, true);
        // The rung's three in its order (0.45, 0.15, 0.05): the best of the three, trial 8.
        assert_eq!(d.entrants[2], [8]);
        assert_eq!(d.status(3, &results[3]), Status::Stopped(1));
        results[8][2] = Some(Value(0.01));
        let d = decide(ASHA3, &results, 9, true);
        assert!(d.finished());
        assert_eq!(d.status(8, &results[8]), Status::Complete);
    }

    #[test]
    fn a_rung_waits_for_its_earlier_entrants_and_settles_only_when_all_trials_are_in() {
        // Trials 0 and 1 known, 2 unknown, 3..5 known: the prefix stops at trial 2.
        let v = |x: f64| vec![Some(Value(x)), None];
        let mut results = vec![v(0.3), v(0.2), vec![None, None], v(0.1), v(0.0), v(0.5)];
        let d = decide(ASHA3, &results, 6, true);
        assert!(d.entrants[1].is_empty());
        assert_eq!(d.status(0, &results[0]), Status::Waiting(0));
        results[2] = v(0.4);
        let d = decide(ASHA3, &results, 6, true);
        // After 3 (0.3, 0.2, 0.4): trial 1. After 6 (… 0.1, 0.0, 0.5): trial 4.
        assert_eq!(d.entrants[1], [1, 4]);
        assert!(d.settled[0] && !d.settled[1]);
        // More trials to come: rung 0 is not settled, and its losers only wait.
        let d = decide(ASHA3, &results, 9, true);
        assert!(!d.settled[0]);
        assert_eq!(d.status(0, &results[0]), Status::Waiting(0));
    }

    #[test]
    fn failures_and_nan_rank_last_and_maximising_flips_the_order() {
        let results = vec![vec![Some(Failed), None], vec![Some(Value(f64::NAN)), None], vec![Some(Value(0.7)), None]];
        assert_eq!(decide(ASHA3, &results, 3, true).entrants[1], [2]);
        let results = vec![vec![Some(Value(0.2)), None], vec![Some(Value(0.9)), None], vec![Some(Value(0.5)), None]];
        assert_eq!(decide(ASHA3, &results, 3, false).entrants[1], [1]);
        assert_eq!(decide(ASHA3, &results, 3, true).entrants[1], [0]);
        // Equal scores: the earlier entrant.
        let results = vec![vec![Some(Value(0.5)), None]; 3];
        assert_eq!(decide(ASHA3, &results, 3, true).entrants[1], [0]);
    }

    /// The nine trials of the ASHA test above under the synchronous rule: nothing is promoted
    /// until all nine are in, then the best three of nine, and the best of those three.
    #[test]
    fn the_synchronous_rule_promotes_the_best_of_the_whole_rung_once_it_is_in() {
        let r0 = [0.9, 0.5, 0.7, 0.2, 0.8, 0.6, 0.4, 0.3, 0.1];
        let mut results: Vec<Vec<Option<Outcome>>> = r0.iter().map(|v| vec![Some(Value(*v)), None, None]).collect();
        // Eight of nine in (the ninth planned, or running): no promotion yet, where ASHA has two.
        let d = decide(SHA3, &results[..8], 9, true);
        assert!(d.entrants[1].is_empty());
        assert_eq!(decide(ASHA3, &results[..8], 9, true).entrants[1], [1, 3]);
        let d = decide(SHA3, &results, 9, true);
        // The best three of nine, best first: 0.1, 0.2, 0.3 (ASHA took 0.5, 0.2, 0.1).
        assert_eq!(d.entrants[1], [8, 3, 7]);
        assert_eq!(d.status(1, &results[1]), Status::Stopped(0));
        results[8][1] = Some(Value(0.05));
        results[3][1] = Some(Value(0.01));
        // Trial 7's rung-1 run has not ended: rung 1 waits for it.
        assert!(decide(SHA3, &results, 9, true).entrants[2].is_empty());
        results[7][1] = Some(Value(0.5));
        let d = decide(SHA3, &results, 9, true);
        assert_eq!(d.entrants[2], [3]);
        assert_eq!(d.pending(&results), [(3, 2)]);
        results[3][2] = Some(Value(0.0));
        assert!(decide(SHA3, &results, 9, true).finished());
    }
}
