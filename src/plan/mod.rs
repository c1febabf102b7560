//! The `Plan`: a configuration checked as a whole (values, cross-field rules, data files) with
//! every shape known before any rank starts. The launcher builds it once and saves it in the run
//! directory (`plan.json`); ranks and `--resume` load it. Nothing downstream re-checks the
//! configuration.
// `!(x > 0.0)` is meant: it also rejects NaN, which `x <= 0.0` would let through.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod flow;
mod resume;
pub mod schedule;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::schema::*;
use crate::config::{ConfigError, Resolved};
use crate::data::shard::ShardLayout;
use crate::data::split::Holdout;
use crate::data::{file, DataSpec, FileInfo, Task};
use crate::model::Architecture;

pub use resume::EXTENDS_A_RUN;

/// A file the run reads, with the digest of its content when the plan was made: the run id
/// covers it, and a resumed run refuses a file that changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputFile {
    /// The configuration key that names it (`load.path`, `wrap.init`).
    pub key: String,
    /// Absolute.
    pub path: PathBuf,
    pub bytes: u64,
    /// FNV-1a of the content, 16 hex digits.
    pub digest: String,
}

impl InputFile {
    fn read(key: &str, path: &Path) -> Result<InputFile, String> {
        use std::io::Read;
        let path = std::fs::canonicalize(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut file = std::fs::File::open(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let (mut hash, mut bytes, mut buf) = (crate::rng::FNV_OFFSET, 0u64, vec![0u8; 1 << 16]);
        loop {
            let n = file.read(&mut buf).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            if n == 0 {
                break;
            }
            hash = crate::rng::fnv1a_from(hash, &buf[..n]);
            bytes += n as u64;
        }
        Ok(InputFile { key: key.to_owned(), path, bytes, digest: format!("{hash:016x}") })
    }
}

/// What every rank needs to know, resolved and validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub config: Config,
    pub sources: BTreeMap<String, String>,
    pub pipeline_file: PathBuf,
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
}

impl Plan {
    /// Checks everything and reports every problem found, not just the first.
    pub fn new(resolved: Resolved) -> Result<Plan, ConfigError> {
        let Resolved { config: c, sources, file } = resolved;
        let mut errors = Vec::new();
        // Each problem names the key and where its value came from.
        let mut bad = |key: &str, msg: String| {
            let from = sources.get(key).map(String::as_str).unwrap_or("default");
            errors.push(format!("`{key}` ({from}): {msg}"))
        };

        if c.run.world_size == 0 {
            bad("run.world_size", "must be at least 1".into());
        }
        crate::limits::run_values(&c, &mut bad);
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

        let base = file.parent().map(PathBuf::from).unwrap_or_default();
        let mut data = match (c.load.source, &c.wrap.model) {
            // A language model: windows of token ids, from a file or synthetic.
            (Source::Synthetic | Source::Tokens | Source::Text, Model::Transformer(t)) => {
                crate::data::tokens::spec(&c.load, t, &base, &mut bad)
            }
            (Source::Tokens | Source::Text, _) => {
                bad(
                    "load.source",
                    format!(
                        "\"{}\" gives token ids for a language model: use wrap.model.kind = \"transformer\"",
                        if c.load.source == Source::Text { "text" } else { "tokens" }
                    ),
                );
                None
            }
            (Source::Csv | Source::Parquet | Source::Tensors, Model::Transformer(_)) => {
                bad(
                    "wrap.model.kind",
                    "\"transformer\" is a language model over token ids: use load.source = \"tokens\", \"text\" \
                     or \"synthetic\""
                        .into(),
                );
                None
            }
            (Source::Synthetic, _) => {
                let l = &c.load;
                for (key, given) in [
                    ("load.path", l.path.is_some()),
                    ("load.target", l.target.is_some()),
                    ("load.exclude", !l.exclude.is_empty()),
                    ("load.validation_path", l.validation_path.is_some()),
                    ("load.missing", l.missing != Missing::Error),
                    ("load.delimiter", l.delimiter.is_some()),
                    ("validate.fraction", c.validate.fraction.is_some()),
                    ("validate.rows", c.validate.rows.is_some()),
                ] {
                    if given {
                        bad(key, "is only read by source = \"csv\" or \"parquet\"".into());
                    }
                }
                if c.train.task != TaskKind::Classification {
                    bad(
                        "train.task",
                        "synthetic data is a classification; regression needs a csv or parquet file".into(),
                    );
                }
                let input = match (c.load.image, &l.features) {
                    (Some(_), Some(_)) => {
                        bad(
                            "load.features",
                            "images have load.image's shape, not features: give one of the two".into(),
                        );
                        vec![0]
                    }
                    (Some(image), None) if image.contains(&0) => {
                        bad("load.image", format!("[channels, height, width] must all be at least 1, got {image:?}"));
                        vec![0]
                    }
                    (Some(image), None) => image.to_vec(),
                    (None, None) => vec![10],
                    (None, Some(Features::Count(n))) => vec![*n],
                    (None, Some(Features::Columns(_))) => {
                        bad("load.features", "names columns of a file; synthetic data takes a number".into());
                        vec![10]
                    }
                };
                if c.load.labels.is_some() {
                    bad("load.labels", "is only read by source = \"tensors\"".into());
                }
                let spec = DataSpec {
                    source: Source::Synthetic,
                    rows: c.load.rows.unwrap_or(10_000),
                    input,
                    task: Task::Classification { classes: c.load.classes.unwrap_or(2) },
                    validation_rows: c.load.validation_rows,
                    noise: c.load.noise,
                    file: None,
                    tokens: None,
                    tensors: None,
                };
                if spec.input_size() == 0 && c.load.image.is_none() {
                    bad("load.features", "must be at least 1".into());
                }
                if !(spec.noise >= 0.0) {
                    bad("load.noise", format!("must be 0 or more, got {}", spec.noise));
                }
                Some(spec)
            }
            (Source::Tensors, _) => crate::data::tensors::spec(&c.load, &base, &mut bad),
            (source, _) => file_spec(&c, source, &base, &mut bad),
        };
        if data.as_ref().is_some_and(|d| d.task.is_language_model()) && c.normalize.method != NormalizeMethod::None {
            bad(
                "normalize.method",
                "a language model's inputs are token ids, which are never scaled: set it to \"none\"".into(),
            );
        }
        // Out-of-bounds sizes leave no data: nothing below computes a shape from them.
        if data.as_ref().is_some_and(|d| !crate::limits::sizes(&c, d, &mut bad))
            || c.run.world_size > crate::limits::MAX_WORLD_SIZE
        {
            data = None;
        }
        if let Some(d) = &data {
            if let Task::Classification { classes: classes @ 0..=1 } = d.task {
                bad("load.classes", format!("must be at least 2 for classification, got {classes}"));
            }
            if d.rows == 0 {
                bad("load.rows", "must be at least 1".into());
            }
        }

        // Out-of-bounds model sizes leave no architecture: nothing below computes a shape from them.
        let model_ok = crate::model::check(&c.wrap.model, &mut bad);
        if !(c.wrap.bucket_cap_mb > 0.0) {
            bad("wrap.bucket_cap_mb", format!("must be positive, got {}", c.wrap.bucket_cap_mb));
        }
        if c.checkpoint.every > 0 && c.checkpoint.keep == 0 {
            bad("checkpoint.keep", "must be at least 1 when checkpoint.every is set".into());
        }
        let t = &c.train;
        if t.epochs == 0 {
            bad("train.epochs", "must be at least 1".into());
        }
        if t.batch_size == 0 {
            bad("train.batch_size", "must be at least 1".into());
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            bad("train.lr", format!("must be positive, got {}", t.lr));
        }
        if t.optimizer != Optimizer::Sgd && t.momentum != 0.0 {
            bad(
                "train.momentum",
                format!("is only used by optimizer = \"sgd\", not {:?}: remove it", t.optimizer).to_lowercase(),
            );
        }
        if !(0.0..1.0).contains(&t.momentum) {
            bad("train.momentum", format!("must be in [0, 1), got {}", t.momentum));
        }
        if !(t.weight_decay >= 0.0) {
            bad("train.weight_decay", format!("must be 0 or more, got {}", t.weight_decay));
        }

        recipe_values(&c, data.as_ref().map(|d| d.validation_rows), &mut bad);

        let w = c.run.world_size;
        let pipeline = c.wrap.strategy == WrapStrategy::Pipeline;
        // A pipeline's ranks share one copy of the model: each copy walks its own shard.
        let replicas = if pipeline { c.wrap.pipeline.replicas.max(1) } else { w };
        let split = match (c.shard.strategy, t.global_batch_size) {
            (ShardStrategy::Dataset, None) => None,
            (ShardStrategy::Dataset, Some(_)) => {
                bad(
                    "train.global_batch_size",
                    "is only used by shard.strategy = \"batch\"; use train.batch_size (per rank)".into(),
                );
                None
            }
            (ShardStrategy::Batch, None) => {
                bad(
                    "train.global_batch_size",
                    "shard.strategy = \"batch\" needs the global batch size to split".into(),
                );
                None
            }
            (ShardStrategy::Batch, Some(g)) => {
                // Compared with the default, not by source: a run's saved config.toml sets every key.
                if t.batch_size != Train::default().batch_size {
                    bad("train.batch_size", "is not used with shard.strategy = \"batch\": each rank takes global_batch_size / world_size; remove it".into());
                }
                if g == 0 || w == 0 || g % w != 0 {
                    bad(
                        "train.global_batch_size",
                        format!("{g} does not split evenly over {w} ranks; use a multiple of {w}"),
                    );
                    None
                } else if data.as_ref().is_some_and(|d| g > d.rows) {
                    bad(
                        "train.global_batch_size",
                        format!("{g} is larger than the {} training rows", data.as_ref().unwrap().rows),
                    );
                    None
                } else {
                    Some(g)
                }
            }
        };
        let layout = data.as_ref().filter(|_| w > 0).and_then(|d| match (c.shard.strategy, split) {
            (ShardStrategy::Dataset, _) => Some(ShardLayout::new(d.rows, replicas, c.shard.drop_last)),
            (ShardStrategy::Batch, Some(g)) => Some(ShardLayout::split(d.rows, w, g, c.shard.drop_last)),
            (ShardStrategy::Batch, None) => None,
        });
        if let (Some(l), true, None) = (&layout, t.batch_size > 0, split) {
            if l.per_rank == 0 {
                bad(
                    "run.world_size",
                    format!("{} ranks leave no training row for some rank (rows: {})", c.run.world_size, l.rows),
                );
            } else if t.batch_size > l.per_rank {
                bad(
                    "train.batch_size",
                    format!(
                        "{} per rank is larger than a rank's shard of {} rows ({} rows / {} ranks); use at most {}",
                        t.batch_size, l.per_rank, l.rows, l.world_size, l.per_rank
                    ),
                );
            }
        }

        // The model against the data's shapes (a TorchScript module runs one batch here).
        let model = crate::model::resolve_paths(&c.wrap.model, &base);
        let model_ok = model_ok
            && data.as_ref().is_some_and(|d| crate::model::check_input(&model, &d.input, d.task.outputs(), &mut bad));
        let arch =
            data.as_ref().filter(|_| model_ok).map(|d| crate::model::architecture(&model, &d.input, d.task.outputs()));
        if let (true, Some(arch)) = (c.wrap.sync_batchnorm, &arch) {
            if matches!(c.wrap.model, Model::Torchscript(_)) {
                bad(
                    "wrap.sync_batchnorm",
                    format!(
                        "{} runs its own layers: the runner cannot synchronise batch norm inside it; remove it (or \
                         use a built-in model kind, such as \"cnn\" with batch_norm blocks)",
                        arch.describe()
                    ),
                );
            } else if !arch.has_batch_norm() {
                bad(
                    "wrap.sync_batchnorm",
                    format!("{} has no batch norm layers to synchronise; remove it", arch.describe()),
                );
            } else if pipeline {
                bad(
                    "wrap.sync_batchnorm",
                    "is not available with wrap.strategy = \"pipeline\": each rank of a pipeline holds other layers, \
                     and a batch norm layer normalises each micro-batch on its own; synchronising over the pipeline's \
                     copies is not implemented (torch has no equivalent either). Use wrap.strategy = \"ddp\", or \
                     remove it"
                        .into(),
                );
            }
        }
        let init_weights = c.wrap.init.as_ref().map(|rel| base.join(rel));
        if let (Some(path), Some(arch)) = (&init_weights, &arch) {
            if let Err(e) = crate::model::read_weights(path, &crate::model::sorted_parameters(arch.as_ref())) {
                bad("wrap.init", e);
            }
        }
        let mut inputs = Vec::new();
        let mut files = vec![
            ("load.path", data.as_ref().and_then(|d| d.file.as_ref()).map(|f| f.path.clone())),
            ("load.path", data.as_ref().and_then(|d| d.tensors.as_ref()).map(|t| t.path.clone())),
            ("load.labels", data.as_ref().and_then(|d| d.tensors.as_ref()).and_then(|t| t.labels.clone())),
            ("load.path", data.as_ref().and_then(|d| d.tokens.as_ref()).map(|f| f.path.clone())),
            (
                "load.validation_path",
                data.as_ref().and_then(|d| d.file.as_ref()).and_then(|f| f.validation_path.clone()),
            ),
            ("wrap.init", init_weights.clone()),
        ];
        files.extend(crate::model::files(&model).into_iter().map(|(key, path)| (key, Some(path))));
        // A missing file is reported by the checks above.
        for (key, path) in files {
            match path.filter(|p| p.is_file()).map(|p| InputFile::read(key, &p)).transpose() {
                Ok(file) => inputs.extend(file),
                Err(e) => bad(key, e),
            }
        }

        let layer_parameters = arch.as_ref().map(|a| crate::model::layer_parameters(a.as_ref())).unwrap_or_default();
        let stages = if c.run.world_size > crate::limits::MAX_WORLD_SIZE {
            None
        } else if pipeline && matches!(c.wrap.model, Model::Torchscript(_)) {
            bad(
                "wrap.strategy",
                "a TorchScript module is one opaque graph to the runner: it cannot be cut into pipeline stages; use \"ddp\" \
                 (or a built-in model kind, whose layers a pipeline can split)"
                    .into(),
            );
            None
        } else if pipeline {
            pipeline_stages(&c, &sources, &layer_parameters, &mut bad)
        } else {
            // Compared with the defaults, not by source: a run's saved config.toml sets every key.
            let (p, default) = (&c.wrap.pipeline, Pipeline::default());
            for (key, set) in [
                ("wrap.pipeline.stages", p.stages != default.stages),
                ("wrap.pipeline.micro_batches", p.micro_batches != default.micro_batches),
                ("wrap.pipeline.schedule", p.schedule != default.schedule),
                ("wrap.pipeline.replicas", p.replicas != default.replicas),
            ] {
                if set {
                    bad(key, "is only read by wrap.strategy = \"pipeline\"".into());
                }
            }
            Some(vec![0..layer_parameters.len(); w])
        };
        if let (Some(stages), Some(arch), true) = (&stages, &arch, pipeline) {
            if let Err(e) = arch.check_stages(stages) {
                bad("wrap.model.tied", e);
            }
        }
        if let Some(l) = layout.as_ref().filter(|l| l.per_rank > 0 && t.batch_size > 0 && t.accumulate > 0) {
            let batch = l.split_batch.unwrap_or(t.batch_size);
            recipe_lengths(&c, l.per_rank.div_ceil(batch), &mut bad);
        }
        if let (Some(limit), Some(stages)) = (c.run.memory_per_rank_mb, &stages) {
            if !(limit > 0.0) {
                bad("run.memory_per_rank_mb", format!("must be positive MiB, got {limit}"));
            } else if !layer_parameters.is_empty() {
                if let Some(msg) = memory_check(limit, stages, &layer_parameters, pipeline) {
                    bad("run.memory_per_rank_mb", msg);
                }
            }
        }

        let mut memory = None;
        if let (Some(d), Some(stages), Some(arch)) = (&data, &stages, &arch) {
            let heaviest = stages.iter().map(|r| layer_parameters[r.clone()].iter().sum()).max().unwrap_or(0);
            let batch = layout.as_ref().and_then(|l| l.split_batch).unwrap_or(c.train.batch_size);
            let layers = arch.layers();
            let outputs = layers.iter().map(|l| l.output.iter().product::<usize>()).sum::<usize>();
            let held = layers.iter().map(|l| l.held).sum::<usize>();
            let estimate = crate::limits::estimate(&c, d, heaviest, d.input_size() + outputs, held, batch);
            let model_key = match c.wrap.model {
                Model::Transformer(_) => "wrap.model.d_model",
                _ => "wrap.model.hidden",
            };
            crate::limits::check_memory(&estimate, c.run.world_size, model_key, &mut bad);
            memory = Some(estimate);
        }
        if !errors.is_empty() {
            let n = errors.len();
            let head =
                if n == 1 { "invalid configuration".to_string() } else { format!("{n} problems in the configuration") };
            return Err(ConfigError::new(format!("{}: {head}:\n  {}", file.display(), errors.join("\n  "))));
        }
        let data = data.expect("checked above");
        let layout = layout.expect("checked above");
        let stages = stages.expect("checked above");
        let batch_per_rank = layout.split_batch.unwrap_or(c.train.batch_size);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads_per_rank = c.run.threads_per_rank.unwrap_or((cores / c.run.world_size).max(1));
        let parameters = layer_parameters.iter().sum();
        let run_id = run_id(&c, &inputs);
        Ok(Plan {
            config: c,
            sources,
            pipeline_file: file,
            run_id,
            data,
            layout,
            batch_per_rank,
            threads_per_rank,
            parameters,
            init_weights,
            inputs,
            layer_parameters,
            stages,
            memory,
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
        crate::rundir::manifest::Manifest::start(
            &self.run_id,
            &c.run.name,
            &self.pipeline_file,
            c.run.world_size,
            self.threads_per_rank,
        )
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

    /// The plan a launcher saved.
    pub fn load(path: &Path) -> Result<Plan, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(format!("cannot read the run's plan {}: {e}", path.display())))?;
        serde_json::from_str(&text).map_err(|e| {
            ConfigError::new(format!(
                "{} is not a plan this runner can read ({e}); it was written by another version, or damaged",
                path.display()
            ))
        })
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

    /// Optimizer steps per epoch: the batches, in groups of train.accumulate.
    pub fn optimizer_steps_per_epoch(&self) -> usize {
        self.steps_per_epoch().div_ceil(self.config.train.accumulate)
    }

    /// The resolved configuration as TOML, each value annotated with where it came from.
    pub fn annotated_toml(&self) -> String {
        let value =
            crate::config::schema::with_every_key(|| toml::Value::try_from(&self.config)).expect("a Config serializes");
        let mut out = format!(
            "# The resolved configuration of run {} (runner {}), from {}.\n\
             # Each value's comment says where it came from: default, file, env, --set or sweep axis.\n",
            self.run_id,
            env!("CARGO_PKG_VERSION"),
            self.pipeline_file.display()
        );
        let mut leaves = Vec::new();
        crate::config::resolve::flatten("", &value, &mut leaves);
        let mut section = String::new();
        for (key, v) in leaves {
            let (sec, name) = key.rsplit_once('.').unwrap_or(("", &key));
            if sec != section {
                out += &format!("\n[{sec}]\n");
                section = sec.to_owned();
            }
            let from = self.sources.get(&key).map(String::as_str).unwrap_or("default");
            // Relative to the pipeline file when written; absolute here, so that the file stays
            // valid from the run directory (runner run --resume reads it).
            let v = match self.inputs.iter().find(|f| f.key == key) {
                Some(f) => toml::Value::String(f.path.display().to_string()),
                None => v,
            };
            out += &format!("{name} = {v}  # {from}\n");
        }
        out
    }
}

/// The pipeline's checks; the layers of each rank, when they are valid.
fn pipeline_stages(
    c: &Config,
    sources: &BTreeMap<String, String>,
    layer_parameters: &[usize],
    bad: &mut impl FnMut(&str, String),
) -> Option<Vec<Range<usize>>> {
    let p = &c.wrap.pipeline;
    if p.replicas == 0 || !c.run.world_size.is_multiple_of(p.replicas) {
        bad(
            "wrap.pipeline.replicas",
            format!(
                "{} copies of the pipeline do not split run.world_size = {} evenly; use a divisor of it",
                p.replicas, c.run.world_size
            ),
        );
        return None;
    }
    // The stages of one copy; the copies repeat them.
    let w = c.run.world_size / p.replicas;
    if c.shard.strategy == ShardStrategy::Batch {
        bad(
            "shard.strategy",
            "a pipeline holds one model, not replicas, so it has no batches to split: every rank walks \
             the same batches; use \"dataset\""
                .into(),
        );
    }
    if p.micro_batches == 0 {
        bad("wrap.pipeline.micro_batches", "must be at least 1".into());
    } else if p.micro_batches > c.train.batch_size && c.train.batch_size > 0 {
        bad(
            "wrap.pipeline.micro_batches",
            format!(
                "{} micro-batches of a batch of {} rows would leave some empty; use at most {}",
                p.micro_batches, c.train.batch_size, c.train.batch_size
            ),
        );
    }
    if c.validate.on == ValidateOn::All {
        bad(
            "validate.on",
            "\"all\" validates every replica, but a pipeline is one model: its validation runs through \
             every rank; use \"rank0\""
                .into(),
        );
    }
    let layers = layer_parameters.len();
    if layers == 0 {
        return None;
    }
    let stages = match &p.stages {
        Some(stages) => {
            let ranges = match crate::model::partition::explicit(stages, layers) {
                Ok(r) => r,
                Err(e) => {
                    bad("wrap.pipeline.stages", e);
                    return None;
                }
            };
            if ranges.len() != w {
                let from = sources.get("run.world_size").map(String::as_str).unwrap_or("default");
                let ranks = if p.replicas == 1 {
                    format!("run.world_size ({from}) is {w}")
                } else {
                    format!("each of the {} copies has {w} ranks (run.world_size ({from}) / replicas)", p.replicas)
                };
                bad(
                    "wrap.pipeline.stages",
                    format!("lists {} stages but {ranks}; a pipeline has one stage per rank", ranges.len()),
                );
                return None;
            }
            Some(ranges)
        }
        None if w > layers => {
            bad(
                "run.world_size",
                format!(
                    "{w} ranks, but the model has {layers} layers ({} hidden + the output layer); a pipeline \
                     needs at least one layer per rank: use at most {layers} ranks, or more hidden layers",
                    layers - 1
                ),
            );
            None
        }
        None => crate::model::partition::balanced(layer_parameters, w),
    }?;
    Some((0..c.run.world_size).map(|r| stages[r % w].clone()).collect())
}

/// The training recipe's own values (schedule, clipping, accumulation, precision, early stopping).
fn recipe_values(c: &Config, validation_rows: Option<usize>, bad: &mut impl FnMut(&str, String)) {
    let t = &c.train;
    let s = &t.schedule;
    if t.accumulate == 0 {
        bad("train.accumulate", "must be at least 1 (1: an optimizer step per batch)".into());
    }
    if let Some(max) = t.clip_grad_norm {
        if !(max > 0.0 && max.is_finite()) {
            bad("train.clip_grad_norm", format!("must be a positive norm, got {max}"));
        }
    }
    match (t.precision, c.run.device) {
        (Precision::Fp16, Device::Cpu) => bad(
            "train.precision",
            "\"fp16\" (with dynamic loss scaling) needs a GPU: CPUs have no fast float16 arithmetic; use \"bf16\" on \
             CPU (autocast to bfloat16, float32 weights) or \"fp32\""
                .into(),
        ),
        (Precision::Fp16, Device::Cuda) => bad(
            "train.precision",
            "\"fp16\" with dynamic loss scaling is not built yet; use \"bf16\" (GPUs since Ampere compute in \
             bfloat16, which needs no loss scaling) or \"fp32\""
                .into(),
        ),
        _ => {}
    }
    if s.warmup_steps > 0 && s.warmup_epochs > 0 {
        bad("train.schedule.warmup_epochs", "give the warmup in steps or in epochs, not both".into());
    }
    let decays = matches!(s.kind, ScheduleKind::Linear | ScheduleKind::Cosine);
    if s.min_lr != 0.0 && !decays {
        bad("train.schedule.min_lr", "is only read by kind = \"linear\" or \"cosine\"".into());
    } else if decays && !(s.min_lr >= 0.0 && s.min_lr < t.lr) {
        bad("train.schedule.min_lr", format!("must be in [0, train.lr = {}), got {}", t.lr, s.min_lr));
    }
    if s.kind == ScheduleKind::Step {
        if (s.step_size > 0) == (s.step_epochs > 0) {
            bad(
                "train.schedule.step_size",
                "kind = \"step\" needs step_size (optimizer steps) or step_epochs, one of them".into(),
            );
        }
        if let Some(g) = s.gamma.filter(|g| !(*g > 0.0 && *g <= 1.0)) {
            bad("train.schedule.gamma", format!("must be in (0, 1], got {g}"));
        }
    } else {
        for (key, set) in [
            ("train.schedule.step_size", s.step_size > 0),
            ("train.schedule.step_epochs", s.step_epochs > 0),
            ("train.schedule.gamma", s.gamma.is_some()),
        ] {
            if set {
                bad(key, "is only read by kind = \"step\"".into());
            }
        }
    }
    if let Some(e) = &t.early_stop {
        let why = "[train.early_stop] watches a validation metric: validate, or remove [train.early_stop]";
        if c.validate.every == 0 {
            bad("validate.every", format!("is 0 (no validation), but {why}"));
        } else if validation_rows == Some(0) {
            bad("load.validation_rows", format!("is 0 (no validation rows), but {why}"));
        }
        if e.patience == 0 {
            bad("train.early_stop.patience", "must be at least 1 validation".into());
        }
        if !(e.min_delta >= 0.0 && e.min_delta.is_finite()) {
            bad("train.early_stop.min_delta", format!("must be 0 or more, got {}", e.min_delta));
        }
    }
}

/// The recipe's checks against the run's length: `batches` per epoch on a rank.
fn recipe_lengths(c: &Config, batches: usize, bad: &mut impl FnMut(&str, String)) {
    let t = &c.train;
    if t.accumulate > batches {
        bad(
            "train.accumulate",
            format!(
                "{} batches per optimizer step, but an epoch has only {batches} batches per rank; use at most {batches}",
                t.accumulate
            ),
        );
        return;
    }
    let steps = batches.div_ceil(t.accumulate);
    let s = schedule::Schedule::new(&t.schedule, t.lr, t.epochs, steps);
    if s.warmup >= s.total && s.warmup > 0 {
        let key =
            if t.schedule.warmup_epochs > 0 { "train.schedule.warmup_epochs" } else { "train.schedule.warmup_steps" };
        bad(
            key,
            format!(
                "the warmup ({} optimizer steps) is as long as the run or longer ({} epochs × {steps} steps = {}); \
                 shorten it",
                s.warmup, t.epochs, s.total
            ),
        );
    }
}

pub use crate::model::{layers_text, parameter_mib};

/// Why the heaviest rank's parameters (float32) exceed `limit` MiB, and what would fit.
fn memory_check(limit: f64, stages: &[Range<usize>], layer_parameters: &[usize], pipeline: bool) -> Option<String> {
    let params = |r: &Range<usize>| layer_parameters[r.clone()].iter().sum::<usize>();
    let (rank, heaviest) = stages.iter().enumerate().rev().max_by_key(|(_, r)| params(r))?;
    let mib = parameter_mib;
    if mib(params(heaviest)) <= limit {
        return None;
    }
    let what = if heaviest.len() == layer_parameters.len() {
        format!("the whole model, {}", layers_text(heaviest))
    } else {
        layers_text(heaviest)
    };
    let fits = (1..=layer_parameters.len()).find(|&n| {
        crate::model::partition::balanced(layer_parameters, n)
            .is_some_and(|split| split.iter().all(|r| mib(params(r)) <= limit))
    });
    let advice = match fits {
        // Only explicit stages can be over the limit where a balanced split of as many fits.
        Some(n) if pipeline && n <= stages.len() => format!(
            "give rank {rank} fewer layers in wrap.pipeline.stages, or leave them out: the split balanced by \
             parameters fits"
        ),
        Some(n) if pipeline => {
            format!("split the model over at least {n} ranks (run.world_size = {n}), or use a smaller model")
        }
        Some(n) => format!(
            "split the model with wrap.strategy = \"pipeline\" over at least {n} ranks (run.world_size = {n}), \
             or use a smaller model"
        ),
        None => {
            let (i, p) = layer_parameters.iter().enumerate().rev().max_by_key(|(_, p)| **p).expect("layers");
            format!("even layer {i} alone holds {:.3} MiB: use a smaller model", mib(*p))
        }
    };
    Some(format!(
        "rank {rank} would hold {what} ({} parameters, {:.3} MiB as float32), more than the {limit} MiB a rank may \
         hold; {advice}",
        params(heaviest),
        mib(params(heaviest))
    ))
}

fn file_spec(
    c: &Config,
    source: Source,
    base: &std::path::Path,
    bad: &mut impl FnMut(&str, String),
) -> Option<DataSpec> {
    let load = &c.load;
    let Some(rel) = &load.path else {
        bad(
            "load.path",
            format!("source = \"{}\" needs a path to the file", if source == Source::Csv { "csv" } else { "parquet" }),
        );
        return None;
    };
    let Some(target) = &load.target else {
        bad("load.target", "names the column to predict; it is required for files".into());
        return None;
    };
    if load.noise != Load::default().noise {
        bad("load.noise", "is only read by source = \"synthetic\"".into());
    }
    if load.image.is_some() {
        bad("load.image", "is only read by source = \"synthetic\"; a file's columns are features".into());
    }
    if load.labels.is_some() {
        bad("load.labels", "is only read by source = \"tensors\"".into());
    }
    // Compared with the default, not by source: a run's saved config.toml sets every key.
    if load.validation_rows != Load::default().validation_rows {
        bad(
            "load.validation_rows",
            "is only read by source = \"synthetic\"; a file's validation rows are validate.fraction (default 0.2), \
             validate.rows or load.validation_path"
                .into(),
        );
    }
    let delimiter = match load.delimiter.as_deref() {
        None => b',',
        Some(d) if d.len() == 1 && source == Source::Csv => d.as_bytes()[0],
        Some(d) if source != Source::Csv => {
            bad("load.delimiter", format!("{d:?} is only read by source = \"csv\""));
            b','
        }
        Some(d) => {
            bad("load.delimiter", format!("{d:?} is not one ASCII character; use e.g. \";\" or \"\\t\""));
            b','
        }
    };
    let v = &c.validate;
    let holdout = match (&load.validation_path, v.fraction, v.rows) {
        (Some(_), None, None) => None,
        (Some(_), _, _) => {
            bad("load.validation_path", "holds the validation rows: remove validate.fraction and validate.rows".into());
            None
        }
        (None, Some(_), Some(_)) => {
            bad("validate.rows", "and validate.fraction both set the validation rows: keep one".into());
            None
        }
        (None, _, Some(r)) => Some(Holdout::Rows(r)),
        (None, f, None) => {
            let f = f.unwrap_or(0.2);
            if !(0.0..1.0).contains(&f) {
                bad("validate.fraction", format!("must be in [0, 1), got {f}"));
                return None;
            }
            Some(Holdout::Fraction(f))
        }
    };
    let path = base.join(rel);
    if let Err(e) = path.exists().then(|| crate::input::regular_file(&path)).transpose() {
        bad("load.path", e);
        return None;
    }
    let vpath = load.validation_path.as_ref().map(|p| base.join(p));
    if let Some(vp) = &vpath {
        if let Err(e) = crate::input::regular_file(vp) {
            bad("load.validation_path", e);
            return None;
        }
    }
    let names = match &load.features {
        Some(Features::Columns(names)) => Some(names.as_slice()),
        _ => None,
    };
    let choice = crate::data::columns::Choice {
        target,
        features: names,
        exclude: &load.exclude,
        missing: load.missing,
        task: c.train.task,
    };
    let limit = load.rows;
    let (mut info, rows) =
        match file::inspect(&path, source, delimiter, limit, &choice, holdout, c.run.seed, vpath.as_deref()) {
            Ok(found) => found,
            Err(e) => {
                let key = if vpath.as_ref().is_some_and(|v| e.contains(&v.display().to_string())) {
                    "load.validation_path"
                } else {
                    "load.path"
                };
                bad(key, e);
                return None;
            }
        };
    let width = rows.width;
    if let Some(asked) = limit.filter(|&r| r > info.file_rows) {
        bad("load.rows", format!("asks for {asked} rows but {} has {}", path.display(), info.file_rows));
    }
    if let Some(Features::Count(f)) = load.features {
        if f != width {
            bad("load.features", format!("is {f} but {} gives {width} inputs besides `{target}`", path.display()));
        }
    }
    let task = match info.columns.classes() {
        Some(names) => {
            let k = names.len();
            if let Some(classes) = load.classes.filter(|&n| n != k) {
                bad("load.classes", format!("is {classes} but `{target}` holds {k} classes ({})", names.join(", ")));
            }
            let count = |y: &[f64]| {
                let mut n = vec![0usize; k];
                y.iter().for_each(|&c| n[c as usize] += 1);
                n
            };
            let (train, val) = (count(&rows.train_y), count(&rows.val_y));
            let lacking: Vec<&str> = (0..k).filter(|&c| train[c] == 0).map(|c| names[c].as_str()).collect();
            if !lacking.is_empty() {
                bad(
                    "load.path",
                    format!(
                        "the training rows hold no row of class {}: the model could never learn it (a separate \
                         validation file with classes the training file lacks, or too few rows?)",
                        lacking.join(", ")
                    ),
                );
            }
            for (side, n, total) in [("training", &train, rows.train_y.len()), ("validation", &val, rows.val_y.len())] {
                let rare: Vec<String> = (0..k)
                    .filter(|&c| total > 0 && (n[c] as f64) < 0.01 * total as f64)
                    .map(|c| format!("{} ({} of {total})", names[c], n[c]))
                    .collect();
                if !rare.is_empty() {
                    info.notes.push(format!("warning: classes under 1% of the {side} rows: {}", rare.join(", ")));
                }
            }
            Task::Classification { classes: k }
        }
        None => {
            if load.classes.is_some() {
                bad("load.classes", "is only read by train.task = \"classification\"".into());
            }
            Task::Regression
        }
    };
    let constant = constant_inputs(&rows.train_x, width, &info.columns.input_names());
    if !constant.is_empty() {
        info.notes.push(format!("constant over the training rows (normalised with scale 1): {}", constant.join(", ")));
    }
    if rows.train_y.is_empty() {
        bad("validate.fraction", format!("leaves no training rows out of {}", info.rows));
        return None;
    }
    Some(DataSpec {
        source,
        rows: rows.train_y.len(),
        input: vec![width],
        task,
        validation_rows: rows.val_y.len(),
        noise: 0.0,
        file: Some(FileInfo { path, ..info }),
        tokens: None,
        tensors: None,
    })
}

/// Inputs whose training values are constant, or nearly: the normalizer gives them scale 1.
fn constant_inputs(x: &[f32], width: usize, names: &[String]) -> Vec<String> {
    (0..width)
        .filter(|&j| {
            let (lo, hi) = x
                .iter()
                .skip(j)
                .step_by(width)
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            crate::data::normalize::is_constant((hi - lo) as f64, lo.abs().max(hi.abs()) as f64)
        })
        .map(|j| names[j].clone())
        .collect()
}

/// 12 hex digits of FNV-1a over the resolved configuration's canonical JSON and the content
/// digests of the files the run reads: the same configuration over the same files is the same
/// run, and an edited data file is another.
fn run_id(c: &Config, inputs: &[InputFile]) -> String {
    let mut bytes = serde_json::to_string(c).expect("a Config serializes").into_bytes();
    for f in inputs {
        bytes.extend(f.digest.as_bytes());
    }
    format!("{:012x}", crate::rng::fnv1a(&bytes) >> 16)
}
