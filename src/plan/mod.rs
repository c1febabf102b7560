//! The `Plan`: a configuration checked as a whole (values, cross-field rules, data files) with
//! every shape known before any rank starts. The launcher builds it once and saves it in the run
//! directory (`plan.json`); ranks and `--resume` load it. Nothing downstream re-checks the
//! configuration. Each concept's checks live in their own module: [`data`] (the load stage),
//! [`recipe`] (training values and the run's length), [`stages`] (which layers each rank holds),
//! [`input`] (the files read and the run id).
mod annotate;
mod data;
mod flow;
mod input;
mod probe;
mod recipe;
mod resume;
mod saved;
pub mod schedule;
mod stages;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::schema::*;
use crate::config::{ConfigError, Resolved};
use crate::data::shard::ShardLayout;
use crate::data::DataSpec;
use crate::model::Architecture;

pub use input::InputFile;
pub use resume::EXTENDS_A_RUN;

/// What every rank needs to know, resolved and validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub config: Config,
    pub sources: BTreeMap<String, String>,
    pub pipeline_file: PathBuf,
    /// The files the pipeline file extends, nearest first.
    #[serde(default)]
    pub extends: Vec<PathBuf>,
    /// Derived from the resolved configuration: the same config gives the same id.
    pub run_id: String,
    pub data: DataSpec,
    pub layout: ShardLayout,
    /// Samples per step on each rank: train.batch_size, or the rank's share of the global batch.
    pub batch_per_rank: usize,
    pub threads_per_rank: usize,
    /// `wrap.init` resolved against the pipeline file.
    pub init_weights: Option<PathBuf>,
    /// Every file the run reads, with its digest.
    pub inputs: Vec<InputFile>,
    pub parameters: usize,
    /// Parameters of each layer of the model.
    pub layer_parameters: Vec<usize>,
    /// The layers each rank holds: all of them, except with wrap.strategy = "pipeline".
    pub stages: Vec<Range<usize>>,
    /// What one rank needs in memory, by part (when the data and model could be sized).
    #[serde(default)]
    pub memory: Option<crate::limits::Estimate>,
    /// Keys a resume extended (`train.epochs`), with their values when the run started: the run
    /// id is the digest of that first configuration.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub started_with: saved::StartedWith,
    /// The vocabulary beside a token file (`meta.json`), which `runner predict --prompt` decodes
    /// with: recorded to tell it from another file, and left out of the run id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocabulary: Option<InputFile>,
    /// Each resume that changed the world size or the strategy (into the manifest).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reshards: Vec<crate::rundir::manifest::Reshard>,
}

