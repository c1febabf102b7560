//! What one rank's GPU holds at its peak, as libtorch's caching allocator counts it
//! (torch.cuda.max_memory_allocated and max_memory_reserved): the plan's estimate for a run on
//! `run.device = "cuda"`, printed under the plan and beside the measured peaks at the end of
//! the run.
//!
//! - **allocated**: the training state (parameters, gradients, optimizer state: `plan::memory`),
//!   under bf16 autocast the bfloat16 copies of the weights that autocast casts once per forward
//!   pass and the products keep for the backward pass, and the activations as the model counts
//!   them (bf16, `scaled_dot_product_attention`'s fused kernels, the logits:
//!   `model::transformer::activations`). The host's parts (libtorch's code, the data set) are
//!   not on the device.
//! - **reserved**: what the caching allocator holds from the driver at its peak: the allocated
//!   peak times the allocator's own rounding and caching of freed blocks, [`RESERVE`], measured.
use std::fmt;

use crate::config::schema::{Device, Precision};
use crate::limits::size;

/// Reserved ÷ allocated at the one recorded point: 12.81 GiB reserved for 10.41 GiB allocated
/// (a GPT-2-small-sized transformer, bf16, batch 8 × 1024, AdamW, on an H200 with torch 2.11:
/// docs/gpus.md). The allocator rounds blocks up (to 512 bytes, and past 1 MiB into 2 MiB or
/// 20 MiB segments) and keeps freed blocks for reuse, so what it holds exceeds what tensors
/// hold; one measurement, so at other shapes a guess (the GPU check measures it again).
pub const RESERVE: f64 = 12.81 / 10.41;

/// Bytes one rank's GPU holds at its peak, by part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceMemory {
    /// Parameters, gradients and optimizer state, as the strategy holds them.
    pub state: f64,
    /// The bfloat16 copies of the weights under bf16 autocast (none in float32).
    pub casts: f64,
    pub activations: f64,
}

impl DeviceMemory {
    /// The estimate for `plan`'s run, when it runs on a GPU and its memory could be estimated.
    pub fn of(plan: &super::Plan) -> Option<DeviceMemory> {
        let c = &plan.config;
        if c.run.device != Device::Cuda {
            return None;
        }
        let (estimate, (state, _)) = (plan.memory.as_ref()?, plan.state.as_ref()?);
        // Half of each float32 parameter: autocast's cache holds one bfloat16 copy of each weight
        // it casts, from the forward pass to the backward pass of the product that reads it.
        let casts = if c.train.precision == Precision::Bf16 { state.parameters / 2.0 } else { 0.0 };
        Some(DeviceMemory { state: estimate.model, casts, activations: estimate.activations })
    }

    /// The most tensors hold at once.
    pub fn allocated(&self) -> f64 {
        self.state + self.casts + self.activations
    }

    /// The most the caching allocator holds from the driver.
    pub fn reserved(&self) -> f64 {
        self.allocated() * RESERVE
    }
}

impl fmt::Display for DeviceMemory {
    /// "10.31 GiB allocated at the peak (training state 1.85 GiB, bf16 copies of the weights 237
    /// MiB, activations 8.24 GiB), 12.69 GiB reserved by the caching allocator".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let casts =
            if self.casts > 0.0 { format!(", bf16 copies of the weights {}", size(self.casts)) } else { String::new() };
        write!(
            f,
            "{} allocated at the peak (training state {}{casts}, activations {}), {} reserved by the caching allocator",
            size(self.allocated()),
            size(self.state),
            size(self.activations),
            size(self.reserved())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_is_the_measured_share_above_allocated() {
        let m = DeviceMemory { state: 2e9, casts: 2.5e8, activations: 8e9 };
        assert_eq!(m.allocated(), 1.025e10);
        assert!((m.reserved() / m.allocated() - 1.2305).abs() < 1e-3);
        let text = m.to_string();
        assert!(
            text.contains("bf16 copies of the weights") && text.contains("reserved by the caching allocator"),
            "{text}"
        );
        let f32 = DeviceMemory { casts: 0.0, ..m }.to_string();
        assert!(!f32.contains("bf16"), "{f32}");
    }
}
