//! The training state one rank holds under each strategy, from the model's shapes: parameters,
//! gradients and the optimizer's state, at the rank's peak. `runner validate` prints it, and the
//! trace's memory columns measure the same three parts on every rank. `run.memory_per_rank_mb`
//! limits it with what a rank needs besides (`limits::estimate`: the whole process), and
//! `wrap.strategy = "auto"` chooses by that.
//!
//! - DDP (and "none"): the whole model, its gradients and the optimizer's state on every rank;
//!   with LoRA (`wrap.lora`), gradients and optimizer state of the adapters alone (the frozen
//!   base has neither).
//! - FSDP: 1/world_size of each (every parameter's rows padded to a multiple of the world size),
//!   plus what is gathered at once: the layer being computed (its parameters and, while they
//!   arrive, the all-gather's buffer of the same size; with ZeRO-2 every layer at the end of the
//!   forward pass), and in the backward pass one layer's whole gradients in the reduce-scatter's
//!   buffer, and the whole gradient of one parameter on its way into it. With LoRA, the frozen
//!   base is sharded and gathered but has no gradients and no state; the adapters, whole on every
//!   rank, have both.
//! - A pipeline: the heaviest stage's parameters, gradients and optimizer state (and with copies
//!   of the pipeline, the flat copy of its gradients that is averaged over them).
mod planner;

pub use planner::{checkpointing_text, Besides, Choice, Cuts, Planner, Stage};

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::config::schema::{Config, Optimizer, WrapStrategy};
use crate::limits::size;
use crate::model::Architecture;

/// Bytes of one float32 value.
const F: f64 = 4.0;

/// How a strategy lays the model out over the ranks, for the estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Whole replicas; `ddp`: under DDP over more than one rank.
    Replica,
    Fsdp {
        zero3: bool,
    },
    Pipeline,
}

impl Layout {
    /// The layout `c` asks for ("auto" is resolved before any estimate is made).
    pub fn of(c: &Config) -> Layout {
        match c.wrap.strategy {
            WrapStrategy::Fsdp => Layout::Fsdp { zero3: c.wrap.fsdp.reshard_after_forward },
            WrapStrategy::Pipeline => Layout::Pipeline,
            WrapStrategy::Ddp | WrapStrategy::None | WrapStrategy::Auto => Layout::Replica,
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Layout::Replica => "DDP",
            Layout::Fsdp { zero3: false } => "FSDP (ZeRO-2)",
            Layout::Fsdp { zero3: true } => "FSDP (ZeRO-3)",
            Layout::Pipeline => "the pipeline",
        })
    }
}

/// Bytes of training state on one rank at its peak: each part's most, and the most held at once.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer: f64,
    /// The most held at once, where the parts peak at different moments (FSDP's parameters at
    /// the end of the forward pass, its gradients in the backward pass); absent: their sum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_once: Option<f64>,
    /// A pipeline's stages (each once, in order) the state was estimated over: what a rank needs
    /// besides its state is its heaviest stage's ([`Planner::needs`]). Empty: not a pipeline.
    #[serde(skip)]
    pub stages: Vec<std::ops::Range<usize>>,
}

impl State {
    fn whole(parameters: f64, gradients: f64, optimizer: f64) -> State {
        State { parameters, gradients, optimizer, at_once: None, stages: Vec::new() }
    }

    pub fn total(&self) -> f64 {
        self.at_once.unwrap_or(self.parameters + self.gradients + self.optimizer)
    }
}

impl fmt::Display for State {
    /// "1.49 GiB (parameters 381 MiB, gradients 381 MiB, optimizer 763 MiB)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (at_once, up_to) = if self.at_once.is_some() { (" at once", "up to ") } else { ("", "") };
        write!(
            f,
            "{}{at_once} (parameters {up_to}{}, gradients {up_to}{}, optimizer {})",
            size(self.total()),
            size(self.parameters),
            size(self.gradients),
            size(self.optimizer)
        )
    }
}

/// The model's shapes as the estimate needs them: each layer's parameters (dim 0 rows, values
/// per row), and the layers each layer's forward reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Shapes {
    pub layers: Vec<Vec<(i64, i64)>>,
    pub reads: Vec<Vec<usize>>,
    /// Values of the frozen parameters (a LoRA run's base model): no gradients, no state.
    pub frozen: f64,
    /// Values of the parameters FSDP leaves whole on every rank (a LoRA run's adapters: see
    /// [`crate::model::sharded_parameters`]); `layers` holds the others.
    pub whole: f64,
}

