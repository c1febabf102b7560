//! The Tree-structured Parzen Estimator (Bergstra et al., "Algorithms for Hyper-Parameter
//! Optimization", NeurIPS 2011) with Optuna's defaults (`TPESampler()` of Optuna 5: univariate,
//! 24 candidates, γ(n) = min(⌈0.1 n⌉, 25), the prior as one more kernel of weight 1, the "magic
//! clip" of the bandwidths, older observations weighted down past 25). The observations are
//! split into the best γ(n) ("below") and the rest ("above"); each key gets a Parzen estimator of
//! each group, l(x) and g(x): a truncated normal (a log-normal on a log scale; integers as the
//! mass of their cell) around every observation, or for a choice a categorical kernel. The key's
//! value is the one of 24 draws from l that maximises l(x) / g(x).
//!
//! Written here rather than taken from the `tpe` crate: the side-by-side benchmark compares the
//! runner with Optuna's TPE, so its defaults are Optuna's exactly (the crate's bandwidths and
//! weights are hyperopt's); its draws come from the runner's own generator and `libm`, so a
//! proposal is the same bits on every machine; and it needs nothing the runner does not build.
use super::math;
use super::space::{Distribution, Space};
use crate::rng::Rng;

/// Optuna's `n_ei_candidates`.
pub const CANDIDATES: usize = 24;
/// Optuna's `n_startup_trials`.
pub const STARTUP: usize = 10;

/// The sampler's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tpe {
    /// Trials with a result needed before the model proposes (random before).
    pub startup: usize,
}

/// A finished trial as the sampler sees it: its point, the rung it reached (0 without a
/// scheduler) and its score there (lower is better).
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub point: Vec<f64>,
    pub rung: usize,
    pub score: f64,
}

/// Optuna's `default_gamma`: how many observations count as good.
fn gamma(n: usize) -> usize {
    n.div_ceil(10).min(25)
}

/// Optuna's `default_weights`: the 25 newest observations weigh 1, older ones less and less.
fn weights(n: usize) -> Vec<f64> {
    if n < 25 {
        return vec![1.0; n];
    }
    let ramp = n - 25;
    let mut w: Vec<f64> = (0..ramp)
        .map(|i| {
            if ramp == 1 {
                1.0 / n as f64
            } else {
                1.0 / n as f64 + (1.0 - 1.0 / n as f64) * i as f64 / (ramp - 1) as f64
            }
        })
        .collect();
    w.extend(std::iter::repeat_n(1.0, 25));
    w
}

impl Tpe {
    /// The next point from `history` (finished trials, oldest first), or `None` while fewer than
    /// `startup` trials have finished.
    pub fn propose(&self, space: &Space, history: &[Observation], rng: &mut Rng) -> Option<Vec<f64>> {
        if history.len() < self.startup.max(1) {
            return None;
        }
        let order = ranked(history);
        let n_below = gamma(history.len());
        let (mut below, mut above) = (order[..n_below].to_vec(), order[n_below..].to_vec());
        // Each group in trial order: the weights favour the newest.
        below.sort_unstable();
        above.sort_unstable();
        let column = |group: &[usize], i: usize| group.iter().map(|&t| history[t].point[i]).collect::<Vec<f64>>();
        let point = space
            .0
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let l = Parzen::new(&p.dist, &column(&below, i));
                let g = Parzen::new(&p.dist, &column(&above, i));
                let mut best = (f64::NEG_INFINITY, f64::NAN);
                for _ in 0..CANDIDATES {
                    let x = l.sample(rng);
                    let score = l.log_pdf(x) - g.log_pdf(x);
                    // The first of equal scores, as numpy's argmax.
                    if score > best.0 || best.1.is_nan() {
                        best = (score, x);
                    }
                }
                best.1
            })
            .collect();
        Some(point)
    }
}

/// The observations best first: the highest rung first, then the best score there (Optuna ranks
/// its pruned trials by the step they reached); ties go to the older trial (a stable sort).
fn ranked(history: &[Observation]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..history.len()).collect();
    order.sort_by(|a, b| {
        let (a, b) = (&history[*a], &history[*b]);
        b.rung.cmp(&a.rung).then(a.score.total_cmp(&b.score))
    });
    order
}

/// One key's Parzen estimator: a weighted mixture of kernels, the prior last.
#[derive(Debug)]
struct Parzen {
    weights: Vec<f64>,
    kernels: Kernels,
}

#[derive(Debug)]
enum Kernels {
    /// Normals truncated to [low, high], in log space for a log scale; `step` 1 for integers
    /// (each integer the mass of its cell of width 1).
    Numeric { mus: Vec<f64>, sigmas: Vec<f64>, low: f64, high: f64, log: bool, step: Option<f64>, bounds: (f64, f64) },
    /// Each kernel's probabilities over the choices.
    Categorical(Vec<Vec<f64>>),
}

