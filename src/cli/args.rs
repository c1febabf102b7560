//! The arguments of each command.
use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::config::ConfigError;
use crate::launch::elastic::Nodes;
use crate::launch::engines;
use crate::launch::spawn::Topology;

#[derive(Debug, Args)]
pub struct SchemaArgs {
    /// Print the configuration reference instead, as Markdown: every key with its type, default
    /// and doc comment (docs/reference/configuration.md is this output).
    #[arg(long)]
    pub markdown: bool,
}

#[derive(Debug, Subcommand)]
pub enum PrepareCommand {
    /// A UTF-8 text as nanoGPT's prepare.py makes it: train.bin and val.bin (uint16 ids, the
    /// first 90% of the tokens and the rest; train.npy and val.npy of uint32 past 65,536 ids)
    /// and the vocabulary: meta.json (characters) or tokenizer.json.
    #[command(after_help = "Examples:\n  runner prepare text pipelines/data/tempest.txt --out data/book\n  \
                            runner prepare text pipelines/data/tempest.txt --out data/bpe --tokenizer bpe --vocab 1024\n\n\
                            Read: docs/guide/language-models.md")]
    Text {
        /// The text file.
        file: PathBuf,
        /// The folder the files go to (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Replace the files of an earlier prepare in DIR.
        #[arg(long)]
        force: bool,
        /// The vocabulary: `chars` (the text's characters, meta.json), `bpe` (a byte-level BPE
        /// trained on the text, tokenizer.json; needs --vocab), or a Hugging Face tokenizer.json
        /// file (copied to DIR/tokenizer.json).
        #[arg(long, value_name = "chars|bpe|FILE", default_value = "chars")]
        tokenizer: String,
        /// The most tokens the BPE may have (with --tokenizer bpe).
        #[arg(long, value_name = "N")]
        vocab: Option<usize>,
    },
}

#[derive(Debug, Args)]
pub struct PredictArgs {
    /// The run directory (results/<name>/<run-id>).
    pub run_dir: PathBuf,
    /// A csv or parquet file with the run's feature columns, or arrays shaped as the model's
    /// inputs: an .npy file of x, or an .npz file of x (and y, for the metrics).
    #[arg(required_unless_present = "prompt")]
    pub data: Option<PathBuf>,
    /// The weights: final (model.safetensors), best (model.best.safetensors, kept by
    /// [train.early_stop]), or the path of a .safetensors file of the same model.
    #[arg(long, value_name = "final|best|FILE", default_value = "final", conflicts_with = "prompt")]
    pub model: crate::predict::ModelChoice,
    /// How the new file is read: load.missing (e.g. --set load.missing='"drop"') or
    /// load.delimiter; the columns, encodings and normalisation are the run's.
    #[arg(long = "set", value_name = "KEY=VALUE", conflicts_with = "prompt")]
    pub set: Vec<String>,
    /// Where the predictions go [default: RUN_DIR/predictions.parquet]
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    pub out: Option<PathBuf>,
    /// A language model: the text to continue (in the run's vocabulary).
    #[arg(long, conflicts_with = "data")]
    pub prompt: Option<String>,
    /// New tokens to sample after the prompt.
    #[arg(long, default_value_t = 500, requires = "prompt")]
    pub tokens: usize,
    /// Divides the logits: below 1 sharper, above 1 more random.
    #[arg(long, default_value_t = 0.8, requires = "prompt")]
    pub temperature: f64,
    /// Draw only among the k most likely tokens.
    #[arg(long, default_value_t = 200, requires = "prompt")]
    pub top_k: usize,
    /// Seeds the draws: the same seed, the same text.
    #[arg(long, default_value_t = 1337, requires = "prompt")]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The run directory (results/<name>/<run-id>) of a finished transformer.
    pub run_dir: PathBuf,
    /// Write a Hugging Face model directory here (config.json, model.safetensors): what
    /// transformers' from_pretrained, vLLM and lm-eval load. It must not exist, or be empty.
    /// A LoRA run's model is written merged (W + (alpha/r)·B·A).
    #[arg(long, value_name = "OUT_DIR", required_unless_present = "peft")]
    pub hf: Option<PathBuf>,
    /// Write a LoRA run's adapters here as PEFT saves them (adapter_config.json,
    /// adapter_model.safetensors): what PeftModel.from_pretrained loads over the run's wrap.init.
    #[arg(long, value_name = "OUT_DIR")]
    pub peft: Option<PathBuf>,
    /// Shards of at most this size past it, with model.safetensors.index.json ("5GB", "200MB", "512MiB", as
    /// transformers reads sizes).
    #[arg(long, value_name = "SIZE", default_value = crate::export::DEFAULT_SHARD)]
    pub max_shard_size: String,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The run directory of a language model (results/<name>/<run-id>), or a Hugging Face model
    /// directory (config.json and its weights; a text is encoded with its tokenizer.json).
    #[arg(required_unless_present = "job")]
    pub run_dir: Option<PathBuf>,
    /// A token file (.bin of uint16 ids, .npy) or a UTF-8 text, encoded with the run's tokenizer.
    #[arg(required_unless_present = "job")]
    pub data: Option<PathBuf>,
    /// Ranks sharing the windows [default: the run's run.world_size]
    #[arg(long, value_name = "N")]
    pub world_size: Option<usize>,
    /// Windows per forward pass on each rank [default: the run's train.batch_size; 8 for a model directory]
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Tokens per window [default: the run's wrap.model.seq_len; a model directory's max_position_embeddings]
    #[arg(long, value_name = "N")]
    pub seq_len: Option<usize>,
    /// Print the results as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The evaluation a launcher saved (`runner eval` passes it to the ranks it spawns).
    #[arg(long, value_name = "JOB_JSON", hide = true, conflicts_with_all = ["run_dir", "data"])]
    pub job: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// One repetition per cell; print the results, do not write them.
    #[arg(long)]
    pub quick: bool,
    /// Repetitions per workload and world size, runner and PyTorch alternating.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub repetitions: u64,
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4", value_parser = clap::value_parser!(u64).range(1..=64))]
    pub world_sizes: Vec<u64>,
    /// Only these workloads (repeatable, or comma-separated) [default: all]
    #[arg(long = "workload", value_name = "NAME", value_delimiter = ',', value_parser = ["overhead-bound", "compute-bound", "cnn", "transformer", "fsdp", "tp"])]
    pub workloads: Vec<String>,
    /// Where the results go (the part between the markers is replaced; notes around it are kept).
    #[arg(long, value_name = "FILE", default_value = "benches/RESULTS.md")]
    pub out: PathBuf,
    /// Precisions, comma-separated: fp32, and bf16 (the runner's train.precision = "bf16" against
    /// torch.autocast("cpu", dtype=torch.bfloat16)); each workload runs in each.
    #[arg(long, value_delimiter = ',', default_value = "fp32", value_parser = ["fp32", "bf16"])]
    pub precision: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// The pipeline file (TOML).
    pub file: PathBuf,
    /// Override a value, e.g. --set train.lr=0.05 (repeatable; wins over file and environment).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// An override with the source config.toml names for it (`runner sweep` passes its axes so).
    #[arg(long = "set-as", num_args = 2, value_names = ["LABEL", "KEY=VALUE"], hide = true)]
    pub set_as: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Plan the run for this device (run.device), which this build and this machine need not
    /// have: a GPU run planned on a CPU machine, with the device's memory estimate. The checks
    /// of run.device and run.backend against this build and machine, and of the memory this
    /// machine has, are left out; nothing runs.
    #[arg(long, value_parser = ["cpu", "cuda"])]
    pub device: Option<String>,
}