impl Shapes {
    /// `arch`'s shapes as one rank of `tensor` holds them: its slice of each split parameter.
    pub fn of(arch: &dyn Architecture, tensor: usize) -> Shapes {
        let n = arch.layers().len();
        let layers = (0..n)
            .map(|l| {
                crate::model::sharded_parameters(arch, l..l + 1)
                    .into_iter()
                    .map(|(name, s)| {
                        let rows = s.first().copied().unwrap_or(1);
                        let values = s.iter().skip(1).product::<i64>();
                        match arch.tensor_slice(&name, 0, tensor).filter(|_| tensor > 1) {
                            Some(slice) if slice.dim == 0 => (rows / tensor as i64, values),
                            Some(_) => (rows, values / tensor as i64),
                            None => (rows, values),
                        }
                    })
                    .collect()
            })
            .collect();
        let frozen = arch
            .parameters(0..n)
            .into_iter()
            .filter(|(name, _)| arch.frozen(name))
            .map(|(_, s)| s.iter().product::<i64>() as f64)
            .sum();
        let values = |v: Vec<(String, Vec<i64>)>| v.iter().map(|(_, s)| s.iter().product::<i64>() as f64).sum::<f64>();
        let whole = values(arch.parameters(0..n)) - values(crate::model::sharded_parameters(arch, 0..n));
        Shapes { layers, reads: (0..n).map(|l| arch.reads(l)).collect(), frozen, whole }
    }

    pub(super) fn values(&self, layer: usize) -> f64 {
        self.layers[layer].iter().map(|&(r, v)| (r * v) as f64).sum()
    }

    /// Values of layer `layer`'s shard on one of `world` ranks, and of its padded whole.
    pub(super) fn shard(&self, layer: usize, world: usize) -> (f64, f64) {
        let w = world as i64;
        let shard: f64 = self.layers[layer].iter().map(|&(r, v)| ((r + w - 1) / w * v) as f64).sum();
        (shard, shard * world as f64)
    }
}

/// Optimizer state values per parameter value: SGD's momentum, Adam's two moments.
pub fn optimizer_slots(c: &Config) -> f64 {
    match c.train.optimizer {
        Optimizer::Adam | Optimizer::Adamw => 2.0,
        Optimizer::Sgd if c.train.momentum != 0.0 => 1.0,
        Optimizer::Sgd => 0.0,
    }
}

