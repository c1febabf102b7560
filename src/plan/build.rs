//! [`Plan::build`]: every check of a configuration, every problem reported at once, and the
//! values the plan chooses itself (`wrap.strategy = "auto"`, checkpointing under a memory limit).
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{auto_mesh, data, graphs, input, memory, mesh, model, recipe, stages, strategy, values, vocabulary};
use super::{Machine, Plan, Resuming};
use crate::config::schema::*;
use crate::config::{ConfigError, Resolved};
use crate::data::shard::ShardLayout;
use crate::data::DataSpec;
use crate::model::Architecture;

type Sources = std::collections::BTreeMap<String, String>;

/// A rank's training state under the strategy, and under DDP to compare with.
type States = (memory::State, Option<memory::State>);

/// The keys the plan set itself, each with what set it (added to the plan's sources).
type Chosen = Vec<(&'static str, String)>;

impl Plan {
    pub(super) fn build(
        resolved: Resolved,
        resuming: Option<&Resuming>,
        machine: Machine,
    ) -> Result<Plan, ConfigError> {
        let Resolved { config: mut c, mut sources, file, extends } = resolved;
        let base = file.parent().map(PathBuf::from).unwrap_or_default();
        let imported = model::import_hf(&mut c, &mut sources, &base);
        let mut chosen: Chosen = Vec::new();
        let mut errors = Vec::new();
        // Each problem names the key and where its value came from.
        let mut bad = |key: &str, msg: String| {
            let from = sources.get(key).map(String::as_str).unwrap_or("default");
            errors.push(format!("`{key}` ({from}): {msg}"))
        };
        for (key, problem) in imported {
            bad(&key, problem);
        }
        let (data, layout, model_ok) = value_checks(&c, &sources, &base, machine, &mut bad);
        let model = model::model_parts(&c, &base, data.as_ref(), layout.as_ref(), model_ok, &mut bad);
        let inputs = input_digests(data.as_ref(), &model, &mut bad);
        let arch = model.arch;
        let layer_parameters = arch.as_ref().map(|a| crate::model::layer_parameters(a.as_ref())).unwrap_or_default();
        let planner_for = |c: &Config, layout| {
            arch.as_ref()
                .map(|a| planner_of(c, &sources, resuming, a.as_ref(), &layer_parameters, data.as_ref(), layout))
        };
        let planner = planner_for(&c, layout.as_ref());
        strategy::strategy_keys(&c, &sources, resuming.map(|r| r.own_config.as_str()), &mut bad);
        mesh::check(&c, &sources, &mut bad);
        let (auto, meshed) = match (c.wrap.strategy, &planner, &data, &layout, &arch) {
            (WrapStrategy::Auto, Some(p), Some(d), Some(l), Some(a)) => {
                let model = (a.as_ref(), layer_parameters.as_slice(), d, l);
                resolve_auto(&mut c, (&sources, resuming), model, p, &mut chosen, &mut bad)
            }
            _ => (None, false),
        };
        // A mesh chosen: its copies share the data, and each rank holds its slices.
        let remeshed = match meshed {
            true => data.as_ref().and_then(|d| data::shard_layout(&c, d, &mut bad)),
            false => None,
        };
        let layout_now = if meshed { remeshed.as_ref() } else { layout.as_ref() };
        let planner = match meshed {
            true => {
                drop(planner);
                planner_for(&c, layout_now)
            }
            false => planner,
        };
        let parts = (arch.as_deref(), layer_parameters.as_slice(), data.as_ref(), layout_now);
        let stages = checks_of_the_strategy(&c, &sources, parts, &mut bad);
        // An "auto" still unresolved has been refused with the numbers already.
        let checkpointing_chosen = match (&stages, &planner, &arch, &data, layout_now) {
            (Some(stages), Some(planner), Some(a), Some(d), Some(l)) if c.wrap.strategy != WrapStrategy::Auto => {
                let model = (a.as_ref(), layer_parameters.as_slice(), d, l);
                limit_checkpointing(&mut c, (&sources, resuming), model, (planner, stages), &mut chosen, &mut bad)
            }
            _ => None,
        };
        if let Some(l) = layout_now {
            values::thread_replicas(&c, l.split_batch.unwrap_or(c.train.batch_size), &mut bad);
        }
        let (state, memory, memory_by_rank) = match (&data, &arch, layout_now, &planner, &stages) {
            (Some(d), Some(a), Some(l), Some(planner), Some(stages)) => {
                estimates(&c, (d, l, a.as_ref()), planner, stages, machine, &mut bad)
            }
            _ => (None, None, Vec::new()),
        };
        drop(planner);
        let layout = if meshed { remeshed } else { layout };
        let vocabulary = vocabulary::record(&c, &base, &mut bad);
        if !errors.is_empty() {
            return Err(refusal(&file, &errors));
        }
        let (data, layout, stages) = (data.expect("checked"), layout.expect("checked"), stages.expect("checked"));
        sources.extend(chosen.into_iter().map(|(k, v)| (k.to_owned(), v)));
        Ok(Plan {
            vocabulary,
            batch_per_rank: layout.split_batch.unwrap_or(c.train.batch_size),
            threads_per_rank: values::threads_per_rank(&c),
            parameters: layer_parameters.iter().sum(),
            run_id: input::run_id(&c, &inputs),
            config: c,
            sources,
            pipeline_file: file,
            extends,
            data,
            layout,
            init_weights: model.init_weights,
            inputs,
            layer_parameters,
            stages,
            memory,
            memory_by_rank,
            started_with: Default::default(),
            state,
            auto,
            checkpointing_chosen,
            reshards: Vec::new(),
        })
    }
}

/// The checks of each section's values: the data it describes and its shard layout, and whether
/// the model's sizes are in bounds (out-of-bounds sizes leave no architecture: nothing after
/// computes a shape from them).
fn value_checks(
    c: &Config,
    sources: &Sources,
    base: &Path,
    machine: Machine,
    bad: &mut impl FnMut(&str, String),
) -> (Option<DataSpec>, Option<ShardLayout>, bool) {
    values::run_values(c, machine, bad);
    values::track_values(&c.track, bad);
    let data = data::spec(c, base, bad);
    let model_ok = crate::model::check(&c.wrap.model, bad);
    recipe::train_values(c, sources, bad);
    recipe::recipe_values(c, data.as_ref().map(|d| d.validation_rows), bad);
    let layout = data.as_ref().and_then(|d| data::shard_layout(c, d, bad));
    graphs::refusals(c, layout.as_ref(), bad);
    (data, layout, model_ok)
}

/// The digests of every file the run reads: its data, the weights it starts from, the model's
/// own files.
fn input_digests(
    data: Option<&DataSpec>,
    model: &model::ModelParts,
    bad: &mut impl FnMut(&str, String),
) -> Vec<input::InputFile> {
    let mut files: Vec<(&str, Option<PathBuf>)> =
        data.iter().flat_map(|d| d.inputs()).map(|(k, p)| (k, Some(p))).collect();
    files.extend(model.init_files.iter().map(|p| ("wrap.init", Some(p.clone()))));
    files.extend(model.files.iter().map(|(k, p)| (*k, Some(p.clone()))));
    input::digests(files, bad)
}

/// The checks that need the strategy settled (after `auto`): LoRA's, validation's, FSDP's, the
/// pipeline's stages and the schedule's lengths. The pipeline's stages (one for any other
/// strategy).
fn checks_of_the_strategy(
    c: &Config,
    sources: &Sources,
    (arch, layer_parameters, data, layout): (
        Option<&dyn Architecture>,
        &[usize],
        Option<&DataSpec>,
        Option<&ShardLayout>,
    ),
    bad: &mut impl FnMut(&str, String),
) -> Option<Vec<Range<usize>>> {
    model::lora_strategy(c, bad);
    recipe::split_validation(c, data.map(|d| d.validation_rows), bad);
    fsdp_needs_rows(c, arch, bad);
    let stages = stages::of_ranks(c, sources, layer_parameters, bad);
    if let (Some(stages), Some(arch), WrapStrategy::Pipeline) = (&stages, &arch, c.wrap.strategy) {
        if let Err(e) = arch.check_stages(stages) {
            bad("wrap.model.tied", e);
        }
    }
    if let Some(l) = layout.filter(|l| l.per_rank > 0 && c.train.batch_size > 0 && c.train.accumulate > 0) {
        let batches = l.per_rank.div_ceil(l.split_batch.unwrap_or(c.train.batch_size));
        let total = c.train.steps.unwrap_or(c.train.epochs * batches.div_ceil(c.train.accumulate));
        recipe::recipe_lengths(c, batches, total, bad);
    }
    stages
}

/// What the memory model needs of this configuration: the model's shapes and split, the
/// optimizer's state, what a rank holds besides it.
fn planner_of<'a>(
    c: &Config,
    sources: &Sources,
    resuming: Option<&Resuming>,
    a: &'a dyn Architecture,
    layer_parameters: &'a [usize],
    data: Option<&'a DataSpec>,
    layout: Option<&'a ShardLayout>,
) -> memory::Planner<'a> {
    memory::Planner {
        shapes: memory::Shapes::of(a, mesh::Shape::of(c).tensor),
        layer_parameters,
        slots: memory::optimizer_slots(c),
        // A stage split the model refuses (a tied head away from its embedding) is none.
        cuts: Box::new(move |stages| a.check_stages(stages).is_ok()),
        shards: scalar_parameter(a).is_none(),
        // The copies a pipeline of this configuration would run (auto weighs it too).
        pipeline_copies: c.wrap.mesh.data.unwrap_or(c.wrap.pipeline.replicas),
        gloo: c.run.backend == Backend::Gloo,
        global_batch: resuming.map(|r| r.global_batch).or(c.train.global_batch_size),
        besides: match (data, layout) {
            (Some(d), Some(l)) => {
                let c = c.clone();
                Box::new(move |w, ac, stages| strategy::besides_state(&c, d, l, a, w, ac, stages))
            }
            _ => Box::new(|_, _, _| 0.0),
        },
        checkpointing: c.wrap.activation_checkpointing,
        checkpointable: strategy::checkpointable(c, sources, resuming.map(|r| r.own_config.as_str())),
        choose_checkpointing: strategy::choose_checkpointing(sources),
    }
}

