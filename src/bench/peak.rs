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
    matmul_peak_up_to(threads, kind, budget, 2048)
}

/// [`matmul_peak`] with products of at most `largest` × `largest` (3 such matrices held at once).
pub fn matmul_peak_up_to(threads: usize, kind: Kind, budget: Duration, largest: i64) -> f64 {
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
        if s < budget.as_secs_f64() / 10.0 && n < largest {
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

/// Dense matrix-product peaks of known GPUs, in TFLOP/s: (a name it contains, bfloat16, float32
/// without TF32, libtorch's default for float32 products), from the vendor's data sheets. More
/// specific names first.
const GPUS: &[(&str, f64, f64)] = &[
    ("H100 PCIe", 756.0, 51.2),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.4, 66.9),
    ("H200", 989.4, 66.9),
    ("B200", 2250.0, 80.0),
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
];

/// The peak FLOP/s of the GPU model `name` ("NVIDIA H100 80GB HBM3") in bfloat16 (`bf16`) or
/// float32, if the table lists it.
pub fn gpu_peak(name: &str, bf16: bool) -> Option<f64> {
    GPUS.iter().find(|(n, _, _)| name.contains(n)).map(|&(_, b, f)| if bf16 { b } else { f } * 1e12)
}

/// The model of this machine's NVIDIA GPUs, as the driver names it (`/proc/driver/nvidia`), when
/// they are all the same model.
pub fn gpu_model() -> Option<String> {
    let mut models: Vec<String> = std::fs::read_dir("/proc/driver/nvidia/gpus")
        .ok()?
        .filter_map(|gpu| std::fs::read_to_string(gpu.ok()?.path().join("information")).ok())
        .filter_map(|info| info.lines().find_map(|l| l.strip_prefix("Model:").map(|m| m.trim().to_owned())))
        .collect();
    models.dedup();
    match models.as_slice() {
        [one] => Some(one.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_gpus_have_their_data_sheet_peaks() {
        assert_eq!(gpu_peak("NVIDIA H100 80GB HBM3", true), Some(989.4e12));
        assert_eq!(gpu_peak("NVIDIA H100 PCIe", false), Some(51.2e12));
        assert_eq!(gpu_peak("NVIDIA A100-SXM4-80GB", true), Some(312e12));
        assert_eq!(gpu_peak("NVIDIA L40S", true), Some(362.1e12));
        assert_eq!(gpu_peak("Tesla T4", true), None);
    }

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
