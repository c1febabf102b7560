//! The matmul peak of this CPU in one precision, from a probe bounded in time: square products
//! from 128² upwards, doubling the side while one product takes under a tenth of the budget, the
//! best rate kept. A CPU without fast bfloat16 (0.3 GFLOP/s where float32 does 100) is measured in
//! about the budget too, instead of minutes of 2048² products.
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

/// The budget of one probe: about a second.
pub const PROBE: Duration = Duration::from_millis(800);

/// Best FLOP/s of square matmuls in `kind` with `threads` intra-op threads, within about `budget`
/// (at most twice it: the last product started may take up to 8× its predecessor, under a tenth).
pub fn matmul_peak(threads: usize, kind: Kind, budget: Duration) -> f64 {
    tch::set_num_threads(threads as i32);
    let start = Instant::now();
    let (mut n, mut best) = (128i64, 0.0f64);
    let mut operands = square(n, kind);
    while start.elapsed() < budget {
        let t = Instant::now();
        let c = operands.0.matmul(&operands.1);
        let s = t.elapsed().as_secs_f64();
        drop(c);
        best = best.max(2.0 * (n as f64).powi(3) / s);
        if s < budget.as_secs_f64() / 10.0 && n < 2048 {
            n *= 2;
            operands = square(n, kind);
        }
    }
    best
}

fn square(n: i64, kind: Kind) -> (Tensor, Tensor) {
    let opts = (kind, tch::Device::Cpu);
    (Tensor::randn([n, n], opts), Tensor::randn([n, n], opts))
}

/// `train.precision = "bf16"` on this CPU: a warning with both rates when bfloat16 matmuls are
/// slower than float32 ones (a CPU without AMX or fast AVX-512 BF16 kernels), else `None`.
pub fn bf16_warning(threads: usize) -> Option<String> {
    let fp32 = matmul_peak(threads, Kind::Float, PROBE / 2);
    let bf16 = matmul_peak(threads, Kind::BFloat16, PROBE / 2);
    (bf16 < fp32).then(|| {
        format!(
            "warning: train.precision = \"bf16\" will be slower than fp32 on this CPU: its bfloat16 matmuls run at \
             {:.1} GFLOP/s against {:.1} in float32 ({threads} thread(s), measured now); use \"fp32\" here",
            bf16 / 1e9,
            fp32 / 1e9
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_keeps_to_its_budget_in_either_precision() {
        for kind in [Kind::Float, Kind::BFloat16] {
            let start = Instant::now();
            let peak = matmul_peak(1, kind, Duration::from_millis(300));
            let took = start.elapsed();
            assert!(peak > 0.0, "{kind:?}");
            // A loose bound (a shared machine stretches any timing): minutes, as before the
            // probe, would fail it; a busy machine's 2× does not.
            assert!(took < Duration::from_secs(5), "{kind:?}: {took:?} for a 300 ms budget");
        }
    }
}
