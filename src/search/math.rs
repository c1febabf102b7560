//! The few functions of a real variable the samplers need, from `libm` (pure Rust): the same bits
//! on every machine, so that a search proposes the same values everywhere (the system's `exp` and
//! `ln` may differ in the last bit between C libraries, and one bit of a learning rate is another
//! run).
use crate::rng::Rng;

pub fn exp(x: f64) -> f64 {
    libm::exp(x)
}

pub fn ln(x: f64) -> f64 {
    libm::log(x)
}

pub fn ln_1p(x: f64) -> f64 {
    libm::log1p(x)
}

pub fn sqrt(x: f64) -> f64 {
    libm::sqrt(x)
}

/// A standard normal draw (Box-Muller).
pub fn normal(rng: &mut Rng) -> f64 {
    let u1 = 1.0 - rng.uniform();
    let u2 = rng.uniform();
    sqrt(-2.0 * ln(u1)) * libm::cos(std::f64::consts::TAU * u2)
}

/// The standard normal distribution function Φ(x).
pub fn ndtr(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// ln Φ(x), accurate far into the left tail.
pub fn log_ndtr(x: f64) -> f64 {
    if x > -30.0 {
        return ln(ndtr(x));
    }
    // Φ(x) ≈ φ(x) / −x × (1 − 1/x² + 3/x⁴) for x → −∞.
    let x2 = x * x;
    -0.5 * x2 - ln(-x) - 0.5 * ln(std::f64::consts::TAU) + ln_1p(-1.0 / x2 + 3.0 / (x2 * x2))
}

/// ln(Φ(b) − Φ(a)) for a < b: the log of a standard normal's mass in [a, b], computed in the tail
/// where it is small (Optuna's `_log_gauss_mass`).
pub fn log_gauss_mass(a: f64, b: f64) -> f64 {
    // ln(e^p − e^q) for p > q.
    let log_diff = |p: f64, q: f64| if q == f64::NEG_INFINITY { p } else { p + ln_1p(-exp(q - p)) };
    if b <= 0.0 {
        log_diff(log_ndtr(b), log_ndtr(a))
    } else if a > 0.0 {
        log_diff(log_ndtr(-a), log_ndtr(-b))
    } else {
        ln_1p(-ndtr(a) - ndtr(-b))
    }
}

/// ln Σ e^xᵢ, without overflow; −∞ for an empty or all −∞ list.
pub fn log_sum_exp(xs: &[f64]) -> f64 {
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return max;
    }
    max + ln(xs.iter().map(|x| exp(x - max)).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_normal_mass_matches_known_values_and_stays_finite_in_the_tails() {
        // Φ(1) − Φ(−1) = 0.6826894921370859.
        assert!((exp(log_gauss_mass(-1.0, 1.0)) - 0.682_689_492_137_085_9).abs() < 1e-14);
        // Φ(−1) − Φ(−2) = 0.13590512198327787, the same on the right.
        assert!((exp(log_gauss_mass(-2.0, -1.0)) - 0.135_905_121_983_277_87).abs() < 1e-14);
        assert!((exp(log_gauss_mass(1.0, 2.0)) - 0.135_905_121_983_277_87).abs() < 1e-14);
        // Far in a tail the mass underflows as a number, not as a logarithm: ln Φ(−40) ≈ −804.6.
        let far = log_gauss_mass(-41.0, -40.0);
        assert!(far.is_finite() && (far + 804.608).abs() < 0.01, "{far}");
        assert!((log_ndtr(-29.999) - log_ndtr(-30.001)).abs() < 0.1);
        assert_eq!(log_sum_exp(&[f64::NEG_INFINITY]), f64::NEG_INFINITY);
        assert!((log_sum_exp(&[ln(2.0), ln(3.0)]) - ln(5.0)).abs() < 1e-15);
    }
}