#[derive(Debug, Args)]
pub struct DataArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Rows shown of each stage's output (instruction data: the examples shown).
    #[arg(long, default_value_t = 5)]
    pub rows: usize,
    /// Only this rank's shard [default: every rank's]
    #[arg(long)]
    pub rank: Option<usize>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The pipeline file (TOML); with --resume, defaults to the run directory's config.toml.
    #[arg(required_unless_present_any = ["resume", "plan"])]
    pub file: Option<PathBuf>,
    /// The resolved plan a launcher saved (`runner run` passes it to the ranks it spawns).
    #[arg(long, value_name = "PLAN_JSON", hide = true, conflicts_with = "file")]
    pub plan: Option<PathBuf>,
    /// Override a value, e.g. --set train.lr=0.05 (repeatable; wins over file and environment).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// An override with the source config.toml names for it (`runner sweep` passes its axes so).
    #[arg(long = "set-as", num_args = 2, value_names = ["LABEL", "KEY=VALUE"], hide = true)]
    pub set_as: Vec<String>,
    /// The run directory [default: results/<run.name>/<run-id>]
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub out: Option<PathBuf>,
    /// Continue the run in DIR from its newest checkpoint, on every rank.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Run in --out even when it holds files the runner did not write or another run's
    /// results (the runner still only replaces its own files there).
    #[arg(long, conflicts_with = "resume")]
    pub force: bool,
    /// Number of nodes, one `runner run` on each (as torchrun's --nnodes): N, or MIN:MAX for an
    /// elastic run that goes on with at least MIN nodes when some are lost, and takes them back
    /// at a checkpoint [default: SLURM_NNODES, PET_NNODES or SKYPILOT_NUM_NODES, else 1]
    #[arg(long, value_name = "N|MIN:MAX")]
    pub nnodes: Option<Nodes>,
    /// This node's index, 0 to nnodes - 1; node 0 hosts the rendezvous store [default:
    /// SLURM_NODEID, PET_NODE_RANK or SKYPILOT_NODE_RANK, else 0]
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Node 0's address, reachable from every node (needed with --nnodes > 1) [default: the
    /// first host of SLURM_JOB_NODELIST, PET_MASTER_ADDR, or the first of SKYPILOT_NODE_IPS]
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// The port of node 0's rendezvous store [default: under Slurm, 15000 + the job id's last
    /// four digits; PET_MASTER_PORT; otherwise 29500]
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
}