/// The mesh shapes of `c`'s world size, each estimated as the plan would estimate it configured
/// ([`auto_mesh`]).
fn mesh_shapes(
    c: &Config,
    sources: &Sources,
    resuming: Option<&Resuming>,
    a: &dyn Architecture,
    layer_parameters: &[usize],
    d: &DataSpec,
    l: &ShardLayout,
) -> Vec<auto_mesh::Candidate> {
    let needs = |m: &Config| {
        let p = planner_of(m, sources, resuming, a, layer_parameters, Some(d), Some(l));
        let (shape, layout) = (mesh::Shape::of(m), memory::Layout::of(m));
        // FSDP shards over the data dimension; a pipeline's stages are its own.
        let over = if layout == memory::Layout::Pipeline { shape.pipeline } else { shape.data };
        let s = p.state(layout, over, None)?;
        Some(p.needs(&s, m.run.world_size))
    };
    // A copy's rows and batches per optimizer step.
    let (rows, batches) = ((c.train.batch_size * c.train.accumulate) as f64, c.train.accumulate as f64);
    let sends = |m: &Config| super::traffic::split_copies(m, a, &d.input, rows, batches);
    auto_mesh::candidates(c, &needs, &sends, c.train.batch_size * c.train.accumulate)
}

/// `wrap.strategy = "auto"` where no strategy over the whole world fits (`before` says why): of
/// the mesh `shapes`, the one chosen with why; or why none fits.
fn over_meshes(
    c: &Config,
    shapes: &[auto_mesh::Candidate],
    before: &str,
) -> Result<(auto_mesh::Candidate, String), String> {
    let Some((limit, limit_text)) = strategy::auto_limit(c) else { return Err(String::new()) };
    // The 1-D strategies' reasons, without the advice that follows them.
    let before = before.split_once(": ").map_or(before, |(_, r)| r).split("; ").next().unwrap_or_default();
    auto_mesh::choose(shapes, limit, &limit_text, before)
}