/// The model's part of a plan: what the checks found.
struct ModelParts {
    arch: Option<Box<dyn Architecture>>,
    init_weights: Option<PathBuf>,
    files: Vec<(&'static str, PathBuf)>,
}

impl Plan {
    /// Checks everything and reports every problem found, not just the first.
    pub fn new(resolved: Resolved) -> Result<Plan, ConfigError> {
        let Resolved { config: c, sources, file, extends } = resolved;
        let mut errors = Vec::new();
        // Each problem names the key and where its value came from.
        let mut bad = |key: &str, msg: String| {
            let from = sources.get(key).map(String::as_str).unwrap_or("default");
            errors.push(format!("`{key}` ({from}): {msg}"))
        };
        run_values(&c, &mut bad);
        track_values(&c.track, &mut bad);
        let base = file.parent().map(PathBuf::from).unwrap_or_default();
        let data = data::spec(&c, &base, &mut bad);
        // Out-of-bounds model sizes leave no architecture: nothing below computes a shape from them.
        let model_ok = crate::model::check(&c.wrap.model, &mut bad);
        recipe::train_values(&c, &sources, &mut bad);
        recipe::recipe_values(&c, data.as_ref().map(|d| d.validation_rows), &mut bad);
        let layout = data.as_ref().and_then(|d| shard_layout(&c, d, &mut bad));
        let model = model_parts(&c, &base, data.as_ref(), layout.as_ref(), model_ok, &mut bad);
        let mut files: Vec<(&str, Option<PathBuf>)> =
            data.iter().flat_map(|d| d.inputs()).map(|(k, p)| (k, Some(p))).collect();
        files.push(("wrap.init", model.init_weights.clone()));
        files.extend(model.files.iter().map(|(k, p)| (*k, Some(p.clone()))));
        let inputs = input::digests(files, &mut bad);

        let arch = model.arch;
        let layer_parameters = arch.as_ref().map(|a| crate::model::layer_parameters(a.as_ref())).unwrap_or_default();
        let stages = stages::of_ranks(&c, &sources, &layer_parameters, &mut bad);
        if let (Some(stages), Some(arch), WrapStrategy::Pipeline) = (&stages, &arch, c.wrap.strategy) {
            if let Err(e) = arch.check_stages(stages) {
                bad("wrap.model.tied", e);
            }
        }
        if let Some(l) = layout.as_ref().filter(|l| l.per_rank > 0 && c.train.batch_size > 0 && c.train.accumulate > 0)
        {
            let batches = l.per_rank.div_ceil(l.split_batch.unwrap_or(c.train.batch_size));
            let total = c.train.steps.unwrap_or(c.train.epochs * batches.div_ceil(c.train.accumulate));
            recipe::recipe_lengths(&c, batches, total, &mut bad);
        }
        if let Some(stages) = &stages {
            stages::check_memory_limit(&c, stages, &layer_parameters, &mut bad);
        }
        if let Some(l) = &layout {
            thread_replicas(&c, l.split_batch.unwrap_or(c.train.batch_size), &mut bad);
        }
        let memory = match (&data, &stages, &arch, &layout) {
            (Some(d), Some(stages), Some(arch), Some(l)) => {
                Some(memory_estimate(&c, d, l, arch.as_ref(), stages, &layer_parameters, &mut bad))
            }
            _ => None,
        };
        if !errors.is_empty() {
            let n = errors.len();
            let head =
                if n == 1 { "invalid configuration".to_string() } else { format!("{n} problems in the configuration") };
            return Err(ConfigError::new(format!("{}: {head}:\n  {}", file.display(), errors.join("\n  "))));
        }
        let (data, layout, stages) = (data.expect("checked"), layout.expect("checked"), stages.expect("checked"));
        Ok(Plan {
            vocabulary: vocabulary(&data),
            batch_per_rank: layout.split_batch.unwrap_or(c.train.batch_size),
            threads_per_rank: threads_per_rank(&c),
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
            started_with: Default::default(),
            reshards: Vec::new(),
        })
    }

    /// Where the rank that is `local_rank` on its node keeps its model, data and batches:
    /// `cuda:LOCAL_RANK` with run.device = "cuda".
    pub fn device(&self, local_rank: usize) -> tch::Device {
        crate::device::of_rank(self.config.run.device, local_rank)
    }

    pub fn world_size(&self) -> usize {
        self.config.run.world_size
    }

    /// The manifest of this plan's run, starting now.
    pub fn manifest(&self) -> crate::rundir::manifest::Manifest {
        let c = &self.config;
        let mut m = crate::rundir::manifest::Manifest::start(
            &self.run_id,
            &c.run.name,
            &self.pipeline_file,
            c.run.world_size,
            self.threads_per_rank,
        );
        m.reshards = self.reshards.clone();
        m
    }

    /// How the work is spread over the ranks (what a checkpoint records of who wrote it).
    pub fn layout(&self) -> crate::rundir::manifest::Layout {
        crate::rundir::manifest::Layout {
            world_size: self.world_size(),
            strategy: self.config.wrap.strategy,
            ranks_per_copy: self.pipeline_ranks(),
        }
    }

