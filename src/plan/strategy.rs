//! The strategy against memory, on the plan: what one rank needs, `run.memory_per_rank_mb`,
//! `wrap.strategy = "auto"`'s choice, and the keys only one strategy reads.
use std::ops::Range;

use crate::config::schema::*;
use crate::data::shard::ShardLayout;
use crate::data::DataSpec;
use crate::model::Architecture;

use super::memory;

/// A pipeline's stages (each once, in order) and the one a rank holds.
pub(super) type Stage<'a> = (&'a [Range<usize>], usize);

/// What one rank needs in memory, `state` bytes of training state among it (`stage`: the
/// pipeline stage it holds), checked against what this machine has (unless the run is planned
/// for another machine).
pub(super) fn memory_estimate(
    c: &Config,
    d: &DataSpec,
    layout: &ShardLayout,
    arch: &dyn Architecture,
    (state, stage): (f64, Option<Stage>),
    machine: super::Machine,
    bad: &mut impl FnMut(&str, String),
) -> crate::limits::Estimate {
    let estimate = estimate(c, d, layout, arch, state, stage);
    if machine == super::Machine::Another {
        return estimate;
    }
    let model_key = match c.wrap.model {
        Model::Transformer(_) => "wrap.model.d_model",
        _ => "wrap.model.hidden",
    };
    // This machine's memory holds the host's part only: on a GPU, not the state or activations.
    crate::limits::check_memory(&estimate.on_host(c.run.device), c.run.world_size, model_key, bad);
    estimate
}

/// Bytes the heaviest rank of `world` needs besides its training state under `checkpointing`:
/// activations, data, libtorch; of a pipeline's `stages` (each once, in order), the heaviest
/// stage's.
pub(super) fn besides_state(
    c: &Config,
    d: &DataSpec,
    layout: &ShardLayout,
    arch: &dyn Architecture,
    world: usize,
    checkpointing: ActivationCheckpointing,
    stages: Option<&[Range<usize>]>,
) -> f64 {
    let mut c = c.clone();
    c.run.world_size = world;
    c.wrap.activation_checkpointing = checkpointing;
    match stages {
        Some(stages) => (0..stages.len())
            .map(|s| estimate(&c, d, layout, arch, 0.0, Some((stages, s))).per_rank())
            .fold(0.0, f64::max),
        None => estimate(&c, d, layout, arch, 0.0, None).per_rank(),
    }
}

/// The blocks the plan may checkpoint by itself: a transformer's (the plan refuses checkpointing
/// with LoRA and thread replicas); 0 otherwise (an MLP's estimate does not count what
/// checkpointing saves), and on a resume that keeps the run's own policy (`own`: the source of
/// its config.toml), which a resume may not change.
pub(super) fn checkpointable(
    c: &Config,
    sources: &std::collections::BTreeMap<String, String>,
    own: Option<&str>,
) -> usize {
    let able = c.wrap.lora.is_none() && c.wrap.threads_per_replica.is_none();
    let kept = own.is_some_and(|o| {
        sources.get("wrap.activation_checkpointing.policy").is_some_and(|s| s.starts_with(&format!("{o}:")))
    });
    match &c.wrap.model {
        Model::Transformer(t) if able && !kept => t.layers,
        _ => 0,
    }
}

/// Whether the plan may turn activation checkpointing on itself: its keys were left to their
/// defaults.
pub(super) fn choose_checkpointing(sources: &std::collections::BTreeMap<String, String>) -> bool {
    let set = |key: &str| sources.get(key).is_some_and(|s| s != "default");
    !set("wrap.activation_checkpointing.policy") && !set("wrap.activation_checkpointing.every")
}

fn estimate(
    c: &Config,
    d: &DataSpec,
    layout: &ShardLayout,
    arch: &dyn Architecture,
    state: f64,
    stage: Option<Stage>,
) -> crate::limits::Estimate {
    let batch = layout.split_batch.unwrap_or(c.train.batch_size);
    let layers = arch.layers();
    let outputs = layers.iter().map(|l| l.output.iter().product::<usize>()).sum::<usize>();
    let held = layers.iter().map(|l| l.held).sum::<usize>();
    let estimate = crate::limits::estimate(c, d, state, d.input_size() + outputs, held, batch);
    let how = crate::model::Activations {
        checkpointing: c.wrap.activation_checkpointing,
        bf16: c.train.precision == Precision::Bf16,
        tensor: crate::plan::mesh::Shape::of(c).tensor,
        sequence: c.wrap.mesh.sequence_parallel,
    };
    let whole = match arch.activation_bytes(batch, d.validation_rows, &how) {
        Some(activations) => crate::limits::Estimate { activations, ..estimate },
        None => estimate,
    };
    let Some((stages, s)) = stage else { return whole };
    // A stage keeps its layers' share of the micro-batches in flight in training, and its share
    // of the validation forward pass; beside them, what crosses its boundaries.
    let (range, flight) = (&stages[s], super::stage_memory::in_flight(c, s, stages.len()));
    let share = super::stage_memory::share(arch, range);
    let activations = match (arch.activation_bytes(batch, 0, &how), arch.activation_bytes(0, d.validation_rows, &how)) {
        (Some(train), Some(forward)) => share * (flight * train).max(forward),
        _ => share * flight * whole.activations,
    };
    let boundary = super::stage_memory::boundary(arch, range, batch, c.wrap.pipeline.micro_batches, flight);
    crate::limits::Estimate { activations: activations + boundary, ..whole }
}