/// The keys `wrap.strategy = "auto"` sets when it chooses a mesh (`pipeline`: one with pipeline
/// stages), and by what.
fn mesh_keys(sources: &Sources, pipeline: bool) -> Chosen {
    let from = sources.get("wrap.strategy").map_or("default", String::as_str);
    let by = "wrap.strategy = \"auto\"";
    let mut keys = vec![
        ("wrap.strategy", format!("{by} ({from})")),
        ("wrap.fsdp.reshard_after_forward", by.into()),
        ("wrap.mesh.data", by.into()),
        ("wrap.mesh.tensor", by.into()),
    ];
    if pipeline {
        keys.push(("wrap.mesh.pipeline", by.into()));
    }
    keys
}

/// `wrap.strategy = "auto"`: the first strategy over the whole world that fits, set in `c`; where
/// none does, the mesh shape that fits (then `true`: the data's shard layout and the estimates
/// follow the mesh); or the refusal naming both. The reason, for the plan to print.
fn resolve_auto(
    c: &mut Config,
    (sources, resuming): (&Sources, Option<&Resuming>),
    (a, layer_parameters, d, l): (&dyn Architecture, &[usize], &DataSpec, &ShardLayout),
    planner: &memory::Planner,
    chosen: &mut Chosen,
    bad: &mut impl FnMut(&str, String),
) -> (Option<String>, bool) {
    let e = match strategy::choose_strategy(c, planner) {
        Ok(choice) => return (Some(apply_auto(c, choice, sources, chosen)), false),
        Err(e) => e,
    };
    match over_meshes(c, &mesh_shapes(c, sources, resuming, a, layer_parameters, d, l), &e) {
        Ok((shape, why)) => {
            *c = shape.config(c);
            chosen.extend(mesh_keys(sources, shape.pipeline > 1));
            (Some(why), true)
        }
        Err(more) => {
            bad("wrap.strategy", format!("{e}; {more}"));
            (None, false)
        }
    }
}

