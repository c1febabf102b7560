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
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::config::schema::{ActivationCheckpointing, CheckpointPolicy, Config, Optimizer, WrapStrategy};
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

/// A pipeline stage: the layers it holds.
pub type Stage = std::ops::Range<usize>;

/// Bytes a rank needs besides its training state, at a world size under an activation
/// checkpointing, of a pipeline's stages where given: [`Planner::besides`].
pub type Besides<'a> = Box<dyn Fn(usize, ActivationCheckpointing, Option<&[Stage]>) -> f64 + 'a>;

/// Whether a model takes the given pipeline stages.
pub type Cuts<'a> = Box<dyn Fn(&[Stage]) -> bool + 'a>;

/// The most ranks the searches below try.
const MAX_SEARCH: usize = 4096;

/// A model's training state at any world size and layout the run could use.
pub struct Planner<'a> {
    pub shapes: Shapes,
    pub layer_parameters: &'a [usize],
    pub slots: f64,
    /// Whether the model takes these pipeline stages (one opaque module, or a tied head away
    /// from its embedding, takes none).
    pub cuts: Cuts<'a>,
    /// Whether FSDP can shard every parameter (none is 0-dimensional).
    pub shards: bool,
    /// The global batch every step must keep (`train.global_batch_size`, or a resumed run's):
    /// data-parallel layouts are advised only at world sizes that divide it.
    pub global_batch: Option<usize>,
    /// Copies of a pipeline (`wrap.pipeline.replicas`): with more than one, each stage's
    /// gradients are averaged over them through a flat copy.
    pub pipeline_copies: usize,
    /// The collectives run over gloo (the CPU backend).
    pub gloo: bool,
    /// Bytes the heaviest rank needs besides its training state at a world size under an
    /// activation checkpointing: activations, data, libtorch (`limits::estimate`); of a
    /// pipeline's stages (each once, in order), the heaviest stage's. A limit is on the whole:
    /// the state and this.
    pub besides: Besides<'a>,
    /// The configured `wrap.activation_checkpointing`.
    pub checkpointing: ActivationCheckpointing,
    /// The blocks the run could checkpoint, as the estimate counts them (0: none, or the model's
    /// estimate does not count what checkpointing saves).
    pub checkpointable: usize,
    /// Whether the plan may turn checkpointing on itself where a rank does not fit without: the
    /// policy was left to its default.
    pub choose_checkpointing: bool,
}