/// Under the memory estimate, with `wrap.activation_checkpointing`: the policy, the blocks it
/// recomputes and what it saves against keeping every activation.
pub(super) fn checkpointing_note(plan: &super::Plan) -> Option<String> {
    let (c, ac) = (&plan.config, plan.config.wrap.activation_checkpointing);
    if ac.policy == CheckpointPolicy::None {
        return None;
    }
    let arch = plan.model();
    // An MLP's hidden layers are its blocks; a transformer's blocks are its layers but the first and last.
    let blocks = match &c.wrap.model {
        Model::Mlp(m) => m.hidden.len(),
        _ => arch.layers().len().saturating_sub(2),
    };
    let recomputed = (0..blocks).filter(|&i| ac.applies(i)).count();
    let which = if ac.every == 1 { "every block".to_string() } else { format!("one block in {}", ac.every) };
    let how_kept = match ac.policy {
        CheckpointPolicy::Selective => {
            "keeping its products' and attention's outputs, the element-wise ops between them recomputed in the \
             backward pass"
        }
        _ => "recomputed in the backward pass, each keeping only its input",
    };
    let mut note = format!(
        "  activation checkpointing: {}, {which} ({recomputed} of {blocks} {how_kept})",
        format!("{:?}", ac.policy).to_lowercase()
    );
    let batch = plan.layout.split_batch.unwrap_or(c.train.batch_size);
    let bf16 = c.train.precision == Precision::Bf16;
    let (tensor, sequence) = (crate::plan::mesh::Shape::of(c).tensor, c.wrap.mesh.sequence_parallel);
    let how = |checkpointing| crate::model::Activations { checkpointing, bf16, tensor, sequence };
    let val = plan.data.validation_rows;
    match (arch.activation_bytes(batch, val, &how(ac)), arch.activation_bytes(batch, val, &how(Default::default()))) {
        (Some(with), Some(without)) => {
            note += &format!(
                ": activations {}, where keeping them all takes {} (saves {}, {:.0}%)",
                crate::limits::size(with),
                crate::limits::size(without),
                crate::limits::size(without - with),
                100.0 * (without - with) / without.max(1.0)
            )
        }
        _ => note += ": the estimate does not count its saving for this model kind",
    }
    note += "\n";
    if let Some(why) = &plan.checkpointing_chosen {
        note += &format!("  {why}\n");
    }
    Some(note)
}

/// Keys only one strategy reads, set under another (the pipeline's are checked with its stages):
/// refused wherever they were set, to their default value too. `own`: on resume, the source of
/// the run's own `config.toml` (`file DIR/config.toml`), whose values for the strategy the run
/// had stay when a resume changes it.
pub(super) fn strategy_keys(
    c: &Config,
    sources: &std::collections::BTreeMap<String, String>,
    own: Option<&str>,
    bad: &mut impl FnMut(&str, String),
) {
    let set = |key: &str| {
        sources.get(key).is_some_and(|s| s != "default" && !own.is_some_and(|o| s.starts_with(&format!("{o}:"))))
    };
    let (fsdp, ddp) = (set("wrap.fsdp.reshard_after_forward"), set("wrap.bucket_cap_mb"));
    match c.wrap.strategy {
        WrapStrategy::Auto if fsdp => bad(
            "wrap.fsdp.reshard_after_forward",
            "is chosen by wrap.strategy = \"auto\" itself (ZeRO-2 where it fits, else ZeRO-3); remove it, or set \
             wrap.strategy = \"fsdp\""
                .into(),
        ),
        WrapStrategy::Ddp | WrapStrategy::None | WrapStrategy::Pipeline if fsdp => {
            bad("wrap.fsdp.reshard_after_forward", "is only read by wrap.strategy = \"fsdp\"; remove it".into())
        }
        WrapStrategy::Fsdp if ddp => bad(
            "wrap.bucket_cap_mb",
            "is only read by wrap.strategy = \"ddp\": FSDP reduce-scatters each layer's gradients as one bucket; \
             remove it"
                .into(),
        ),
        _ => {}
    }
}