/// A rank's training state (and DDP's, to compare with), the heaviest rank's memory estimate
/// and, under a pipeline, each rank's.
fn estimates(
    c: &Config,
    model: (&DataSpec, &ShardLayout, &dyn Architecture),
    planner: &memory::Planner,
    stages: &[Range<usize>],
    machine: Machine,
    bad: &mut impl FnMut(&str, String),
) -> (Option<States>, Option<crate::limits::Estimate>, Vec<crate::limits::Estimate>) {
    let Some(state) = training_state(c, planner, stages) else { return (None, None, Vec::new()) };
    let (heaviest, by_rank) = super::stage_memory::memory_of_ranks(c, model, planner, stages, &state.0, machine, bad);
    (Some(state), Some(heaviest), by_rank)
}

/// `wrap.strategy = "auto"`'s choice into the configuration, each key it set recorded with what
/// set it; the reason, for the plan to print.
fn apply_auto(c: &mut Config, choice: memory::Choice, sources: &Sources, chosen: &mut Chosen) -> String {
    let (layout, checkpointing, why) = choice;
    if let Some(ac) = checkpointing {
        c.wrap.activation_checkpointing = ac;
        chosen.extend(checkpointing_keys("wrap.strategy = \"auto\""));
    }
    (c.wrap.strategy, c.wrap.fsdp.reshard_after_forward) = match layout {
        memory::Layout::Replica => (WrapStrategy::Ddp, true),
        memory::Layout::Fsdp { zero3 } => (WrapStrategy::Fsdp, zero3),
        memory::Layout::Pipeline => (WrapStrategy::Pipeline, true),
    };
    let from = sources.get("wrap.strategy").map_or("default", String::as_str);
    chosen.push(("wrap.strategy", format!("wrap.strategy = \"auto\" ({from})")));
    if c.wrap.strategy == WrapStrategy::Fsdp {
        chosen.push(("wrap.fsdp.reshard_after_forward", "wrap.strategy = \"auto\"".into()));
    }
    why
}

