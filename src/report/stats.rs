//! The table's arithmetic, as pure functions: mean and sample standard deviation across seeds,
//! speedup and scaling efficiency against the smallest world size.

/// Bytes in a MiB, the unit of the tables' and plots' memory.
pub const MIB: f64 = (1u64 << 20) as f64;

/// The mean and the sample standard deviation (n − 1) of a set of values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub mean: f64,
    /// `None` for fewer than two values: one seed says nothing about the spread.
    pub std: Option<f64>,
    pub n: usize,
}

impl Spread {
    /// `None` for no values.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let n = values.len();
        if n == 0 {
            return None;
        }
        let mean = mean(values);
        Some(Spread { mean, std: sample_std(values), n })
    }

    /// The same values multiplied by `factor` (a change of unit).
    pub fn scaled(&self, factor: f64) -> Spread {
        Spread { mean: self.mean * factor, std: self.std.map(|s| s * factor.abs()), n: self.n }
    }

    /// `0.3512 ± 0.0040` with `digits` decimals (the mean alone for one value).
    pub fn display(&self, digits: usize) -> String {
        match self.std {
            Some(s) => format!("{:.digits$} ± {s:.digits$}", self.mean),
            None => format!("{:.digits$}", self.mean),
        }
    }
}

pub fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// Bessel-corrected standard deviation; `None` for fewer than two values.
pub fn sample_std(values: &[f64]) -> Option<f64> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    let m = mean(values);
    let ss: f64 = values.iter().map(|v| (v - m) * (v - m)).sum();
    Some((ss / (n - 1) as f64).sqrt())
}

/// How many times the throughput of the baseline (the smallest world size).
pub fn speedup(throughput: f64, baseline_throughput: f64) -> f64 {
    throughput / baseline_throughput
}

/// Speedup divided by the ideal one (world size ÷ baseline world size): 1 is perfect scaling.
pub fn efficiency(speedup: f64, world_size: usize, baseline_world_size: usize) -> f64 {
    speedup * baseline_world_size as f64 / world_size as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn mean_and_sample_std_match_hand_computed_values() {
        // 2, 4, 4, 4, 5, 5, 7, 9: mean 5, squared deviations sum to 32, 32 / 7 = 4.571428...
        let v = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0];
        let s = Spread::of(&v).unwrap();
        assert!(close(s.mean, 5.0));
        assert!(close(s.std.unwrap(), (32.0f64 / 7.0).sqrt()));
        assert_eq!(s.n, 8);
        // Three seeds' losses: mean 0.35, deviations −0.01, 0, +0.01 → std = sqrt(0.0002 / 2) = 0.01.
        let s = Spread::of(&[0.34, 0.35, 0.36]).unwrap();
        assert!(close(s.mean, 0.35));
        assert!((s.std.unwrap() - 0.01).abs() < 1e-12);
        assert_eq!(s.display(4), "0.3500 ± 0.0100");
        // In another unit: the mean and the spread scale alike.
        let kib = Spread::of(&[2048.0, 4096.0]).unwrap().scaled(1.0 / 1024.0);
        assert_eq!((kib.mean, kib.n), (3.0, 2));
        assert!(close(kib.std.unwrap(), 2f64.sqrt()));
    }

    #[test]
    fn one_value_has_no_spread_and_none_has_no_mean() {
        let s = Spread::of(&[0.5]).unwrap();
        assert_eq!((s.mean, s.std), (0.5, None));
        assert_eq!(s.display(3), "0.500");
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(sample_std(&[1.0]), None);
    }

    #[test]
    fn speedup_and_efficiency_against_the_smallest_world_size() {
        // 1000 samples/s on 1 rank, 1800 on 2, 2400 on 4.
        assert!(close(speedup(1800.0, 1000.0), 1.8));
        assert!(close(efficiency(1.8, 2, 1), 0.9));
        assert!(close(speedup(2400.0, 1000.0), 2.4));
        assert!(close(efficiency(2.4, 4, 1), 0.6));
        // Against a baseline of 2 ranks: 4 ranks at 1.5× are 75% efficient.
        assert!(close(efficiency(1.5, 4, 2), 0.75));
        // The baseline against itself.
        assert!(close(speedup(1000.0, 1000.0), 1.0));
        assert!(close(efficiency(1.0, 1, 1), 1.0));
    }
}