    /// Samples per optimizer step over all ranks: each copy's batch × the copies × train.accumulate.
    pub fn global_batch(&self) -> usize {
        self.batch_per_rank * self.layout.world_size * self.config.train.accumulate
    }

    /// The model's architecture over this plan's data.
    pub fn model(&self) -> Box<dyn Architecture> {
        let base = self.pipeline_file.parent().unwrap_or(Path::new(""));
        let model = crate::model::resolve_paths(&self.config.wrap.model, base);
        crate::model::architecture(&model, &self.data.input, self.data.task.outputs())
    }

    /// The per-sample shapes flowing into and out of layers `layers`.
    pub fn stage_shapes(&self, layers: &Range<usize>) -> (Vec<i64>, Vec<i64>) {
        let all = self.model().layers();
        let shape = |v: &[usize]| v.iter().map(|&d| d as i64).collect::<Vec<i64>>();
        let input = if layers.start == 0 { shape(&self.data.input) } else { shape(&all[layers.start - 1].output) };
        (input, shape(&all[layers.end - 1].output))
    }

    /// Writes the plan to `path` (the run directory's plan.json), atomically.
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_string_pretty(self)? + "\n";
        crate::rundir::atomic_write(path, json.as_bytes())
    }

    /// The plan a launcher saved, checked as [`saved`] says: an edited or damaged one is refused.
    pub fn load(path: &Path) -> Result<Plan, ConfigError> {
        crate::input::capped_file(path, 64 << 20, "the run's plan").map_err(ConfigError::new)?;
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(format!("cannot read the run's plan {}: {e}", path.display())))?;
        let plan: Plan = serde_json::from_str(&text).map_err(|e| {
            ConfigError::new(format!(
                "{} is not a plan this runner can read ({e}); it was written by another version, or damaged",
                path.display()
            ))
        })?;
        plan.check_saved().map_err(|e| ConfigError::new(format!("{}: {e}", path.display())))?;
        Ok(plan)
    }

    pub fn is_pipeline(&self) -> bool {
        self.config.wrap.strategy == WrapStrategy::Pipeline
    }

    /// Whether batch norm layers normalise by the statistics of every rank's batch in training:
    /// `wrap.sync_batchnorm` under DDP over more than one rank. With one rank, or ranks that train
    /// alone (`wrap.strategy = "none"`), it is plain batch norm, as torch's SyncBatchNorm is then.
    pub fn syncs_batch_norm(&self) -> bool {
        let c = &self.config;
        c.wrap.sync_batchnorm && c.wrap.strategy == WrapStrategy::Ddp && self.world_size() > 1
    }

    /// Replicas of the model each rank computes at once on its threads (`wrap.threads_per_replica`).
    pub fn thread_replicas(&self) -> usize {
        self.config.wrap.threads_per_replica.map_or(1, |t| (self.threads_per_rank / t.max(1)).max(1))
    }

    /// Intra-op threads of each of those replicas.
    pub fn threads_per_replica(&self) -> usize {
        (self.threads_per_rank / self.thread_replicas()).max(1)
    }

    /// Which shard of the data `rank` walks: its own, or its pipeline's.
    pub fn replica(&self, rank: usize) -> usize {
        if self.is_pipeline() {
            rank / self.pipeline_ranks()
        } else {
            rank
        }
    }

    /// Ranks per copy of the pipeline (its stages); 1 for the other strategies.
    pub fn pipeline_ranks(&self) -> usize {
        if self.is_pipeline() {
            self.world_size() / self.layout.world_size
        } else {
            1
        }
    }

    /// Parameters held by `rank`.
    pub fn rank_parameters(&self, rank: usize) -> usize {
        self.layer_parameters[self.stages[rank].clone()].iter().sum()
    }

    /// Steps per epoch on every rank (equal, so collectives line up).
    pub fn steps_per_epoch(&self) -> usize {
        self.layout.per_rank.div_ceil(self.batch_per_rank)
    }

    /// Optimizer steps per epoch: the batches, in groups of train.accumulate. With random
    /// windows, an epoch is as many windows as the stream holds at stride seq_len.
    pub fn optimizer_steps_per_epoch(&self) -> usize {
        self.steps_per_epoch().div_ceil(self.config.train.accumulate)
    }

    /// Optimizer steps in the whole run: train.steps, or the epochs' steps.
    pub fn total_steps(&self) -> usize {
        self.config.train.steps.unwrap_or(self.config.train.epochs * self.optimizer_steps_per_epoch())
    }

    /// The resolved configuration as TOML, each value annotated with where it came from.
    pub fn annotated_toml(&self) -> String {
        annotate::annotated_toml(self)
    }
}

