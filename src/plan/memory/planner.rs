//! A model's training state at any world size and layout the run could use, with what a rank
//! needs besides it: the searches behind `run.memory_per_rank_mb`'s advice and
//! `wrap.strategy = "auto"`'s choice, and the activation checkpointing the plan turns on.
use super::{state, Layout, Shapes, State};
use crate::config::schema::{ActivationCheckpointing, CheckpointPolicy};
use crate::limits::size;

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
                    Some(s) => crate::plan::stage_memory::distinct(s),
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
    use crate::plan::memory::tests::mlp;

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