impl Parzen {
    fn new(dist: &Distribution, observed: &[f64]) -> Parzen {
        let n = observed.len();
        let mut weights = weights(n);
        weights.push(1.0);
        let total: f64 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= total);
        if let Distribution::Choice(values) = dist {
            let k = values.len();
            if n == 0 {
                return Parzen { weights: vec![1.0], kernels: Kernels::Categorical(vec![vec![1.0 / k as f64; k]]) };
            }
            // Each observation's kernel: the prior weight spread over the choices, plus 1 on its own.
            let spread = 1.0 / (n + 1) as f64;
            let mut rows: Vec<Vec<f64>> = (0..=n).map(|_| vec![spread; k]).collect();
            for (row, x) in rows.iter_mut().zip(observed) {
                row[*x as usize] += 1.0;
            }
            for row in &mut rows {
                let sum: f64 = row.iter().sum();
                row.iter_mut().for_each(|p| *p /= sum);
            }
            return Parzen { weights, kernels: Kernels::Categorical(rows) };
        }
        let (lo, hi) = dist.bounds();
        let step = dist.size().map(|_| 1.0);
        let log = dist.is_log();
        let adapt = |x: f64| if log { math::ln(x) } else { x };
        let (low, high) = match step {
            Some(s) => (adapt(lo - s / 2.0), adapt(hi + s / 2.0)),
            None => (adapt(lo), adapt(hi)),
        };
        let mut mus: Vec<f64> = observed.iter().map(|x| adapt(*x)).collect();
        let mut sigmas = bandwidths(&mus, low, high);
        mus.push(0.5 * (low + high));
        sigmas.push(high - low);
        let kernels = Kernels::Numeric { mus, sigmas, low, high, log, step, bounds: (lo, hi) };
        if n == 0 {
            return Parzen { weights: vec![1.0], kernels };
        }
        Parzen { weights, kernels }
    }

    /// A draw: a kernel by weight, then a value from it.
    fn sample(&self, rng: &mut Rng) -> f64 {
        let k = pick(&self.weights, rng.uniform());
        match &self.kernels {
            Kernels::Categorical(rows) => pick(&rows[k], rng.uniform()) as f64,
            Kernels::Numeric { mus, sigmas, low, high, log, step, bounds } => {
                let (mu, sigma) = (mus[k], sigmas[k]);
                // The kernel's centre lies in [low, high], so at least a third of its draws do.
                let mut x = mu + sigma * math::normal(rng);
                while !(*low..=*high).contains(&x) {
                    x = mu + sigma * math::normal(rng);
                }
                if *log {
                    x = math::exp(x);
                }
                match step {
                    Some(s) => (bounds.0 + ((x - bounds.0) / s).round() * s).clamp(bounds.0, bounds.1),
                    None => x.clamp(bounds.0, bounds.1),
                }
            }
        }
    }

    /// ln of the mixture's density (a choice's or an integer's probability) at `x`.
    fn log_pdf(&self, x: f64) -> f64 {
        let per_kernel: Vec<f64> = match &self.kernels {
            Kernels::Categorical(rows) => {
                rows.iter().zip(&self.weights).map(|(row, w)| math::ln(*w) + math::ln(row[x as usize])).collect()
            }
            Kernels::Numeric { mus, sigmas, low, high, log, step, .. } => {
                let adapt = |v: f64| if *log { math::ln(v) } else { v };
                mus.iter()
                    .zip(sigmas)
                    .zip(&self.weights)
                    .map(|((mu, sigma), w)| {
                        let z = |v: f64| (v - mu) / sigma;
                        let norm = math::log_gauss_mass(z(*low), z(*high));
                        let density = match step {
                            Some(s) => math::log_gauss_mass(z(adapt(x - s / 2.0)), z(adapt(x + s / 2.0))),
                            None => {
                                let t = z(adapt(x));
                                -0.5 * t * t - math::ln(sigma * math::sqrt(std::f64::consts::TAU))
                            }
                        };
                        math::ln(*w) + density - norm
                    })
                    .collect()
            }
        };
        math::log_sum_exp(&per_kernel)
    }
}

/// Optuna's bandwidths: each observation's larger distance to its neighbours (the bounds at the
/// ends, except that the outermost take their inner neighbour's), clipped to
/// [(high − low) / min(100, n + 2), high − low].
fn bandwidths(mus: &[f64], low: f64, high: f64) -> Vec<f64> {
    let n = mus.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|a, b| mus[*a].total_cmp(&mus[*b]));
    let mut sorted = vec![low];
    sorted.extend(order.iter().map(|&i| mus[i]));
    sorted.push(high);
    let mut sigmas_sorted: Vec<f64> =
        (1..=n).map(|i| (sorted[i] - sorted[i - 1]).max(sorted[i + 1] - sorted[i])).collect();
    if sorted.len() >= 4 {
        sigmas_sorted[0] = sorted[2] - sorted[1];
        sigmas_sorted[n - 1] = sorted[n] - sorted[n - 1];
    }
    let (min, max) = ((high - low) / 100f64.min(n as f64 + 2.0), high - low);
    let mut sigmas = vec![0.0; n];
    for (rank, &i) in order.iter().enumerate() {
        sigmas[i] = sigmas_sorted[rank].clamp(min, max);
    }
    sigmas
}