/// `meta.json` beside a token file, when there is one (not for `load.source = "text"`, whose
/// vocabulary is bytes).
fn vocabulary(data: &DataSpec) -> Option<InputFile> {
    let crate::data::SourceSpec::Tokens(spec) = &data.source else { return None };
    let path = crate::prepare::meta_beside(&spec.train.files.first()?.path);
    (spec.source == Source::Tokens && path.is_file()).then(|| InputFile::read("vocabulary", &path).ok()).flatten()
}

/// The run's values: world size, threads, name, device and backend, timeouts and bounds.
/// `[track]`'s values, checked on the plan.
fn track_values(t: &Track, bad: &mut impl FnMut(&str, String)) {
    if let Some(url) = &t.mlflow {
        if let Err(why) = crate::trace::mlflow::check_url(url) {
            bad("track.mlflow", why);
        }
    }
    if t.experiment.as_deref().is_some_and(|e| e.trim().is_empty()) {
        bad("track.experiment", "is empty; name the MLflow experiment or leave the key out (default: run.name)".into());
    }
}

fn run_values(c: &Config, bad: &mut impl FnMut(&str, String)) {
    if c.run.world_size == 0 {
        bad("run.world_size", "must be at least 1".into());
    }
    crate::limits::run_values(c, bad);
    if c.run.threads_per_rank == Some(0) {
        bad("run.threads_per_rank", "must be at least 1 (or absent for cores / world_size)".into());
    }
    if c.run.name.is_empty() || c.run.name.contains(['/', '\\']) || c.run.name.starts_with('.') {
        bad("run.name", format!("{:?} cannot name a directory: use letters, digits, '-' and '_'", c.run.name));
    }
    // This build and this machine against run.device / run.backend (see crate::device).
    for (key, msg) in crate::device::refusals(c.run.backend, c.run.device) {
        bad(key, msg);
    }
}

/// `run.threads_per_rank`, or this machine's cores shared among the ranks.
fn threads_per_rank(c: &Config) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    c.run.threads_per_rank.unwrap_or((cores / c.run.world_size.max(1)).max(1))
}

