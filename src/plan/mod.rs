//! The `Plan`: a configuration checked as a whole (values, cross-field rules, data files) with
//! every shape known before any rank starts. The launcher builds it once and saves it in the run
//! directory (`plan.json`); ranks and `--resume` load it. Nothing downstream re-checks the
//! configuration. Each concept's checks live in their own module: [`data`] (the load stage),
//! [`recipe`] (training values and the run's length), [`stages`] (which layers each rank holds),
//! [`input`] (the files read and the run id).
mod annotate;
pub mod auto_mesh;
mod build;
mod data;
pub mod device_memory;
mod flow;
pub mod graphs;
mod input;
pub mod memory;
pub mod mesh;
mod model;
mod probe;
mod recipe;
mod recovery;
mod resume;
mod saved;
pub mod schedule;
mod stage_memory;
mod stages;
mod strategy;
pub mod traffic;
mod values;
mod vocabulary;

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
    /// Under a pipeline, what each rank needs (its stage's state and activations); `memory` is
    /// the heaviest rank's. Empty: every rank needs `memory`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_by_rank: Vec<crate::limits::Estimate>,
    /// Keys a resume extended (`train.epochs`), with their values when the run started: the run
    /// id is the digest of that first configuration.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub started_with: saved::StartedWith,
    /// The training state one rank holds under the strategy, and under DDP for comparison (where
    /// the strategy is another and DDP's could be sized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<(memory::State, Option<memory::State>)>,
    /// With `wrap.strategy = "auto"`: the strategy the plan chose (config.wrap holds it) and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto: Option<String>,
    /// With `run.memory_per_rank_mb` and a configured strategy: why the plan turned activation
    /// checkpointing on (config.wrap holds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpointing_chosen: Option<String>,
    /// The vocabulary beside a token file (`tokenizer.json` or `meta.json`), which `runner predict
    /// --prompt` and `runner eval` encode and decode with ([`Plan::read_vocabulary`]):
    /// recorded to tell it from another file, and left out of the run id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocabulary: Option<InputFile>,
    /// Each resume that changed the world size or the strategy (into the manifest).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reshards: Vec<crate::rundir::manifest::Reshard>,
}

/// Where a plan's run is to run: the checks against this build and this machine (the device,
/// NCCL, the memory available) are for this machine only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Machine {
    This,
    Another,
}

/// What the configuration a run resumes with must keep of the run: its plan is made knowing it.
#[derive(Debug, Clone)]
pub struct Resuming {
    /// Samples per optimizer step: every world size and strategy the plan advises must keep it.
    pub global_batch: usize,
    /// The source of the run's own `config.toml` (`file DIR/config.toml`): its values for the
    /// strategy the run had are not refused under the strategy it resumes with.
    pub own_config: String,
}

impl Plan {
    /// Checks everything and reports every problem found, not just the first.
    pub fn new(resolved: Resolved) -> Result<Plan, ConfigError> {
        Plan::build(resolved, None, Machine::This)
    }

    /// The plan of a run on another machine (`runner validate --device`): everything but the
    /// checks of `run.device`, `run.backend` and the memory available against this build and
    /// this machine.
    pub fn elsewhere(resolved: Resolved) -> Result<Plan, ConfigError> {
        Plan::build(resolved, None, Machine::Another)
    }

    /// The plan of the configuration a run resumes with (see [`Resuming`]), before
    /// [`Plan::resumed`] continues the run's own plan under it.
    pub fn resuming(resolved: Resolved, resuming: &Resuming) -> Result<Plan, ConfigError> {
        Plan::build(resolved, Some(resuming), Machine::This)
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
            // A copy of the model is a pipeline's stages, each split across the tensor ranks.
            ranks_per_copy: self.world_size() / self.layout.world_size.max(1),
            tensor: self.mesh().tensor,
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
        crate::model::architecture(&model, &self.data.input, self.data.task.outputs(), self.config.wrap.lora.as_ref())
    }

    /// The per-sample shapes flowing into and out of layers `layers` on one rank: under sequence
    /// parallelism, a tensor rank's part of the sequence between the embedding and the head.
    pub fn stage_shapes(&self, layers: &Range<usize>) -> (Vec<i64>, Vec<i64>) {
        let all = self.model().layers();
        let parts = if self.config.wrap.mesh.sequence_parallel { self.mesh().tensor } else { 1 };
        let shape = |l: usize| {
            let mut s: Vec<i64> = all[l].output.iter().map(|&d| d as i64).collect();
            if l + 1 < all.len() {
                s[0] /= parts as i64;
            }
            s
        };
        let input = match layers.start {
            0 => self.data.input.iter().map(|&d| d as i64).collect(),
            l => shape(l - 1),
        };
        (input, shape(layers.end - 1))
    }