/// `run.memory_per_rank_mb` checked under a configured strategy; the checkpointing it turns on
/// (where the policy was left out and it makes the rank fit) into the configuration, with the
/// reason; where nothing makes it fit, a refusal that names the mesh shapes that would.
fn limit_checkpointing(
    c: &mut Config,
    (sources, resuming): (&Sources, Option<&Resuming>),
    (a, layer_parameters, d, l): (&dyn Architecture, &[usize], &DataSpec, &ShardLayout),
    (planner, stages): (&memory::Planner, &[Range<usize>]),
    chosen: &mut Chosen,
    bad: &mut impl FnMut(&str, String),
) -> Option<String> {
    let config = c.clone();
    let meshes = |limit: f64, smallest_too: bool| {
        let shapes = mesh_shapes(&config, sources, resuming, a, layer_parameters, d, l);
        auto_mesh::fitting(&shapes, limit, smallest_too)
    };
    let (ac, why) = strategy::check_memory_limit(c, planner, &meshes, stages, bad)?;
    c.wrap.activation_checkpointing = ac;
    chosen.extend(checkpointing_keys("run.memory_per_rank_mb"));
    Some(why)
}

/// The keys of `wrap.activation_checkpointing` the plan sets when it turns it on, and by what.
fn checkpointing_keys(by: &str) -> [(&'static str, String); 2] {
    [("wrap.activation_checkpointing.policy", by.into()), ("wrap.activation_checkpointing.every", by.into())]
}

/// FSDP shards every parameter by its rows: a model with a scalar parameter is refused under it.
fn fsdp_needs_rows(c: &Config, arch: Option<&dyn Architecture>, bad: &mut impl FnMut(&str, String)) {
    if let (Some(name), WrapStrategy::Fsdp) = (arch.and_then(scalar_parameter), c.wrap.strategy) {
        bad(
            "wrap.strategy",
            format!(
                "\"fsdp\" shards every parameter by its rows (dim 0), but the model's parameter `{name}` is \
                 0-dimensional (a scalar); use wrap.strategy = \"ddp\", or make it a 1-element tensor \
                 (nn.Parameter(torch.tensor([value])))"
            ),
        );
    }
}

/// The first 0-dimensional (scalar) trainable parameter of the model, which FSDP cannot shard.
fn scalar_parameter(arch: &dyn Architecture) -> Option<String> {
    arch.parameters(0..arch.layers().len()).into_iter().find(|(_, shape)| shape.is_empty()).map(|(name, _)| name)
}

/// A rank's training state under the configured strategy, and under DDP to compare with when
/// the strategy is another.
fn training_state(c: &Config, planner: &memory::Planner, stages: &[Range<usize>]) -> Option<States> {
    let layout = memory::Layout::of(c);
    // FSDP shards each tensor rank's slices over the data dimension.
    let sharded_over = c.run.world_size / mesh::Shape::of(c).tensor.max(1);
    planner.state(layout, sharded_over.max(1), Some(stages)).map(|s| {
        let ddp = (layout != memory::Layout::Replica)
            .then(|| planner.state(memory::Layout::Replica, c.run.world_size, None))
            .flatten();
        (s, ddp)
    })
}

/// Every problem found, under the pipeline file's name.
fn refusal(file: &Path, errors: &[String]) -> ConfigError {
    let n = errors.len();
    let head = if n == 1 { "invalid configuration".to_string() } else { format!("{n} problems in the configuration") };
    ConfigError::new(format!("{}: {head}:\n  {}", file.display(), errors.join("\n  ")))
}