/// A value given as a flag, or else by an engine's variable, or else a default: the value and
/// how to name it in a message.
fn flag_or_engine<T: Clone + std::fmt::Display>(
    flag: Option<T>,
    name: &str,
    engine: Option<&engines::Said<T>>,
    default: T,
) -> (T, String) {
    match (flag, engine) {
        (Some(v), _) => (v.clone(), format!("{name} {v}")),
        (None, Some(said)) => (said.value.clone(), said.from.clone()),
        (None, None) => (default.clone(), format!("{name} {default}")),
    }
}

impl RunArgs {
    /// The job's nodes: from the flags, else from the engine that started this node (Slurm,
    /// Kubeflow TrainJob, SkyPilot: [`engines`]), else one node.
    pub(super) fn topology(&self, world_size: usize) -> Result<Topology, ConfigError> {
        let fail = |m: String| Err(ConfigError::new(m));
        let said = engines::from_env().map_err(ConfigError::new)?;
        let nodes = self.nnodes.or(said.nnodes.as_ref().map(|s| s.value));
        let nnodes = nodes.map_or(1, |n| n.max);
        let nnodes_from = match (&self.nnodes, &said.nnodes) {
            (Some(_), _) | (_, None) => format!("--nnodes {nnodes}"),
            (None, Some(s)) => s.from.clone(),
        };
        if let Some(per_node) = &said.per_node {
            if per_node.value * nnodes != world_size {
                return fail(format!(
                    "{} over {nnodes_from} nodes starts {} ranks, but run.world_size is {world_size}: set \
                     run.world_size = {}, or start {} ranks per node",
                    per_node.from,
                    per_node.value * nnodes,
                    per_node.value * nnodes,
                    world_size / nnodes.max(1)
                ));
            }
        }
        if nnodes <= 1 {
            return Ok(Topology::single());
        }
        let (node_rank, node_from) = flag_or_engine(self.node_rank, "--node-rank", said.node_rank.as_ref(), 0);
        if node_rank >= nnodes {
            return fail(format!("{node_from} must be below {nnodes_from}"));
        }
        if !world_size.is_multiple_of(nnodes) {
            return fail(format!(
                "run.world_size ({world_size}) must divide evenly over {nnodes_from} (ranks per node)"
            ));
        }
        let Some(addr) = self.master_addr.clone().or(said.master_addr.as_ref().map(|s| s.value.clone())) else {
            return fail(format!("{nnodes_from} needs --master-addr, the address of node 0 that every node can reach"));
        };
        let (port, _) = flag_or_engine(self.master_port, "--master-port", said.master_port.as_ref(), 29500);
        let min_nodes = nodes.map_or(nnodes, |n| n.min);
        Ok(Topology { nnodes, min_nodes, node_rank, master: Some((addr, port)), engine: said.describe() })
    }
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    /// The experiment file (TOML): a pipeline, [set], [sweep], [scaling] and [search].
    pub file: PathBuf,
    /// The sweep directory [default: results/<experiment file stem>]
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Stop at the first point that fails (otherwise it is recorded and the sweep goes on).
    #[arg(long)]
    pub fail_fast: bool,
    /// Run points again even when they are already complete with the same configuration.
    #[arg(long, conflicts_with = "check")]
    pub force: bool,
    /// Rerun every point into a temporary directory and compare every non-timing trace value
    /// with the stored ones; exit 1 listing every difference.
    #[arg(long)]
    pub check: bool,
    /// Where the points run: local, one after another; slurm, each an sbatch job with the
    /// experiment file's [slurm] resources (srun tasks as ranks, requeued when preempted).
    #[arg(long, value_enum, default_value = "local")]
    pub launcher: crate::sweep::Launcher,
    /// With --check: float values whose relative difference is at most this count as equal
    /// (for results stored on another CPU where a path is not CPU-independent); the largest
    /// difference found is reported. Default: bit for bit.
    #[arg(long, value_name = "REL", requires = "check", value_parser = tolerance, allow_hyphen_values = true)]
    pub tolerance: Option<f64>,
}

/// A relative tolerance: a finite number, 0 or more (`nan` would accept nothing and `inf`
/// everything, a negative one nothing).
fn tolerance(text: &str) -> Result<f64, String> {
    let t: f64 =
        text.trim().parse().map_err(|_| format!("`{text}` is not a number (a relative difference, e.g. 1e-6)"))?;
    if !t.is_finite() || t < 0.0 {
        return Err(format!(
            "{t} is not a relative difference: give a finite number, 0 or more (e.g. 1e-6; 0 checks bit for bit)"
        ));
    }
    if t >= 1.0 {
        return Err(format!(
            "{t} would accept any two values of the same sign (a relative difference |a - b| / max(|a|, |b|) is below \
             1): give a tolerance below 1, e.g. 1e-6"
        ));
    }
    Ok(t)
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The sweep directory (holding sweep.json), e.g. results/world_size.
    pub dir: PathBuf,
}