    /// Writes the plan to `path` (the run directory's plan.json), atomically, with each rank's
    /// predicted bytes sent per step ([`traffic::predict`]: derived, so not read back).
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let mut value = serde_json::to_value(self)?;
        if let (Ok(sent), Some(fields)) = (traffic::predict(self), value.as_object_mut()) {
            fields.insert("sent_per_step_predicted".into(), serde_json::to_value(sent)?);
        }
        let json = serde_json::to_string_pretty(&value)? + "\n";
        crate::rundir::atomic_write(path, json.as_bytes())
    }

    /// Writes the run's plan.json, config.toml and manifest: before a fresh run starts its ranks;
    /// for a resume (which may extend, reshard or restart the run), once every rank accepted its
    /// plan and loaded the checkpoint, so that a resume that fails first leaves the directory as
    /// it was.
    pub fn commit_run_dir(&self, run_dir: &Path, manifest: &crate::rundir::manifest::Manifest) -> anyhow::Result<()> {
        use crate::rundir::{atomic_write, CONFIG, PLAN, STOPPED};
        // Written again if the resumed run stops early.
        let _ = std::fs::remove_file(run_dir.join(STOPPED));
        self.save(&run_dir.join(PLAN))?;
        atomic_write(&run_dir.join(CONFIG), self.annotated_toml().as_bytes())?;
        manifest.write(run_dir)
    }

    /// The `run.numerics` of the plan saved at `path`, read before the process computes anything
    /// (the plan itself is loaded and checked later); the default where it cannot be read (the
    /// load then says why).
    pub fn numerics_in(path: &Path) -> CpuNumerics {
        let read = || -> Option<CpuNumerics> {
            let text = std::fs::read_to_string(path).ok()?;
            let value: serde_json::Value = serde_json::from_str(&text).ok()?;
            match value.get("config")?.get("run")?.get("numerics") {
                Some(numerics) => serde_json::from_value(numerics.clone()).ok(),
                // What a stored configuration leaves out (see `Run::numerics`).
                None => Some(CpuNumerics::stored()),
            }
        };
        read().unwrap_or_default()
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

    /// The device mesh: how many ranks each dimension has, and which ranks form each group.
    pub fn mesh(&self) -> mesh::Shape {
        mesh::Shape::of(&self.config)
    }

    pub fn is_pipeline(&self) -> bool {
        self.config.wrap.strategy == WrapStrategy::Pipeline
    }

    /// Whether batch norm layers normalise by the statistics of every rank's batch in training:
    /// `wrap.sync_batchnorm` under DDP or FSDP over more than one rank. With one rank, or ranks
    /// that train alone (`wrap.strategy = "none"`), it is plain batch norm, as torch's
    /// SyncBatchNorm is then.
    pub fn syncs_batch_norm(&self) -> bool {
        let c = &self.config;
        c.wrap.sync_batchnorm && self.is_data_parallel() && self.world_size() > 1
    }

    /// Whether the ranks train one model on their shards of the data, gradients averaged (DDP or
    /// FSDP).
    pub fn is_data_parallel(&self) -> bool {
        matches!(self.config.wrap.strategy, WrapStrategy::Ddp | WrapStrategy::Fsdp)
    }

    pub fn is_sharded(&self) -> bool {
        self.config.wrap.strategy == WrapStrategy::Fsdp
    }

    /// Replicas of the model each rank computes at once on its threads (`wrap.threads_per_replica`).
    pub fn thread_replicas(&self) -> usize {
        self.config.wrap.threads_per_replica.map_or(1, |t| (self.threads_per_rank / t.max(1)).max(1))
    }

    /// Intra-op threads of each of those replicas.
    pub fn threads_per_replica(&self) -> usize {
        (self.threads_per_rank / self.thread_replicas()).max(1)
    }

    /// Whose dropout masks `rank` draws: its own, but under tensor parallelism those of its data
    /// index (every rank of a tensor group drops the same values of the activations they share,
    /// the masks DDP's rank of that index draws).
    pub fn dropout_rank(&self, rank: usize) -> usize {
        let mesh = self.mesh();
        if mesh.tensor > 1 {
            mesh.coords(rank).data
        } else {
            rank
        }
    }

    /// Which shard of the data `rank` walks: its own, or its pipeline's.
    pub fn replica(&self, rank: usize) -> usize {
        if self.is_pipeline() {
            rank / self.pipeline_ranks()
        } else {
            // The ranks of a tensor group hold one copy between them.
            self.mesh().coords(rank).data
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

    /// Stages of the pipeline (each split across the tensor ranks under pipeline × TP); 1 for the
    /// other strategies.
    pub fn pipeline_stages(&self) -> usize {
        self.pipeline_ranks() / self.mesh().tensor.max(1)
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