impl Planner<'_> {
    /// The state of a rank under `layout` at `world` ranks; `None` where the layout cannot run
    /// there (a pipeline needs 2 to `layers` ranks). A pipeline's stages are balanced by
    /// parameters, or `stages` where given.
    pub fn state(&self, layout: Layout, world: usize, stages: Option<&[std::ops::Range<usize>]>) -> Option<State> {
        let (heaviest, stages) = match layout {
            Layout::Fsdp { .. } if !self.shards => return None,
            Layout::Pipeline => {
                let stages = match stages {
                    Some(s) => super::stage_memory::distinct(s),
                    None if world < 2 || world > self.layer_parameters.len() => return None,
                    None => {
                        let balanced = crate::model::partition::balanced(self.layer_parameters, world)?;
                        if !(self.cuts)(&balanced) {
                            return None;
                        }
                        balanced
                    }
                };
                (stages.iter().map(|r| self.stage_values(r)).max(), stages)
            }
            _ => (None, Vec::new()),
        };
        let mut s = state(&self.shapes, layout, world, self.slots, heaviest, self.gloo);
        if layout == Layout::Pipeline && self.pipeline_copies > 1 {
            s.gradients *= 2.0;
        }
        s.stages = stages;
        Some(s)
    }

    /// Values a rank of the stage holding `layers` holds: under tensor parallelism its slices.
    fn stage_values(&self, layers: &Stage) -> usize {
        match self.shapes.whole > 0.0 {
            // A LoRA run's adapters are counted apart from the layers' shapes.
            true => self.layer_parameters[layers.clone()].iter().sum(),
            false => layers.clone().map(|l| self.shapes.values(l) as usize).sum(),
        }
    }

    /// Bytes a rank of `world` needs that holds `state`: the state and everything besides.
    pub fn needs(&self, state: &State, world: usize) -> f64 {
        self.needs_with(state, world, self.checkpointing)
    }

    /// Bytes a rank of `world` needs that holds `state`, under `checkpointing`.
    pub fn needs_with(&self, state: &State, world: usize, checkpointing: ActivationCheckpointing) -> f64 {
        let stages = (!state.stages.is_empty()).then_some(state.stages.as_slice());
        state.total() + (self.besides)(world, checkpointing, stages)
    }

    /// The activation checkpointing the plan turns on where a rank holding `state` at `world`
    /// ranks needs more than `limit` bytes without: selective on every block where that fits (it
    /// recomputes no matrix product: the least extra time, a few percent of a step), else full,
    /// on every k-th block with the largest k that fits (the fewest blocks recomputed); `None`
    /// where the plan may not choose it, or even every block recomputed does not fit. Tried
    /// before a larger world size or another strategy: full costs about a third of a forward pass
    /// per recomputed block, and neither changes a result (the recomputation is bit-identical).
    pub fn lighten(&self, state: &State, world: usize, limit: f64) -> Option<ActivationCheckpointing> {
        let full = ActivationCheckpointing { policy: CheckpointPolicy::Full, every: 1 };
        // Every block recomputed needs the least: where even that does not fit, nothing does.
        if !self.choose_checkpointing
            || self.checkpointable == 0
            || self.checkpointing.policy != CheckpointPolicy::None
            || self.needs_with(state, world, full) > limit
        {
            return None;
        }
        let selective = ActivationCheckpointing { policy: CheckpointPolicy::Selective, every: 1 };
        let fulls = (1..=self.checkpointable)
            .rev()
            .map(|every| ActivationCheckpointing { policy: CheckpointPolicy::Full, every });
        std::iter::once(selective).chain(fulls).find(|&ac| self.needs_with(state, world, ac) <= limit)
    }

    /// ", N with every block checkpointed" where the plan may checkpoint, after what a rank needs.
    pub fn checkpointed_too(&self, state: &State, world: usize) -> String {
        if self.checkpointable == 0 || self.checkpointing.policy != CheckpointPolicy::None {
            return String::new();
        }
        let full = ActivationCheckpointing { policy: CheckpointPolicy::Full, every: 1 };
        format!(" ({} with every block checkpointed)", size(self.needs_with(state, world, full)))
    }

    /// The smallest world size from `from` at which `layout` holds at most `limit` bytes a rank
    /// (and, data-parallel, keeps the global batch), with the activation checkpointing the plan
    /// turns on where it needs it ([`Planner::lighten`]): that world size, what a rank needs
    /// there, and whether it checkpoints.
    pub fn fits_from(&self, layout: Layout, limit: f64, from: usize) -> Option<(usize, f64, bool)> {
        let keeps = |w: usize| layout == Layout::Pipeline || self.global_batch.is_none_or(|g| g.is_multiple_of(w));
        (from.max(1)..=MAX_SEARCH).filter(|&w| keeps(w)).find_map(|w| {
            let s = self.state(layout, w, None)?;
            if self.needs(&s, w) <= limit {
                return Some((w, self.needs(&s, w), false));
            }
            self.lighten(&s, w, limit).map(|ac| (w, self.needs_with(&s, w, ac), true))
        })
    }

    /// What to do when `layout` at `world` ranks needs more than `limit` bytes a rank: the
    /// strategies that fit, and from which world size; `first`: a way to name before them.
    /// Whether any way was found.
    pub fn advice(&self, layout: Layout, world: usize, limit: f64, first: Option<String>) -> (String, bool) {
        let mut ways: Vec<String> = first.into_iter().collect();
        for (candidate, name, what) in
            [(Layout::Fsdp { zero3: true }, "fsdp", "a rank"), (Layout::Pipeline, "pipeline", "on its heaviest rank")]
        {
            // The strategy in use is asked only at more ranks.
            let from = if candidate == layout { world + 1 } else { world };
            let Some((w, needs, checkpointed)) = self.fits_from(candidate, limit, from) else { continue };
            let what = format!("{what}{}", if checkpointed { ", with activation checkpointing" } else { "" });
            let (s, strategy) = (size(needs), format!("wrap.strategy = \"{name}\""));
            ways.push(match (candidate == layout, w == world) {
                (true, _) => format!("{candidate} fits from run.world_size = {w} ({s} {what})"),
                (false, true) => format!("{strategy} fits at this world size ({s} {what})"),
                (false, false) => format!("{strategy} fits from run.world_size = {w} ({s} {what})"),
            });
        }
        if ways.is_empty() {
            let none = format!(
                "no strategy fits it on up to {MAX_SEARCH} ranks: use a smaller model, or a higher \
                 run.memory_per_rank_mb"
            );
            return (none, false);
        }
        (format!("{}; wrap.strategy = \"auto\" picks the first strategy that fits", ways.join(", or ")), true)
    }

    /// `wrap.strategy = "auto"` at `world` ranks with `limit` bytes a rank: the first of DDP,
    /// FSDP (ZeRO-2), FSDP (ZeRO-3) and the pipeline that fits, each tried with the activation
    /// checkpointing [`Planner::lighten`] turns on before the next (which checkpointing, if any,
    /// and why); or why none does.
    pub fn choose(&self, world: usize, limit: f64, limit_text: &str) -> Result<Choice, String> {
        let order = [Layout::Replica, Layout::Fsdp { zero3: false }, Layout::Fsdp { zero3: true }, Layout::Pipeline];
        let mut tried = Vec::new();
        for layout in order {
            let Some(s) = self.state(layout, world, None) else { continue };
            let needs = size(self.needs(&s, world));
            let before = if tried.is_empty() { String::new() } else { format!(", while {}", tried.join(", ")) };
            if self.needs(&s, world) <= limit {
                let why =
                    format!("chose {layout}: a rank needs {needs}, training state {s}, within {limit_text}{before}");
                return Ok((layout, None, why));
            }
            if let Some(ac) = self.lighten(&s, world, limit) {
                let why = format!(
                    "chose {layout} with activation checkpointing ({}): a rank needs {}, training state {s}, within \
                     {limit_text}, where keeping every activation it would need {needs}{before}",
                    checkpointing_text(ac, self.checkpointable),
                    size(self.needs_with(&s, world, ac))
                );
                return Ok((layout, Some(ac), why));
            }
            // What checkpointing would need, where the plan tried it.
            let checkpointed = if self.choose_checkpointing { self.checkpointed_too(&s, world) } else { String::new() };
            tried.push(format!("{layout} would need {needs}{checkpointed}"));
        }
        let more: Vec<String> = [Layout::Fsdp { zero3: true }, Layout::Pipeline]
            .into_iter()
            .filter_map(|layout| {
                let (w, needs, checkpointed) = self.fits_from(layout, limit, world + 1)?;
                let with = if checkpointed { ", with activation checkpointing" } else { "" };
                Some(format!("{layout} fits from run.world_size = {w} ({} a rank{with})", size(needs)))
            })
            .collect();
        let advice = match more.is_empty() {
            true => format!("none fits on up to {MAX_SEARCH} ranks: use a smaller model"),
            false => format!("{}: raise run.world_size, or use a smaller model", more.join(", ")),
        };
        Err(format!("no strategy fits {limit_text} at world size {world}: {}; {advice}", tried.join(", ")))
    }
}