/// The training state one of `world` ranks holds under `layout`. `heaviest`: the most
/// parameters a pipeline stage holds at this world size (`None`: no pipeline can be cut).
/// `gloo`: the collectives run over gloo (CPU), whose reduce-scatter FSDP does as an all-to-all.
pub fn state(shapes: &Shapes, layout: Layout, world: usize, slots: f64, heaviest: Option<usize>, gloo: bool) -> State {
    let layers = shapes.layers.len();
    let all: f64 = (0..layers).map(|l| shapes.values(l)).sum::<f64>() + shapes.whole;
    match layout {
        Layout::Replica => State::whole(F * all, F * (all - shapes.frozen), F * slots * (all - shapes.frozen)),
        Layout::Pipeline => {
            let p = heaviest.unwrap_or(usize::MAX) as f64;
            State::whole(F * p, F * p, F * slots * p)
        }
        Layout::Fsdp { zero3 } => {
            let shards: f64 = (0..layers).map(|l| shapes.shard(l, world).0).sum();
            let padded = |l: usize| shapes.shard(l, world).1;
            // What is gathered while layer l computes: the units it reads (and, under ZeRO-2,
            // every layer before it still waiting for its backward), plus an all-gather buffer:
            // of its own units, or of the next layer's (prefetched one layer ahead, forward and
            // backward).
            let gathered_at = |l: usize| {
                let reads = &shapes.reads[l];
                let near = [l.checked_sub(1), Some(l), (l + 1 < layers).then_some(l + 1)];
                let buffer = near.into_iter().flatten().flat_map(|n| &shapes.reads[n]).map(|&u| padded(u));
                let held: f64 = if zero3 {
                    // A unit another layer reads later (a tied embedding) stays gathered.
                    let kept: f64 = (0..l)
                        .filter(|u| !reads.contains(u) && shapes.reads[l..].iter().any(|r| r.contains(u)))
                        .map(padded)
                        .sum();
                    reads.iter().map(|&u| padded(u)).sum::<f64>() + kept
                } else {
                    (0..=l).map(padded).sum()
                };
                held + buffer.fold(0.0, f64::max)
            };
            let gathered = (0..layers).map(gathered_at).fold(0.0, f64::max);
            // In the backward pass, layers in reverse, one at a time: the shards' gradients of
            // the layers after it, its reduce-scatter input (its padded whole), and either a
            // whole gradient arriving into that input or, while the reduction runs, the output
            // its rows come back in (over gloo, with the all-to-all's buffer, another padded
            // whole: see csrc/fsdp.cpp).
            let shard = |l: usize| shapes.shard(l, world).0;
            let reducing_at = |l: usize| {
                let after: f64 = (l + 1..layers).map(shard).sum();
                let arriving = shapes.layers[l].iter().map(|&(r, v)| (r * v) as f64).fold(0.0, f64::max);
                let received = if gloo && world > 1 { padded(l) } else { 0.0 };
                after + padded(l) + arriving.max(shard(l) + received)
            };
            let reduce = (0..layers).map(reducing_at).fold(shards, f64::max);
            // At once: in the forward pass, the gathered layers beside the gradients' shards; in
            // the backward pass at layer l, what is still gathered there beside its reduction.
            let moment = (0..layers).map(|l| gathered_at(l) + shards.max(reducing_at(l))).fold(0.0, f64::max);
            if shapes.frozen > 0.0 {
                // LoRA: the sharded base is frozen (no reduce-scatter, no state); the adapters,
                // whole on every rank, have their gradients and state.
                let trained = shapes.whole;
                return State::whole(F * (shards + gathered + trained), F * trained, F * slots * trained);
            }
            State {
                parameters: F * (shards + gathered),
                gradients: F * reduce,
                optimizer: F * slots * shards,
                at_once: Some(F * (shards + moment + slots * shards)),
                stages: Vec::new(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn mlp() -> Shapes {
        // Three linear layers: 10 → 64 → 64 → 4 (weights, then biases).
        Shapes {
            layers: vec![vec![(64, 10), (64, 1)], vec![(64, 64), (64, 1)], vec![(4, 64), (4, 1)]],
            reads: vec![vec![0], vec![1], vec![2]],
            frozen: 0.0,
            whole: 0.0,
        }
    }

    #[test]
    fn ddp_holds_everything_and_fsdp_a_share_plus_what_is_gathered() {
        let s = mlp();
        let all = (64 * 10 + 64 + 64 * 64 + 64 + 4 * 64 + 4) as f64;
        let ddp = state(&s, Layout::Replica, 4, 2.0, None, true);
        assert_eq!(ddp, State::whole(4.0 * all, 4.0 * all, 8.0 * all));
        assert_eq!(ddp.total(), 16.0 * all);
        // LoRA: the frozen values have no gradients and no state.
        let lora = state(&Shapes { frozen: all - 100.0, ..mlp() }, Layout::Replica, 4, 2.0, None, true);
        assert_eq!(lora, State::whole(4.0 * all, 400.0, 800.0));
        let fsdp = state(&s, Layout::Fsdp { zero3: true }, 4, 2.0, None, true);
        // No row count here is uneven over 4 ranks: the shards are exactly a quarter.
        assert_eq!(fsdp.optimizer, ddp.optimizer / 4.0);
        // The largest layer (64 × 64 + 64) gathered, with its all-gather buffer.
        assert_eq!(fsdp.parameters, 4.0 * (all / 4.0 + 2.0 * (64.0 * 64.0 + 64.0)));
        // ZeRO-2: the layers so far all gathered; the most at the last layer, every layer
        // gathered while the backward pass prefetches the largest (layer 1) into its buffer.
        let zero2 = state(&s, Layout::Fsdp { zero3: false }, 4, 2.0, None, true);
        let (l0, l1, l2): (f64, f64, f64) = (64.0 * 10.0 + 64.0, 64.0 * 64.0 + 64.0, 4.0 * 64.0 + 4.0);
        assert_eq!(zero2.parameters, 4.0 * (all / 4.0 + (l0 + l1 + l2) + l1));
    }

    #[test]
    fn lora_under_fsdp_shards_the_frozen_base_and_trains_the_whole_adapters() {
        // The MLP as a frozen base, 100 adapter values beside it, whole on every rank.
        let base = (64 * 10 + 64 + 64 * 64 + 64 + 4 * 64 + 4) as f64;
        let s = Shapes { frozen: base, whole: 100.0, ..mlp() };
        let lora = state(&s, Layout::Fsdp { zero3: true }, 4, 2.0, None, true);
        let full = state(&mlp(), Layout::Fsdp { zero3: true }, 4, 2.0, None, true);
        // The base's shards and what is gathered, as full FSDP's, and the adapters whole.
        assert_eq!(lora.parameters, full.parameters + 400.0);
        assert_eq!((lora.gradients, lora.optimizer), (400.0, 800.0));
        assert_eq!(lora.total(), full.parameters + 400.0 + 1200.0);
        // Under DDP the adapters count once, beside the whole base.
        let ddp = state(&s, Layout::Replica, 4, 2.0, None, true);
        assert_eq!(ddp, State::whole(4.0 * (base + 100.0), 400.0, 800.0));
    }

    #[test]
    fn uneven_rows_are_padded_per_parameter() {
        let s = Shapes { layers: vec![vec![(5, 3)]], reads: vec![vec![0]], frozen: 0.0, whole: 0.0 };
        // 5 rows over 4 ranks: 2 rows each, 8 padded.
        assert_eq!(s.shard(0, 4), (6.0, 24.0));
    }

    #[test]
    fn a_tied_unit_stays_gathered_until_the_layer_that_shares_it() {
        let s = Shapes {
            layers: vec![vec![(100, 8)], vec![(8, 8)], vec![(8, 1)]],
            reads: vec![vec![0], vec![1], vec![2, 0]],
            frozen: 0.0,
            whole: 0.0,
        };
        let fsdp = state(&s, Layout::Fsdp { zero3: true }, 2, 0.0, None, true);
        // At layer 1 the embedding (800 values) is still held, besides layer 1 and its buffer.
        let at_layer1 = 800.0 + 64.0 + 64.0;
        let shards = 400.0 + 32.0 + 4.0;
        assert!(fsdp.parameters >= 4.0 * (shards + at_layer1));
    }
}