/// The index where `u` ∈ [0, 1) falls in the cumulative `weights` (the last one on rounding).
fn pick(weights: &[f64], u: f64) -> usize {
    let mut sum = 0.0;
    for (i, w) in weights.iter().enumerate() {
        sum += w;
        if u < sum {
            return i;
        }
    }
    weights.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::space::Param;

    #[test]
    fn a_trial_that_reached_a_higher_rung_ranks_above_better_scores_at_lower_rungs() {
        let o = |rung, score| Observation { point: vec![0.0], rung, score };
        let history = [o(0, 0.1), o(1, 0.9), o(2, 0.5), o(1, 0.3), o(0, 0.1)];
        assert_eq!(ranked(&history), [2, 3, 1, 0, 4]);
    }

    #[test]
    fn optunas_gamma_weights_and_bandwidths() {
        assert_eq!((gamma(1), gamma(10), gamma(11), gamma(400)), (1, 1, 2, 25));
        assert_eq!(weights(3), [1.0; 3]);
        let w = weights(27);
        // numpy.linspace(1/27, 1, 2) then 25 ones.
        assert_eq!(w[..3], [1.0 / 27.0, 1.0, 1.0]);
        assert_eq!(w.len(), 27);
        // Three observations in [0, 10]: 2, 3, 7. Sorted with the bounds: 0 2 3 7 10; the inner
        // one takes max(3 - 2, 7 - 3) = 4; the outer ones their inner neighbour's gap: 1 and 4.
        // Clipped below at 10 / min(100, 5) = 2.
        assert_eq!(bandwidths(&[7.0, 2.0, 3.0], 0.0, 10.0), [4.0, 2.0, 4.0]);
        // One observation: the larger gap to a bound.
        assert_eq!(bandwidths(&[2.0], 0.0, 10.0), [8.0]);
    }

    #[test]
    fn densities_integrate_to_one() {
        let uniform = Distribution::Uniform { low: 0.0, high: 2.0 };
        let p = Parzen::new(&uniform, &[0.3, 0.5, 1.9]);
        let n = 20000;
        let integral: f64 =
            (0..n).map(|i| math::exp(p.log_pdf((i as f64 + 0.5) * 2.0 / n as f64)) * 2.0 / n as f64).sum();
        assert!((integral - 1.0).abs() < 1e-6, "{integral}");
        let ints = Distribution::LogInt { low: 1, high: 64 };
        let p = Parzen::new(&ints, &[2.0, 2.0, 40.0]);
        let total: f64 = (1..=64).map(|x| math::exp(p.log_pdf(x as f64))).sum();
        assert!((total - 1.0).abs() < 1e-9, "{total}");
        let choice = Distribution::Choice(vec![1.into(), 2.into(), 3.into()]);
        let p = Parzen::new(&choice, &[0.0, 0.0, 2.0]);
        let total: f64 = (0..3).map(|x| math::exp(p.log_pdf(x as f64))).sum();
        assert!((total - 1.0).abs() < 1e-12, "{total}");
    }

    #[test]
    fn the_same_history_and_generator_give_the_same_point_and_the_model_moves_to_the_good_region() {
        let space = Space(vec![Param { key: "x".into(), dist: Distribution::Uniform { low: 0.0, high: 1.0 } }]);
        // Good results near 0.8, bad ones elsewhere.
        let history: Vec<Observation> = (0..20)
            .map(|i| {
                let x = i as f64 / 19.0;
                Observation { point: vec![x], rung: 0, score: (x - 0.8).abs() }
            })
            .collect();
        let tpe = Tpe { startup: 10 };
        let a = tpe.propose(&space, &history, &mut Rng::new(1, 2)).unwrap();
        let b = tpe.propose(&space, &history, &mut Rng::new(1, 2)).unwrap();
        assert_eq!(a[0].to_bits(), b[0].to_bits());
        let near = (0..50).filter(|s| {
            let x = tpe.propose(&space, &history, &mut Rng::new(*s, 0)).unwrap()[0];
            (x - 0.8).abs() < 0.15
        });
        assert!(near.count() >= 40, "TPE proposes near the good observations");
        assert_eq!(tpe.propose(&space, &history[..9], &mut Rng::new(1, 2)), None, "random before the startup");
    }
}