/// `wrap.threads_per_replica`: a divisor of the rank's threads, and, with several replicas per
/// rank, a model whose replicas can compute at once: nothing drawn at random in the forward pass
/// (two threads drawing from one generator would draw in a different order each run), no batch
/// norm statistics (both replicas would update them), layers the runner builds, on the CPU.
fn thread_replicas(c: &Config, batch: usize, bad: &mut impl FnMut(&str, String)) {
    let Some(per) = c.wrap.threads_per_replica else { return };
    let key = "wrap.threads_per_replica";
    let threads = threads_per_rank(c);
    if per == 0 {
        return bad(key, "must be at least 1 (or absent: all of the rank's threads in one replica)".into());
    }
    if per > threads || !threads.is_multiple_of(per) {
        let why = if c.run.threads_per_rank.is_some() { "run.threads_per_rank" } else { "cores / world_size" };
        return bad(
            key,
            format!("{per} does not divide the rank's {threads} threads ({why}); use a divisor of {threads}"),
        );
    }
    let replicas = threads / per;
    if replicas == 1 {
        return;
    }
    let each = format!("{replicas} replicas per rank ({threads} threads / {per})");
    let dropout = match &c.wrap.model {
        Model::Mlp(m) => m.dropout,
        Model::Cnn(m) => m.conv.iter().map(|b| b.dropout).fold(m.dropout, f64::max),
        Model::Transformer(m) => m.dropout,
        Model::Torchscript(_) => 0.0,
    };
    if c.wrap.strategy == WrapStrategy::Pipeline {
        bad(key, format!("{each} are for whole replicas (wrap.strategy = \"ddp\" or \"none\"), not a pipeline's stages; remove it"));
    } else if c.run.device == crate::config::schema::Device::Cuda {
        bad(key, format!("{each} are for the CPU's threads; on a GPU remove it"));
    } else if matches!(c.wrap.model, Model::Torchscript(_)) {
        bad(key, format!("{each} need layers the runner builds; a TorchScript module cannot be copied to share its weights. Remove it"));
    } else if dropout > 0.0 {
        bad(key, format!("{each} would draw dropout's masks from one generator on two threads, in a different order each run; set the model's dropout to 0 or remove it"));
    } else if matches!(&c.wrap.model, Model::Cnn(m) if m.conv.iter().any(|b| b.batch_norm)) {
        bad(key, format!("{each} would both update batch norm's running statistics; remove it (or batch_norm from the conv blocks)"));
    } else if batch < replicas {
        bad(key, format!("{each} need at least {replicas} rows per batch to split; the rank's batch has {batch}"));
    }
}

/// How the training rows divide across ranks (DistributedSampler, or each global batch split).
fn shard_layout(c: &Config, d: &DataSpec, bad: &mut impl FnMut(&str, String)) -> Option<ShardLayout> {
    let (w, t) = (c.run.world_size, &c.train);
    if w == 0 {
        return None;
    }
    // A pipeline's ranks share one copy of the model: each copy walks its own shard.
    let replicas = if c.wrap.strategy == WrapStrategy::Pipeline { c.wrap.pipeline.replicas.max(1) } else { w };
    let layout = match (c.shard.strategy, t.global_batch_size) {
        (ShardStrategy::Dataset, None) => ShardLayout::new(d.rows, replicas, c.shard.drop_last),
        (ShardStrategy::Dataset, Some(_)) => {
            bad(
                "train.global_batch_size",
                "is only used by shard.strategy = \"batch\"; use train.batch_size (per rank)".into(),
            );
            return None;
        }
        (ShardStrategy::Batch, None) => {
            bad("train.global_batch_size", "shard.strategy = \"batch\" needs the global batch size to split".into());
            return None;
        }
        (ShardStrategy::Batch, Some(g)) => {
            // Compared with the default, not by source: a run's saved config.toml sets every key.
            if t.batch_size != Train::default().batch_size {
                bad("train.batch_size", "is not used with shard.strategy = \"batch\": each rank takes global_batch_size / world_size; remove it".into());
            }
            if g == 0 || g % w != 0 {
                bad(
                    "train.global_batch_size",
                    format!("{g} does not split evenly over {w} ranks; use a multiple of {w}"),
                );
                return None;
            }
            if g > d.rows {
                bad("train.global_batch_size", format!("{g} is larger than the {} training rows", d.rows));
                return None;
            }
            return Some(ShardLayout::split(d.rows, w, g, c.shard.drop_last));
        }
    };
    if layout.per_rank == 0 {
        bad("run.world_size", format!("{} ranks leave no training row for some rank (rows: {})", w, layout.rows));
    } else if t.batch_size > layout.per_rank && !d.random_windows() {
        bad(
            "train.batch_size",
            format!(
                "{} per rank is larger than a rank's shard of {} rows ({} rows / {} ranks); use at most {}",
                t.batch_size, layout.per_rank, layout.rows, layout.world_size, layout.per_rank
            ),
        );
    }
    Some(layout)
}