/// `run.memory_per_rank_mb` against what the heaviest rank needs under the configured strategy:
/// its training state and everything besides. Where it does not fit, the activation
/// checkpointing that makes it fit ([`memory::Planner::lighten`]) and why, or a refusal that
/// names the strategies and world sizes that fit, and the mesh shapes of this world size that do
/// (`meshes`, of the limit in bytes).
// `!(x > 0.0)` is meant: it also rejects NaN, which `x <= 0.0` would let through.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub(super) fn check_memory_limit(
    c: &Config,
    planner: &memory::Planner,
    meshes: &dyn Fn(f64, bool) -> Option<String>,
    stages: &[Range<usize>],
    bad: &mut impl FnMut(&str, String),
) -> Option<(ActivationCheckpointing, String)> {
    let limit = c.run.memory_per_rank_mb?;
    if !(limit > 0.0 && limit.is_finite()) {
        return None; // refused with the run's values
    }
    let (bytes, w) = (limit * 1048576.0, c.run.world_size);
    let layout = memory::Layout::of(c);
    let state = planner.state(layout, w, Some(stages))?;
    // The checkpointing set, or the one wrap.strategy = "auto" chose.
    if planner.needs_with(&state, w, c.wrap.activation_checkpointing) <= bytes {
        return None;
    }
    if let Some(ac) = planner.lighten(&state, w, bytes) {
        let why = format!(
            "run.memory_per_rank_mb = {limit} turned it on: a rank needs {} with it, {} without, under {layout} at \
             world size {w}",
            crate::limits::size(planner.needs_with(&state, w, ac)),
            crate::limits::size(planner.needs(&state, w))
        );
        return Some((ac, why));
    }
    let who = match layout {
        memory::Layout::Pipeline => {
            let params = |r: &Range<usize>| planner.layer_parameters[r.clone()].iter().sum::<usize>();
            let (rank, heaviest) = stages.iter().enumerate().rev().max_by_key(|(_, r)| params(r)).expect("stages");
            format!("rank {rank} ({}) would need", crate::model::layers_text(heaviest))
        }
        _ => "each rank would need".to_string(),
    };
    // Checkpointing set to "none" by hand, where it would fit.
    let full = ActivationCheckpointing { policy: CheckpointPolicy::Full, every: 1 };
    let checkpoint = (planner.checkpointable > 0 && planner.needs_with(&state, w, full) <= bytes).then(|| {
        format!(
            "wrap.activation_checkpointing.policy = \"full\" fits at this world size ({} a rank; left out, the plan \
             turns it on itself where needed)",
            crate::limits::size(planner.needs_with(&state, w, full))
        )
    });
    let (advice, some_way) = match (layout, &c.wrap.pipeline.stages) {
        (memory::Layout::Pipeline, Some(_))
            if planner.state(layout, w, None).is_some_and(|s| planner.needs(&s, w) <= bytes) =>
        {
            ("leave wrap.pipeline.stages out: the split balanced by parameters fits".to_string(), true)
        }
        _ => planner.advice(layout, w, bytes, checkpoint),
    };
    // The smallest mesh shape is named only where nothing else fits.
    let advice = match meshes(bytes, !some_way) {
        Some(shapes) => format!("{advice}; {shapes}"),
        None => advice,
    };
    let under = match c.wrap.strategy {
        WrapStrategy::None => "wrap.strategy = \"none\"".to_string(),
        _ => layout.to_string(),
    };
    bad(
        "run.memory_per_rank_mb",
        format!(
            "{who} {}{}: {state} of training state and {} besides (activations, data, libtorch), under {under} at \
             world size {w}, more than the {limit} MiB a rank may use; {advice}",
            crate::limits::size(planner.needs(&state, w)),
            planner.checkpointed_too(&state, w),
            crate::limits::size((planner.besides)(
                w,
                planner.checkpointing,
                (!state.stages.is_empty()).then_some(&state.stages)
            ))
        ),
    );
    None
}

/// `wrap.strategy = "auto"`: the first strategy whose rank fits `run.memory_per_rank_mb`, or else
/// this machine's available memory shared by the ranks.
// `!(x > 0.0)` is meant: it also rejects NaN.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
pub(super) fn choose_strategy(c: &Config, planner: &memory::Planner) -> Result<memory::Choice, String> {
    if c.run.memory_per_rank_mb.is_some_and(|limit| !(limit > 0.0 && limit.is_finite())) {
        return Err("cannot choose: run.memory_per_rank_mb is not a limit (see above)".into());
    }
    match auto_limit(c) {
        Some((limit, text)) => planner.choose(c.run.world_size, limit, &text),
        None => Ok((memory::Layout::Replica, None, "chose DDP: this machine's memory cannot be read".into())),
    }
}

/// What `wrap.strategy = "auto"` fits a rank into: `run.memory_per_rank_mb` (in bytes), or else
/// this machine's available memory shared by the ranks, with its words; `None` where neither is
/// known (a limit that is not one is refused with the run's values).
pub(super) fn auto_limit(c: &Config) -> Option<(f64, String)> {
    let w = c.run.world_size;
    if let Some(limit) = c.run.memory_per_rank_mb {
        return (limit > 0.0 && limit.is_finite())
            .then(|| (limit * 1048576.0, format!("run.memory_per_rank_mb = {limit}")));
    }
    let available = crate::limits::available_memory()?;
    let text = format!(
        "this machine's {} available over {w} rank{}",
        crate::limits::size(available),
        if w == 1 { "" } else { "s" }
    );
    Some((available / w as f64, text))
}
