//! Model FLOPs utilisation (MFU) of a transformer: the FLOPs its training computes per second on
//! a rank, counted from the architecture (per token about 6 × its parameters, the embeddings
//! aside, plus the attention's 12 × layers × seq_len × heads × head_dim: 3 × `forward_flops`),
//! over the peak rate of the rank's device: `run.peak_tflops`, or measured on the CPU when the
//! rank starts, or the GPU's from a table. Like every rate, it is a timing: not part of what a
//! rerun reproduces.
use crate::config::schema::{Model, Precision};
use crate::plan::Plan;

/// What turns a rank's samples per second into its MFU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mfu {
    /// Training FLOPs one rank computes per sample: its share of the model's 3 × forward pass
    /// (a pipeline's stages share each sample's).
    per_sample: f64,
    /// The rank's peak, FLOP/s.
    peak: f64,
}

impl Mfu {
    /// A transformer's MFU on a rank computing on `device`; `None` for other models, and on a GPU
    /// without `run.peak_tflops` that the table does not list.
    pub fn of(plan: &Plan, device: tch::Device) -> Option<Mfu> {
        if !matches!(plan.config.wrap.model, Model::Transformer(_)) {
            return None;
        }
        let per_sample = 3.0 * plan.model().forward_flops()? / plan.pipeline_ranks() as f64;
        let bf16 = plan.config.train.precision == Precision::Bf16;
        let peak = match (plan.config.run.peak_tflops, device) {
            (Some(tflops), _) => tflops * 1e12,
            (None, tch::Device::Cpu) => {
                let kind = if bf16 { tch::Kind::BFloat16 } else { tch::Kind::Float };
                // Products of at most 512²: 3 MB held (and MKL's packing buffers for that size),
                // not the 12 MB of 1024² that a small model's rank showed in its peak memory,
                // beyond the plan's estimate; single-precision GEMM is near its peak at 512².
                let peak = crate::bench::peak::matmul_peak_up_to(plan.threads_per_rank, kind, PROBE, 512);
                // The probe leaves the rank's own thread count as it found it.
                tch::set_num_threads(plan.threads_per_replica() as i32);
                peak
            }
            (None, _) => crate::bench::peak::gpu_peak(&crate::bench::peak::gpu_model()?, bf16)?,
        };
        Some(Mfu { per_sample, peak })
    }

    /// The MFU at `samples_per_s` samples per second on the rank, a fraction.
    pub fn at(&self, samples_per_s: f64) -> f64 {
        samples_per_s * self.per_sample / self.peak
    }
}

/// The CPU probe's budget.
const PROBE: std::time::Duration = std::time::Duration::from_millis(250);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mfu_is_the_model_s_flops_over_the_peak() {
        let m = Mfu { per_sample: 3.0e9, peak: 100.0e9 };
        assert_eq!(m.at(10.0), 0.3);
    }
}