/// The model against the data: its architecture (a TorchScript module runs a batch here),
/// SyncBatchNorm's preconditions, the initial weights and the model's own files.
fn model_parts(
    c: &Config,
    base: &Path,
    data: Option<&DataSpec>,
    layout: Option<&ShardLayout>,
    model_ok: bool,
    bad: &mut impl FnMut(&str, String),
) -> ModelParts {
    let model = crate::model::resolve_paths(&c.wrap.model, base);
    let model_ok = model_ok
        && data.is_some_and(|d| {
            let probe = || layout.and_then(|l| probe::torchscript_probe(c, d, l));
            crate::model::check_input(&model, &d.input, d.task.outputs(), probe, bad)
        });
    let arch = data.filter(|_| model_ok).map(|d| crate::model::architecture(&model, &d.input, d.task.outputs()));
    if let (Some(arch), Some(d), Some(l)) = (&arch, data, layout) {
        probe::batch_norm(c, d, l, arch.as_ref(), bad);
    }
    if let (true, Some(arch)) = (c.wrap.sync_batchnorm, &arch) {
        sync_batchnorm(c, arch.as_ref(), bad);
    }
    let init_weights = c.wrap.init.as_ref().map(|rel| base.join(rel));
    if let (Some(path), Some(arch)) = (&init_weights, &arch) {
        if let Err(e) = crate::model::read_weights(path, &crate::model::sorted_parameters(arch.as_ref())) {
            bad("wrap.init", e);
        }
    }
    ModelParts { arch, init_weights, files: crate::model::files(&model) }
}

/// `wrap.sync_batchnorm` needs batch norm layers the runner owns, in replicas.
fn sync_batchnorm(c: &Config, arch: &dyn Architecture, bad: &mut impl FnMut(&str, String)) {
    if matches!(c.wrap.model, Model::Torchscript(_)) {
        bad(
            "wrap.sync_batchnorm",
            format!(
                "{} runs its own layers: the runner cannot synchronise batch norm inside it; remove it (or use a \
                 built-in model kind, such as \"cnn\" with batch_norm blocks)",
                arch.describe()
            ),
        );
    } else if !arch.has_batch_norm() {
        bad("wrap.sync_batchnorm", format!("{} has no batch norm layers to synchronise; remove it", arch.describe()));
    } else if c.wrap.strategy == WrapStrategy::Pipeline {
        bad(
            "wrap.sync_batchnorm",
            "is not available with wrap.strategy = \"pipeline\": each rank of a pipeline holds other layers, and a \
             batch norm layer normalises each micro-batch on its own; synchronising over the pipeline's copies is not \
             implemented (torch has no equivalent either). Use wrap.strategy = \"ddp\", or remove it"
                .into(),
        );
    }
}

/// What one rank needs in memory, checked against what this machine has.
fn memory_estimate(
    c: &Config,
    d: &DataSpec,
    layout: &ShardLayout,
    arch: &dyn Architecture,
    stages: &[Range<usize>],
    layer_parameters: &[usize],
    bad: &mut impl FnMut(&str, String),
) -> crate::limits::Estimate {
    let heaviest = stages.iter().map(|r| layer_parameters[r.clone()].iter().sum()).max().unwrap_or(0);
    let batch = layout.split_batch.unwrap_or(c.train.batch_size);
    let layers = arch.layers();
    let outputs = layers.iter().map(|l| l.output.iter().product::<usize>()).sum::<usize>();
    let held = layers.iter().map(|l| l.held).sum::<usize>();
    let estimate = crate::limits::estimate(c, d, heaviest, d.input_size() + outputs, held, batch);
    let model_key = match c.wrap.model {
        Model::Transformer(_) => "wrap.model.d_model",
        _ => "wrap.model.hidden",
    };
    crate::limits::check_memory(&estimate, c.run.world_size, model_key, bad);
    estimate
}