/// `wrap.strategy = "auto"`'s choice: the layout, the activation checkpointing it turned on (none:
/// the configured one), and why.
pub type Choice = (Layout, Option<ActivationCheckpointing>, String);

/// "full, every block" or "full, every 3rd block: 2 of 6 recomputed", of `blocks` blocks.
pub fn checkpointing_text(ac: ActivationCheckpointing, blocks: usize) -> String {
    let recomputed = (0..blocks).filter(|&i| ac.applies(i)).count();
    let policy = format!("{:?}", ac.policy).to_lowercase();
    match ac.every {
        1 => format!("{policy}, every block"),
        k => format!("{policy}, every = {k}: {recomputed} of {blocks} blocks recomputed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mlp() -> Shapes {
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

    /// A planner of `mlp()`'s shapes (81 kB of training state under DDP) whose rank needs 100 kB
    /// besides its state, less 20 kB for each of its 4 blocks checkpointed.
    fn planner(choose_checkpointing: bool) -> Planner<'static> {
        Planner {
            shapes: mlp(),
            layer_parameters: &[],
            slots: 2.0,
            cuts: Box::new(|_| false),
            shards: true,
            global_batch: None,
            pipeline_copies: 1,
            gloo: true,
            // A block recomputed saves 2e4 bytes, or 4e3 where selective.
            besides: Box::new(|_, ac, _| {
                let saves = if ac.policy == CheckpointPolicy::Selective { 4e3 } else { 2e4 };
                1e5 - saves * (0..4).filter(|&i| ac.applies(i)).count() as f64
            }),
            checkpointing: ActivationCheckpointing::default(),
            checkpointable: 4,
            choose_checkpointing,
        }
    }

    #[test]
    fn checkpointing_is_turned_on_for_the_fewest_blocks_that_fit_before_another_strategy() {
        let p = planner(true);
        let ddp = p.state(Layout::Replica, 1, None).unwrap();
        let full = |every| Some(ActivationCheckpointing { policy: CheckpointPolicy::Full, every });
        let need = |blocks: f64| ddp.total() + 1e5 - 2e4 * blocks;
        // Every 4th block (1 recomputed), every 3rd (blocks 0 and 3), every block (4, where 3 are
        // asked: no k recomputes 3 of 4); nothing fits below.
        // Selective on every block first (it saves 1.6e4), where it fits.
        let selective = ActivationCheckpointing { policy: CheckpointPolicy::Selective, every: 1 };
        assert_eq!(p.lighten(&ddp, 1, need(0.8)), Some(selective));
        assert_eq!(p.lighten(&ddp, 1, need(1.0)), full(4));
        assert_eq!(p.lighten(&ddp, 1, need(2.0)), full(3));
        assert_eq!(p.lighten(&ddp, 1, need(3.0)), full(1));
        assert_eq!(p.lighten(&ddp, 1, need(4.0) - 1.0), None);
        // auto: DDP with checkpointing, before any other strategy is tried.
        let (layout, ac, why) = p.choose(1, need(2.0), "the limit").unwrap();
        assert_eq!((layout, ac), (Layout::Replica, full(3)));
        assert!(why.starts_with("chose DDP with activation checkpointing (full, every = 3: 2 of 4 blocks"), "{why}");
        // A policy set by hand is kept (tests/integration/fsdp.rs: auto then picks FSDP).
        assert_eq!(planner(false).lighten(&ddp, 1, need(1.0)), None);
    }
}
