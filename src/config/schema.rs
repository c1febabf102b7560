//! The pipeline file's sections, one struct per stage, every field with its default.
//! Unknown keys are errors (`deny_unknown_fields`); kinds are closed enums.
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub run: Run,
    pub load: Load,
    pub shard: Shard,
    pub normalize: Normalize,
    pub wrap: Wrap,
    pub train: Train,
    pub validate: Validate,
    pub trace: Trace,
    pub checkpoint: Checkpoint,
    #[serde(skip_serializing_if = "is_default")]
    pub track: Track,
}

/// `[checkpoint]`: when rank 0 writes a checkpoint a run can resume from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Checkpoint {
    /// Write a checkpoint every this many epochs (and after the last); 0: never.
    pub every: usize,
    /// Write a checkpoint every this many optimizer steps (and after the last), mid-epoch too,
    /// with the data position: a run resumes exactly from any of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub every_steps: Option<usize>,
    /// Checkpoints kept; older ones are deleted.
    pub keep: usize,
    /// Write checkpoints in the background: at the step each rank copies its share of the state
    /// to memory and training goes on while a thread writes it; the checkpoint counts once every
    /// rank's file is written and synced, as a synchronous one. At most one is in flight (the
    /// next waits for it), and a kill at any moment leaves the one before whole.
    #[serde(rename = "async", skip_serializing_if = "is_default")]
    pub asynchronous: bool,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Checkpoint { every: 0, every_steps: None, keep: 2, asynchronous: false }
    }
}

/// `[run]`: the processes, their seed, time limits and numerics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Run {
    /// Names the run directory: results/<name>/<run-id>/.
    pub name: String,
    /// Seeds data generation, shuffling and initial weights.
    pub seed: u64,
    /// Number of ranks (processes).
    pub world_size: usize,
    /// The collective engine: "gloo" (CPU, and CUDA tensors through host memory) or "nccl"
    /// (GPUs; the CUDA build only).
    pub backend: Backend,
    /// Where a rank computes: "cpu", or "cuda" (rank r on cuda:LOCAL_RANK; the CUDA build only).
    pub device: Device,
    /// Intra-op threads per rank; default: cores / world_size, at least 1, or 1 under
    /// `run.numerics = "portable"` (the thread count splits sums, so the machine must not choose it).
    pub threads_per_rank: Option<usize>,
    /// Seconds any collective or rendezvous may take before the run fails.
    pub timeout_s: f64,
    /// Seconds the launcher lets the other ranks wind down after one fails, before killing them.
    pub abort_after_s: f64,
    /// Seconds a rank may take over one training step before the launcher ends the run, naming
    /// the rank and the step; absent: 10 × the slowest step so far, and at least `timeout_s`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_timeout_s: Option<f64>,
    /// MiB of memory one rank may use: the plan's whole-process estimate, its training state
    /// (parameters, their gradients and the optimizer's state, as the strategy holds them: whole
    /// under DDP, a stage's under a pipeline, shards plus the layers gathered at once under FSDP)
    /// and what it needs besides (activations, data, libtorch), checked on the plan, which names
    /// the strategies and world sizes that fit; `wrap.strategy = "auto"` chooses by it. Where a
    /// transformer's rank does not fit and wrap.activation_checkpointing is left out, the plan
    /// turns checkpointing on (the fewest blocks that fit) before any other way, and says so.
    /// Absent: unchecked (the plan still checks the whole estimate against this machine's memory).
    pub memory_per_rank_mb: Option<f64>,
    /// The peak matrix-product rate of one rank's device, in TFLOP/s, over which a transformer's
    /// model FLOPs utilisation (MFU: its training FLOPs per second over this peak) is reported in
    /// the trace and the progress line. Absent: on CPU, measured when the rank starts (square
    /// matrix products on the rank's threads in the run's precision, about 0.25 s); on CUDA, the
    /// dense rate of the GPU's model from the runner's table (H100, H200, B200, A100, L40S, L4),
    /// no MFU for a GPU it does not list. Between 0.001 and 1000000. Changes no result: the run id
    /// leaves it out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
    /// Replays each training step's forward and backward passes as one CUDA graph, as
    /// torch.compile's mode = "reduce-overhead" does: three eager steps warm up, the fourth is
    /// captured, and every later step is one replay of it (its kernels launched at once, no host
    /// work between them); the optimizer step runs after it, as without. CUDA only; refused on the
    /// plan where a step cannot be replayed (collectives in the step, dropout, varying batch
    /// shapes, gradient accumulation, activation checkpointing). Changes no result: the run id
    /// leaves it out.
    #[serde(skip_serializing_if = "is_default")]
    pub cuda_graphs: bool,
    /// The signal that preempts the run: every rank finishes its step, a checkpoint is written
    /// at that step, the manifest says `preempted`, and under Slurm the job requeues itself and
    /// resumes there. `#SBATCH --signal=USR1@90` sends SIGUSR1 90 s before the time limit;
    /// submitit uses USR2.
    #[serde(skip_serializing_if = "is_default")]
    pub preempt_signal: PreemptSignal,
    /// Times the launcher starts every rank again after a rank fails (a non-zero exit, a signal,
    /// a stalled step, a lost peer), each time from the newest checkpoint (from the start when
    /// there is none yet). A failure that repeats at the same step with the same cause is not
    /// retried. 0 (the default, as torchrun's --max-restarts): a failure ends the run.
    #[serde(skip_serializing_if = "is_default")]
    pub max_restarts: usize,
    /// With `--nnodes MIN:MAX`: seconds the nodes left wait for a lost node to come back before
    /// they go on without it (at least MIN nodes), from the newest checkpoint at the smaller
    /// world size.
    #[serde(skip_serializing_if = "is_default_rejoin")]
    pub rejoin_timeout_s: f64,
    /// The numerical path of libtorch's CPU kernels: "native" (the default: this CPU's own
    /// kernels, as PyTorch runs; the same bits on the same CPU model) or "portable" (the same bits
    /// on any x86-64 CPU with AVX2: MKL_CBWR=COMPATIBLE, ATen's AVX2 kernels, oneDNN and NNPACK
    /// off, 1 thread per rank unless run.threads_per_rank says; about 2x slower on compute-bound
    /// runs; for results committed and checked on other machines). An MKL_CBWR set in the
    /// environment wins; ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA are overridden under portable.
    // Stored configurations (plan.json, the bytes of the run id) leave "portable" out, as they did
    // while it was the default: runs made then keep their ids and their plan.json still reads as
    // portable. A pipeline file without the key resolves to native (config::resolve's defaults).
    #[serde(default = "CpuNumerics::stored", skip_serializing_if = "CpuNumerics::leaves_out")]
    #[schemars(default = "CpuNumerics::default")]
    pub numerics: CpuNumerics,
}

/// `run.numerics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CpuNumerics {
    /// The same bits on any x86-64 CPU with AVX2: every kernel family pinned (MKL's COMPATIBLE
    /// branch, ATen's AVX2 kernels, oneDNN and NNPACK off) and a fixed thread count.
    Portable,
    /// This CPU's own kernels: faster; the same bits on the same CPU model only.
    #[default]
    Native,
}

impl CpuNumerics {
    /// What a stored configuration without the key computed under.
    pub fn stored() -> CpuNumerics {
        CpuNumerics::Portable
    }

    fn leaves_out(&self) -> bool {
        skip(*self == CpuNumerics::stored())
    }
}

/// `run.rejoin_timeout_s`'s default: torchrun's last call for nodes of an elastic rendezvous.
const REJOIN_TIMEOUT_S: f64 = 30.0;

fn is_default_rejoin(v: &f64) -> bool {
    skip(*v == REJOIN_TIMEOUT_S)
}

/// A signal a job scheduler sends before it stops a job (`run.preempt_signal`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PreemptSignal {
    /// SIGUSR1 (Slurm's `--signal=USR1@SECONDS`).
    #[default]
    #[serde(rename = "USR1", alias = "SIGUSR1")]
    Usr1,
    /// SIGUSR2 (submitit's choice).
    #[serde(rename = "USR2", alias = "SIGUSR2")]
    Usr2,
}

impl PreemptSignal {
    /// The signal's number.
    pub fn number(self) -> i32 {
        match self {
            PreemptSignal::Usr1 => signal_hook::consts::SIGUSR1,
            PreemptSignal::Usr2 => signal_hook::consts::SIGUSR2,
        }
    }

    /// Its name as Slurm's `--signal` takes it.
    pub fn name(self) -> &'static str {
        match self {
            PreemptSignal::Usr1 => "USR1",
            PreemptSignal::Usr2 => "USR2",
        }
    }
}

impl Default for Run {
    fn default() -> Self {
        Run {
            name: "run".into(),
            seed: 0,
            world_size: 1,
            backend: Backend::Gloo,
            device: Device::Cpu,
            threads_per_rank: None,
            timeout_s: 60.0,
            abort_after_s: 5.0,
            step_timeout_s: None,
            memory_per_rank_mb: None,
            peak_tflops: None,
            cuda_graphs: false,
            preempt_signal: PreemptSignal::Usr1,
            max_restarts: 0,
            rejoin_timeout_s: REJOIN_TIMEOUT_S,
            numerics: CpuNumerics::Native,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Gloo,
    Nccl,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Cuda,
}

/// `[load]`: the data, generated or read from files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Load {
    /// Where the samples come from: generated, a file of rows, arrays, or tokens.
    pub source: Source,
    /// Training rows (synthetic); for files, the rows read (all when absent).
    pub rows: Option<usize>,
    /// Synthetic: the number of features. Files: the feature columns, in order (default: every
    /// column but the target and `exclude`); a number is checked against the file's count.
    pub features: Option<Features>,
    /// Files: columns left out of the features (an ID column, a leak).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    /// Number of classes (synthetic); for files, inferred from the target column when absent.
    pub classes: Option<usize>,
    /// Synthetic only: rows generated after the training rows for validation (files:
    /// `validate.fraction`, `validate.rows` or `load.validation_path`).
    pub validation_rows: usize,
    /// Synthetic only: scale of the label noise (0 = a noiseless teacher).
    pub noise: f64,
    /// The data file, relative to the pipeline file. Token files (`source = "tokens"` or
    /// `"text"`) may be several: a list of paths or a glob (`"data/train-*.bin"`), read as one
    /// stream in sorted order.
    pub path: Option<Paths>,
    /// csv / parquet: the column to predict: class labels (integers, strings or booleans, mapped to
    /// class ids in sorted order) or, with `train.task = "regression"`, numbers.
    pub target: Option<String>,
    /// Synthetic only: generate images of this shape, [channels, height, width], instead of rows
    /// of `features` numbers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<[usize; 3]>,
    /// tensors with an .npy `path` (the inputs, `x`) only: the .npy file of the labels (`y`),
    /// relative to the pipeline file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<PathBuf>,
    /// A separate validation file (instead of a split): the same columns (csv / parquet), the same
    /// arrays (tensors), a token file such as nanoGPT's `val.bin` (tokens, text), or a JSON Lines
    /// or parquet file of examples (instructions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation_path: Option<PathBuf>,
    /// Language models: how each step's windows are drawn. "epoch": DistributedSampler over fixed
    /// windows; "random": every step, each rank draws its windows at uniformly random token
    /// offsets (nanoGPT's get_batch), seeded by (run.seed, step, rank).
    #[serde(skip_serializing_if = "is_default")]
    pub sampling: Sampling,
    /// csv / parquet: what to do with missing cells (empty, NA, N/A, null).
    #[serde(skip_serializing_if = "Missing::is_error")]
    pub missing: Missing,
    /// csv: the field separator, one character (default ",").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delimiter: Option<String>,
    /// instructions: the directory of the tokenizer (`tokenizer.json`, and `tokenizer_config.json`
    /// with its `chat_template` for `messages`), relative to the pipeline file; default: the
    /// directory of `load.path`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// instructions: an example longer than `wrap.model.seq_len` + 1 tokens: "error" refuses it
    /// (its file and line), "truncate" keeps its first tokens (counted in the plan).
    #[serde(skip_serializing_if = "is_default")]
    pub too_long: TooLong,
    /// instructions: pack examples, in the file's order, into windows of `wrap.model.seq_len`
    /// (each example attending only to itself, its positions from 0) instead of padding each.
    #[serde(skip_serializing_if = "is_default")]
    pub packing: bool,
}

/// `load.too_long`: an instruction example longer than the model's context.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TooLong {
    /// Refuse the data, naming the file, the line and the example's length.
    #[default]
    Error,
    /// Keep the example's first seq_len + 1 tokens (the plan counts how many were cut).
    Truncate,
}

/// `load.path`: one file, or (token files) several, or a glob.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Paths {
    One(PathBuf),
    Many(Vec<PathBuf>),
}

impl Paths {
    /// The single path, or `None` for a list.
    pub fn single(&self) -> Option<&PathBuf> {
        match self {
            Paths::One(p) => Some(p),
            Paths::Many(_) => None,
        }
    }
}

impl From<&str> for Paths {
    fn from(p: &str) -> Paths {
        Paths::One(p.into())
    }
}

/// `load.sampling`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Sampling {
    #[default]
    Epoch,
    Random,
}

/// `load.features`: a count (synthetic) or column names (files).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Features {
    Count(usize),
    Columns(Vec<String>),
}

/// `load.missing`: missing cells in a data file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Missing {
    /// Refuse the file, naming the columns and counts.
    #[default]
    Error,
    /// Leave out every row with a missing cell.
    Drop,
    /// Fill numeric cells with the training rows' mean (categorical cells: no category).
    Mean,
    /// Fill numeric cells with the training rows' median (categorical cells: no category).
    Median,
    /// Fill numeric cells with 0 (categorical cells: no category).
    Zero,
}

impl Missing {
    fn is_error(&self) -> bool {
        *self == Missing::Error
    }
}

impl Default for Load {
    fn default() -> Self {
        Load {
            source: Source::Synthetic,
            rows: None,
            features: None,
            classes: None,
            validation_rows: 1000,
            noise: 0.5,
            path: None,
            target: None,
            image: None,
            labels: None,
            exclude: Vec::new(),
            validation_path: None,
            sampling: Sampling::Epoch,
            missing: Missing::Error,
            delimiter: None,
            tokenizer: None,
            too_long: TooLong::Error,
            packing: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Synthetic,
    Csv,
    Parquet,
    /// Arrays `x` (any shape, first axis = rows) and `y` (integer labels): an .npz or
    /// .safetensors file, or an .npy file of `x` with `load.labels` the .npy file of `y`.
    Tensors,
    /// A flat array of token ids (`.npy`, or raw little-endian uint16 `.bin` as nanoGPT writes
    /// it), cut into windows of `wrap.model.seq_len` + 1 for a language model.
    Tokens,
    /// Any UTF-8 file read as bytes (token ids 0..256), cut into windows like `tokens`.
    Text,
    /// Instruction data for supervised fine-tuning: JSON Lines (or parquet columns, for a path
    /// ending in `.parquet`) of `prompt`/`response` pairs or chat `messages`, tokenized with `load.tokenizer`, the loss on the responses only, each
    /// example padded to `wrap.model.seq_len` (or packed: `load.packing`).
    Instructions,
}

/// `[shard]`: how the training samples divide across the ranks, epoch after epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Shard {
    /// How each step's samples divide across the ranks.
    pub strategy: ShardStrategy,
    /// Reshuffle every epoch (DistributedSampler's set_epoch); otherwise the file order.
    pub shuffle: bool,
    /// Drop the tail that does not divide by world_size; otherwise pad by repeating rows
    /// (trained on, never counted twice in metrics).
    pub drop_last: bool,
}

impl Default for Shard {
    fn default() -> Self {
        Shard { strategy: ShardStrategy::Dataset, shuffle: true, drop_last: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ShardStrategy {
    /// DistributedSampler: rank r takes positions r, r+W, r+2W, ... of each epoch's permutation.
    Dataset,
    /// Every global batch (train.global_batch_size) split evenly across the ranks.
    Batch,
}

/// `[normalize]`: how the inputs are scaled before training.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Normalize {
    /// How each input is scaled, with statistics fitted on the training rows only (a column
    /// constant over them gets scale 1).
    pub method: NormalizeMethod,
    /// Whose rows the statistics are fitted on.
    pub scope: NormalizeScope,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NormalizeMethod {
    /// Scale each feature to [0, 1].
    #[default]
    Minmax,
    /// Zero mean, unit variance per feature.
    Standard,
    None,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NormalizeScope {
    /// Statistics of the rank's own shard (what the seed does; a column constant in one shard
    /// gets scale 1 there).
    Rank,
    /// Statistics all-reduced across ranks: the whole training set, the same at every world size.
    #[default]
    Global,
}

/// `[wrap]`: the model, and how the ranks share it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Wrap {
    /// How the ranks share the work on the model.
    pub strategy: WrapStrategy,
    /// DDP gradient bucket size, in MiB.
    pub bucket_cap_mb: f64,
    /// Initial weights: an .npz or .safetensors file with one tensor per parameter
    /// (`layer0.weight`, `layer0.bias`, ...), or for a transformer a Hugging Face model directory
    /// (config.json with model.safetensors or its shards; GPT2LMHeadModel or LlamaForCausalLM,
    /// whose config.json gives [wrap.model]), relative to the pipeline file; default: from run.seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
    /// Under DDP, batch norm with batch statistics all-reduced across ranks (torch's SyncBatchNorm);
    /// only for models with batch norm (a CNN with batch_norm blocks), refused with a pipeline; plain
    /// batch norm on one rank or with strategy = "none".
    #[serde(skip_serializing_if = "is_false")]
    pub sync_batchnorm: bool,
    /// Intra-op threads of each replica of the model a rank computes: with fewer than
    /// run.threads_per_rank, the rank holds run.threads_per_rank / this replicas sharing its
    /// weights, each computing its part of every batch at the same time on its own threads, their
    /// gradients summed in a fixed order (the same bits as train.accumulate over those parts).
    /// Default: all of the rank's threads in one replica. Small models on few cores gain most:
    /// their matrix products are too short to keep several threads busy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads_per_replica: Option<usize>,
    /// The model: `kind` picks the architecture.
    #[serde(deserialize_with = "model_of_default_kind")]
    pub model: Model,
    /// strategy = "pipeline" only.
    pub pipeline: Pipeline,
    /// strategy = "fsdp" only.
    #[serde(skip_serializing_if = "Fsdp::is_default")]
    pub fsdp: Fsdp,
    /// How the ranks are arranged: data × tensor × pipeline = run.world_size.
    #[serde(skip_serializing_if = "Mesh::is_default")]
    pub mesh: Mesh,
    /// Which activations the backward pass recomputes instead of keeping them from the forward.
    #[serde(skip_serializing_if = "is_default")]
    pub activation_checkpointing: ActivationCheckpointing,
    /// LoRA fine-tuning of the wrap.init checkpoint: its weights frozen, low-rank adapters trained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<Lora>,
}

/// `[wrap.lora]`: LoRA adapters as PEFT makes them. Each target linear layer W gains
/// (alpha / rank) · B · A · dropout(x), A [rank, inputs] Kaiming-uniform and B [outputs, rank]
/// zero (so step 0 is the base model); the base model (wrap.init, a Hugging Face checkpoint) is
/// frozen: no gradients, no optimizer state, left out of checkpoints (read again from wrap.init,
/// whose digest the resume checks). Under wrap.strategy = "ddp" or "none".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Lora {
    /// The adapters' rank r (PEFT's `r`): 1 up to the smallest dimension of a target layer.
    pub rank: i64,
    /// The scale's numerator (PEFT's `lora_alpha`): the update is (alpha / rank) · B · A.
    pub alpha: f64,
    /// Dropout on each adapter's input, in training (PEFT's `lora_dropout`), in [0, 1).
    pub dropout: f64,
    /// The linear layers adapted, by PEFT's module names: q_proj, k_proj, v_proj, o_proj,
    /// gate_proj, up_proj, down_proj (Llama); c_attn, c_proj, c_fc (GPT-2; c_proj is both the
    /// attention's and the MLP's output, as PEFT matches it); or ["all-linear"] (every linear
    /// layer of the blocks). Default: PEFT's for the class (q_proj and v_proj; c_attn).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<String>,
    /// Initial adapters: a PEFT adapter directory (adapter_config.json and
    /// adapter_model.safetensors, as `save_pretrained` or `runner export --peft` writes it),
    /// relative to the pipeline file; default: PEFT's initialisation from run.seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
}

impl Default for Lora {
    fn default() -> Self {
        Lora { rank: 8, alpha: 8.0, dropout: 0.0, targets: Vec::new(), init: None }
    }
}

impl Default for Wrap {
    fn default() -> Self {
        Wrap {
            strategy: WrapStrategy::Ddp,
            bucket_cap_mb: 25.0,
            init: None,
            sync_batchnorm: false,
            threads_per_replica: None,
            model: Model::default(),
            pipeline: Pipeline::default(),
            fsdp: Fsdp::default(),
            mesh: Mesh::default(),
            activation_checkpointing: ActivationCheckpointing::default(),
            lora: None,
        }
    }
}

/// `[wrap.activation_checkpointing]`: blocks whose activations are recomputed in the backward
/// pass instead of kept from the forward (torch.utils.checkpoint): less memory for a second
/// forward pass of those blocks. The recomputation replays the forward's random state, so
/// losses and gradients are bit-identical to policy = "none". A transformer's blocks and an
/// MLP's layers can be checkpointed; a CNN or a TorchScript module cannot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ActivationCheckpointing {
    /// "none": every activation kept; "full": a checkpointed block keeps only its input, and its
    /// forward pass runs again in the backward pass; "selective" (a transformer's blocks): a
    /// checkpointed block keeps the outputs of its matrix products and attention, and recomputes
    /// only what feeds each product (its LayerNorms, its MLP's activation, the heads' merge).
    pub policy: CheckpointPolicy,
    /// Checkpoint every k-th block: blocks 0, k, 2k, ... (an MLP's layers 1, 1 + k, ...: its
    /// first layer reads the data); 1: every block.
    pub every: usize,
}

impl Default for ActivationCheckpointing {
    fn default() -> Self {
        ActivationCheckpointing { policy: CheckpointPolicy::None, every: 1 }
    }
}

impl ActivationCheckpointing {
    /// Whether block `i` (0-based, of the checkpointable blocks) is recomputed.
    pub fn applies(&self, i: usize) -> bool {
        self.policy != CheckpointPolicy::None && self.every > 0 && i.is_multiple_of(self.every)
    }
}

/// `wrap.activation_checkpointing.policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointPolicy {
    #[default]
    None,
    Full,
    Selective,
}

/// `[wrap.mesh]`: the ranks as a grid of data × tensor × pipeline = run.world_size, one process
/// group per dimension; rank = (data index × pipeline + pipeline index) × tensor + tensor index
/// (a tensor group's ranks are consecutive, then a pipeline's). A dimension left out is worked
/// out from the others: tensor 1; pipeline world_size / wrap.pipeline.replicas under
/// wrap.strategy = "pipeline", else 1; data the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Mesh {
    /// Copies of the model, each on its own shard of the data (what wrap.strategy does across
    /// them: DDP's averaging, a pipeline's per-stage averaging).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<usize>,
    /// Ranks each layer is split across (Megatron-style tensor parallelism: a transformer's heads
    /// and MLP units, an MLP's column/row pairs; under wrap.strategy = "ddp" or "none").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor: Option<usize>,
    /// Stages of a pipeline (wrap.strategy = "pipeline"; replaces wrap.pipeline.replicas).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<usize>,
    /// Sequence parallelism (Megatron-SP, as torchtitan builds it) with tensor > 1: between a
    /// transformer's split layers, the activations are split along the sequence over the tensor
    /// group, so the norms, the residual dropout and the activations they keep are 1 / tensor per
    /// rank; an all-gather enters each column-parallel layer and a reduce-scatter leaves each
    /// row-parallel one (instead of an all-reduce). wrap.model.seq_len must divide by tensor.
    #[serde(skip_serializing_if = "is_false")]
    pub sequence_parallel: bool,
}

impl Mesh {
    fn is_default(&self) -> bool {
        skip(*self == Mesh::default())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WrapStrategy {
    /// DistributedDataParallel: gradients averaged across ranks every step.
    Ddp,
    /// No synchronisation: each rank trains its own replica (world_size 1, or for comparison).
    None,
    /// Model parallelism: the layers partitioned across the ranks, micro-batches flowing through.
    Pipeline,
    /// Sharded data parallelism (FSDP, ZeRO): every rank holds 1/world_size of each parameter,
    /// of its gradient and of the optimizer's state, and gathers a layer's parameters just
    /// before they are used; gradients and losses as DDP's.
    Fsdp,
    /// The plan picks: DDP where a rank with the whole training state fits run.memory_per_rank_mb
    /// (or this machine's memory shared by its ranks), else FSDP keeping parameters gathered from forward
    /// to backward (ZeRO-2), else FSDP gathering them again for the backward pass (ZeRO-3), else
    /// the pipeline; each with activation checkpointing before the next, where the model is a
    /// transformer and wrap.activation_checkpointing is left out; else the mesh shape data ×
    /// tensor (DDP or FSDP over the data dimension) that fits and sends the least per row
    /// trained; it prints which and why, naming every shape it considered.
    Auto,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Fsdp {
    /// Free each layer's gathered parameters after its forward pass and gather them again for
    /// its backward pass (ZeRO-3, FSDP2's default: the least memory); false keeps them from the
    /// forward to the end of the backward (ZeRO-2: one all-gather per layer and step less, the
    /// whole model gathered at the end of the forward pass).
    pub reshard_after_forward: bool,
}

impl Default for Fsdp {
    fn default() -> Self {
        Fsdp { reshard_after_forward: true }
    }
}

impl Fsdp {
    /// Left out at its default except where every key is written (the resume compares and sets
    /// `wrap.fsdp.*` like any other key).
    fn is_default(&self) -> bool {
        skip(*self == Fsdp::default())
    }
}

/// `[wrap.pipeline]`: pipeline parallelism, with `wrap.strategy = "pipeline"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Pipeline {
    /// The layers (0-based, in order) of each stage, one list per rank of a pipeline; absent: a
    /// contiguous split balanced by parameter count.
    pub stages: Option<Vec<Vec<usize>>>,
    /// Micro-batches each batch is split into (sizes differ by at most one row).
    pub micro_batches: usize,
    /// The order of the micro-batches' forward and backward passes.
    pub schedule: Schedule,
    /// Copies of the pipeline, each on world_size / replicas ranks and its own shard of the data,
    /// each stage's gradients averaged over the copies (data parallel across pipelines).
    pub replicas: usize,
}

impl Default for Pipeline {
    fn default() -> Self {
        Pipeline { stages: None, micro_batches: 1, schedule: Schedule::Gpipe, replicas: 1 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Every micro-batch forward, then every micro-batch backward, then one update.
    Gpipe,
    /// Once the pipeline is full, one forward then one backward: the same result and bubble as
    /// GPipe, with at most (ranks - rank) micro-batches' activations held instead of all.
    #[serde(rename = "1f1b")]
    OneFOneB,
}

/// The model: `kind` picks the architecture, the other keys are that kind's own. One variant per
/// kind; each kind's module in `crate::model` implements its architecture.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Model {
    /// Linear layers with an activation between them, over rows of features.
    Mlp(Mlp),
    /// Convolution blocks over images (N × C × H × W), then linear layers.
    Cnn(Cnn),
    /// A module scripted or traced in PyTorch, with its own initial weights.
    Torchscript(Torchscript),
    /// A decoder-only language model over windows of token ids.
    Transformer(Transformer),
}

impl Default for Model {
    fn default() -> Self {
        Model::Mlp(Mlp::default())
    }
}

/// `[wrap.model]` may leave `kind` out: it is "mlp", as before kinds existed. serde's tagged
/// enums have no default tag, so the table is read whole and given one.
fn model_of_default_kind<'de, D: Deserializer<'de>>(d: D) -> Result<Model, D::Error> {
    use serde::de::Error;
    let mut table = toml::Table::deserialize(d)?;
    table.entry("kind").or_insert_with(|| "mlp".into());
    Model::deserialize(toml::Value::Table(table)).map_err(|e| D::Error::custom(e.message()))
}

/// `kind = "mlp"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Mlp {
    /// Widths of the hidden layers.
    pub hidden: Vec<usize>,
    /// The activation after each hidden layer.
    pub activation: Activation,
    /// Dropout probability after each hidden activation.
    pub dropout: f64,
}

impl Default for Mlp {
    fn default() -> Self {
        Mlp { hidden: vec![64, 64], activation: Activation::Relu, dropout: 0.0 }
    }
}

/// `kind = "cnn"`: the `conv` blocks in order, then the `hidden` linear layers and the output layer
/// (the first linear layer flattens the last block's C × H × W).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Cnn {
    /// The convolution blocks, in order: a list of tables (the keys below).
    pub conv: Vec<ConvBlock>,
    /// Widths of the hidden linear layers after the convolutions.
    pub hidden: Vec<usize>,
    /// After every convolution (after its batch norm) and every hidden linear layer.
    pub activation: Activation,
    /// Dropout probability after each hidden linear layer's activation.
    pub dropout: f64,
}

impl Default for Cnn {
    fn default() -> Self {
        Cnn {
            conv: vec![
                ConvBlock { channels: 16, ..ConvBlock::default() },
                ConvBlock { channels: 32, ..ConvBlock::default() },
            ],
            hidden: vec![64],
            activation: Activation::Relu,
            dropout: 0.0,
        }
    }
}

/// One convolution block: conv2d → batch norm (optional) → activation → pooling (optional) →
/// dropout (optional). One layer of the model: a pipeline may cut between blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ConvBlock {
    /// Output channels.
    pub channels: usize,
    /// Square kernel side, in pixels.
    pub kernel: usize,
    /// The convolution's step, in pixels.
    pub stride: usize,
    /// Zeros added on each side, in pixels.
    pub padding: usize,
    /// Batch normalization after the convolution (running statistics: momentum 0.1, eps 1e-5).
    pub batch_norm: bool,
    /// Pooling after the activation: "max", "avg" or "none".
    pub pool: Pool,
    /// Pooling window side (and stride), in pixels.
    pub pool_size: usize,
    /// Dropout probability at the end of the block.
    pub dropout: f64,
}

impl Default for ConvBlock {
    fn default() -> Self {
        ConvBlock {
            channels: 16,
            kernel: 3,
            stride: 1,
            padding: 1,
            batch_norm: false,
            pool: Pool::None,
            pool_size: 2,
            dropout: 0.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    None,
    Max,
    Avg,
}

/// `kind = "torchscript"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Torchscript {
    /// The module `torch.jit.script(model).save(path)` (or `torch.jit.trace`) wrote, relative to
    /// the pipeline file: one input tensor (a batch of the data's samples) to one output tensor
    /// (a batch of logits over the classes).
    pub path: PathBuf,
}

/// `kind = "transformer"`: a decoder-only language model: token embeddings, `layers` pre-norm
/// blocks (causal self-attention, then an MLP), a final norm and an output head over the
/// vocabulary. `family` sets the defaults of the block's parts, GPT-2's or Llama's; each part can
/// be set on its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Transformer {
    /// The defaults of the parts left unset: "gpt2" (learned positions, LayerNorm, a GELU MLP of
    /// 4 × d_model, biases, the head tied to the embedding) or "llama" (rotary positions, RMSNorm,
    /// a SwiGLU MLP, no biases, a head of its own).
    #[serde(skip_serializing_if = "is_default")]
    pub family: Family,
    /// Token ids 0..vocab (256 for `load.source = "text"`).
    pub vocab: usize,
    /// Width of the embeddings and of every block.
    pub d_model: usize,
    /// Attention (query) heads per block; must divide d_model unless head_dim is set.
    pub heads: usize,
    /// Key and value heads per block (grouped-query attention: each serves heads / kv_heads
    /// query heads); must divide heads. Default: heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// Width of each attention head. Default: d_model / heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Transformer blocks.
    pub layers: usize,
    /// Tokens per window (the context length); the data is cut into windows of seq_len + 1.
    pub seq_len: usize,
    /// The longest context the model takes: the rows of the learned position table (at least
    /// seq_len), and what an export records. Default: seq_len.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_positions: Option<usize>,
    /// Dropout probability on the embeddings, the attention weights and each residual branch.
    pub dropout: f64,
    /// The output head is the token embedding (transposed) instead of a matrix of its own.
    /// Default: by family (gpt2 true, llama false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tied: Option<bool>,
    /// Biases in the linear layers (and in LayerNorm); false: weights only (nanoGPT's and
    /// Llama's choice). Default: by family (gpt2 true, llama false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias: Option<bool>,
    /// The norm before each block's attention and MLP and before the head: "layernorm" or
    /// "rmsnorm" (no mean subtracted, no bias). Default: by family (gpt2 "layernorm", llama
    /// "rmsnorm").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm: Option<Norm>,
    /// The norms' epsilon, added to the variance. Default: by family (gpt2 1e-5, llama 1e-6, as
    /// transformers' configurations).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// How the model knows positions: "learned" (a table of max_positions × d_model added to the
    /// token embeddings) or "rope" (rotary embeddings of the queries and keys, in Hugging Face's
    /// rotate-half layout). Default: by family (gpt2 "learned", llama "rope").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub positions: Option<Positions>,
    /// RoPE's base wavelength (`positions = "rope"`). Default: 10000.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// The MLP: "gelu" (exact GELU), "gelu_tanh" (its tanh approximation, GPT-2's own) or
    /// "swiglu" (silu(x W_gate) × x W_up, then W_down). Default: by family (gpt2 "gelu", as
    /// nanoGPT; llama "swiglu").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp: Option<FeedForward>,
    /// The MLP's hidden width. Default: 4 × d_model with GELU; with SwiGLU, 2/3 of that rounded
    /// up to a multiple of 256 (Llama's rule).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp_hidden: Option<usize>,
}

impl Default for Transformer {
    fn default() -> Self {
        Transformer {
            family: Family::Gpt2,
            vocab: 256,
            d_model: 64,
            heads: 4,
            kv_heads: None,
            head_dim: None,
            layers: 2,
            seq_len: 64,
            max_positions: None,
            dropout: 0.0,
            tied: None,
            bias: None,
            norm: None,
            norm_eps: None,
            positions: None,
            rope_theta: None,
            mlp: None,
            mlp_hidden: None,
        }
    }
}

/// The family of a transformer: the defaults of its parts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// GPT-2's (and nanoGPT's) block.
    #[default]
    Gpt2,
    /// Llama's block.
    Llama,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    /// Mean and variance normalised, then scaled (and shifted, with biases).
    Layernorm,
    /// Root mean square normalised, then scaled.
    Rmsnorm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Positions {
    /// A learned embedding per position, added to the token embeddings.
    Learned,
    /// Rotary position embeddings of the queries and keys.
    Rope,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FeedForward {
    /// Two linear layers around an exact GELU.
    Gelu,
    /// Two linear layers around GELU's tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    /// A gated linear unit with SiLU: three matrices.
    Swiglu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    Relu,
    Tanh,
    Gelu,
}

/// `[train]`: how long and how the model learns: the optimizer and the training recipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Train {
    /// Passes over the training data. Give `epochs` or `steps`, not both.
    pub epochs: usize,
    /// Optimizer steps to train for, instead of epochs (each of `accumulate` batches).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// Samples per step on each rank (shard.strategy = "dataset").
    pub batch_size: usize,
    /// Samples per step over all ranks (shard.strategy = "batch"), split evenly across them.
    pub global_batch_size: Option<usize>,
    /// The optimizer: "sgd", "adam" or "adamw" (Adam with decoupled weight decay).
    pub optimizer: Optimizer,
    /// The peak learning rate (the schedule's base).
    pub lr: f64,
    /// SGD only: the momentum factor (torch's, without dampening or Nesterov).
    pub momentum: f64,
    /// Adam / AdamW: the decay rates of the first and second moments' running averages.
    #[serde(skip_serializing_if = "is_default_betas")]
    pub betas: [f64; 2],
    /// Adam / AdamW: added to the second moment's square root in the denominator.
    #[serde(skip_serializing_if = "is_default_eps")]
    pub eps: f64,
    /// The weight decay factor: L2 added to the gradient for SGD and Adam, decoupled for AdamW.
    pub weight_decay: f64,
    /// Which parameters `weight_decay` applies to: "all", or "matrices" (parameters with two or
    /// more dimensions, embeddings included; never biases or norms: nanoGPT's configure_optimizers).
    #[serde(skip_serializing_if = "is_default")]
    pub weight_decay_on: WeightDecayOn,
    /// Adam / AdamW: true updates every parameter in one fused kernel (libtorch's
    /// `_fused_adamw_`, PyTorch's `fused=True`); false in PyTorch's multi-tensor `_foreach_`
    /// operations (`foreach=True`), the same formula in more passes over memory. Absent: fused,
    /// the faster on CPU and GPU. SGD has no fused kernel here: true is refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fused: Option<bool>,
    /// What the model learns: class labels (cross-entropy) or numbers (MSE on the normalised target).
    #[serde(skip_serializing_if = "TaskKind::is_classification")]
    pub task: TaskKind,
    /// Clip the gradients to this global L2 norm (after averaging across ranks); absent: no clipping.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
    /// Batches (micro-batches) per optimizer step: k batches of batch_size make one step of k × batch_size.
    #[serde(skip_serializing_if = "is_one")]
    pub accumulate: usize,
    /// The forward pass's arithmetic: fp32, or autocast to bfloat16 (float32 weights and optimizer state).
    #[serde(skip_serializing_if = "is_default")]
    pub precision: Precision,
    /// How the learning rate changes with the optimizer step; absent: constant `lr`. (Tables
    /// after the plain values: config.toml writes each section once.)
    #[serde(skip_serializing_if = "is_default")]
    pub schedule: LrSchedule,
    /// Stop when a validation metric stops improving; absent: train every epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub early_stop: Option<EarlyStop>,
}

/// `train.betas` by default (torch's).
pub const DEFAULT_BETAS: [f64; 2] = [0.9, 0.999];
/// `train.eps` by default (torch's).
pub const DEFAULT_EPS: f64 = 1e-8;

fn is_default_betas(v: &[f64; 2]) -> bool {
    skip(*v == DEFAULT_BETAS)
}

fn is_default_eps(v: &f64) -> bool {
    skip(*v == DEFAULT_EPS)
}

/// `train.weight_decay_on`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WeightDecayOn {
    /// Every parameter.
    #[default]
    All,
    /// Parameters with two or more dimensions (weight matrices, convolution kernels, embeddings).
    Matrices,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    #[default]
    Classification,
    Regression,
}

impl TaskKind {
    fn is_classification(&self) -> bool {
        *self == TaskKind::Classification
    }
}

impl Default for Train {
    fn default() -> Self {
        Train {
            epochs: 5,
            steps: None,
            batch_size: 32,
            global_batch_size: None,
            optimizer: Optimizer::Sgd,
            lr: 0.1,
            momentum: 0.0,
            betas: DEFAULT_BETAS,
            eps: DEFAULT_EPS,
            weight_decay: 0.0,
            weight_decay_on: WeightDecayOn::All,
            fused: None,
            task: TaskKind::Classification,
            clip_grad_norm: None,
            accumulate: 1,
            precision: Precision::Fp32,
            schedule: LrSchedule::default(),
            early_stop: None,
        }
    }
}

thread_local! {
    static EVERY_KEY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (a serialization) with every key written, defaults included: the resolved config.toml
/// shows every option. Elsewhere (the run id, plan.json) the training recipe's keys are left out
/// while they hold their defaults, so a configuration that does not use them keeps its run id.
pub fn with_every_key<R>(f: impl FnOnce() -> R) -> R {
    let before = EVERY_KEY.with(|k| k.replace(true));
    let out = f();
    EVERY_KEY.with(|k| k.set(before));
    out
}

fn skip(default: bool) -> bool {
    default && !EVERY_KEY.with(|k| k.get())
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    skip(*v == T::default())
}

fn is_one(v: &usize) -> bool {
    skip(*v == 1)
}

fn is_false(v: &bool) -> bool {
    skip(!*v)
}

fn is_true(v: &bool) -> bool {
    skip(*v)
}

/// `[train.schedule]`: the learning rate of optimizer step s (counted from 0 over the whole run) is a
/// pure function of s, so a resumed run takes the same rates.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LrSchedule {
    /// The shape of the learning rate over the optimizer steps.
    pub kind: ScheduleKind,
    /// Optimizer steps of linear warmup from lr / warmup_steps up to lr.
    #[serde(skip_serializing_if = "is_zero")]
    pub warmup_steps: usize,
    /// Warmup in epochs instead of steps (epochs × optimizer steps per epoch).
    #[serde(skip_serializing_if = "is_zero")]
    pub warmup_epochs: usize,
    /// linear, cosine: the learning rate reached at the end of the decay.
    #[serde(skip_serializing_if = "is_zero_f")]
    pub min_lr: f64,
    /// linear, cosine: the optimizer step (0-based) where the decay reaches min_lr, min_lr after
    /// it (nanoGPT's lr_decay_iters); absent: the step after the run's last, so that the last
    /// step trains above min_lr, as torch's `CosineAnnealingLR(T_max = steps)` does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decay_end: Option<usize>,
    /// Where the warmup's straight line reaches lr: at the last warmup step (lr × (s+1) /
    /// warmup), or at the first step after it (lr × (s+1) / (warmup+1), nanoGPT's get_lr).
    #[serde(skip_serializing_if = "is_default")]
    pub warmup_peak: WarmupPeak,
    /// step: multiply the learning rate by gamma every step_size optimizer steps...
    #[serde(skip_serializing_if = "is_zero")]
    pub step_size: usize,
    /// ...or every step_epochs epochs.
    #[serde(skip_serializing_if = "is_zero")]
    pub step_epochs: usize,
    /// step: the factor (0 < gamma ≤ 1); default 0.1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gamma: Option<f64>,
}

fn is_zero(v: &usize) -> bool {
    skip(*v == 0)
}

fn is_zero_f(v: &f64) -> bool {
    skip(*v == 0.0)
}

/// `train.schedule.warmup_peak`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WarmupPeak {
    /// The last warmup step trains at lr: lr × (s+1) / warmup.
    #[default]
    LastWarmupStep,
    /// The first step after the warmup trains at lr: lr × (s+1) / (warmup+1), as nanoGPT.
    FirstDecayStep,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// lr throughout (after the warmup).
    #[default]
    Constant,
    /// From lr down to min_lr in a straight line over the steps after the warmup.
    Linear,
    /// From lr down to min_lr along half a cosine over the steps after the warmup.
    Cosine,
    /// lr × gamma^(completed step_size periods after the warmup).
    Step,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Fp32,
    /// Autocast to bfloat16 (matrix products and convolutions), float32 master weights.
    Bf16,
    /// Float16 with dynamic loss scaling: CUDA only (refused on CPU).
    Fp16,
}

/// `[train.early_stop]`: stop once `metric` has not improved by more than min_delta for
/// `patience` validations in a row; the best epoch's model is saved as model.best.safetensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EarlyStop {
    /// The validation metric watched: "val_loss" or "val_acc".
    pub metric: StopMetric,
    /// min: lower is better (losses); max: higher is better (accuracies). Default: the metric's own.
    pub mode: Option<StopMode>,
    /// Validations without improvement before the run stops.
    pub patience: usize,
    /// The least change that counts as an improvement.
    pub min_delta: f64,
}

impl Default for EarlyStop {
    fn default() -> Self {
        EarlyStop { metric: StopMetric::ValLoss, mode: None, patience: 3, min_delta: 0.0 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopMetric {
    ValLoss,
    ValAcc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StopMode {
    Min,
    Max,
}

impl EarlyStop {
    /// The mode given, or the metric's natural one.
    pub fn mode(&self) -> StopMode {
        self.mode.unwrap_or(match self.metric {
            StopMetric::ValLoss => StopMode::Min,
            StopMetric::ValAcc => StopMode::Max,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    Sgd,
    Adam,
    Adamw,
}

/// `[validate]`: which rows are held out, and when and where they are measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Validate {
    /// Validate every this many epochs (and after the last); 0 turns validation off.
    pub every: usize,
    /// Validate (and write a trace row) every this many optimizer steps, and after the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub every_steps: Option<usize>,
    /// Validate on this many batches of train.batch_size per rank, the same ones every time
    /// (nanoGPT's eval_iters); absent: every validation row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batches: Option<usize>,
    /// Which ranks validate.
    pub on: ValidateOn,
    /// Files, tensors and token files: the fraction of rows (windows) held out for validation;
    /// default 0.2. Rows by a seeded shuffle (stratified by class for classification); windows
    /// of a token stream from its end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
    /// Files, tensors and token files: rows (windows) held out for validation, instead of a fraction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rows: Option<usize>,
}

impl Default for Validate {
    fn default() -> Self {
        Validate { every: 1, every_steps: None, batches: None, on: ValidateOn::Rank0, fraction: None, rows: None }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ValidateOn {
    /// Rank 0 validates every row while the other ranks wait.
    Rank0,
    /// Every rank validates every row (each replica checked on its own).
    All,
    /// Each rank validates its share of the rows at the same time (a contiguous, balanced
    /// split), their outputs all-gathered: rank 0 measures the same rows as with rank0, in about
    /// 1 / world_size of the time. For replicas of one model (DDP): not with a pipeline or
    /// wrap.strategy = "none".
    Split,
}

/// `[trace]`: what is recorded besides the per-epoch trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Trace {
    /// Record the phases of every this many training steps in steps.parquet (0: none).
    pub step_every: usize,
    /// Write TensorBoard event files (RUN_DIR/tensorboard/events.out.tfevents.*) from rank 0:
    /// every trace row's scalars, the configuration as text and the hparams.
    #[serde(skip_serializing_if = "is_true")]
    pub tensorboard: bool,
    /// Send rank 0's training loss, learning rate and gradient norm of every this many optimizer
    /// steps to TensorBoard and MLflow (`step/...`), besides the trace rows; 0: only trace rows.
    #[serde(skip_serializing_if = "is_default_log_every")]
    pub log_every_steps: usize,
}

/// `trace.log_every_steps` unless set.
pub const LOG_EVERY_STEPS: usize = 10;

impl Default for Trace {
    fn default() -> Self {
        Trace { step_every: 20, tensorboard: true, log_every_steps: LOG_EVERY_STEPS }
    }
}

fn is_default_log_every(v: &usize) -> bool {
    skip(*v == LOG_EVERY_STEPS)
}

/// `[track]`: an MLflow tracking server that receives the run's params, metrics and files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Track {
    /// The MLflow tracking server's URL, e.g. "http://127.0.0.1:5000"; absent: no MLflow.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlflow: Option<String>,
    /// The MLflow experiment the run joins (created if missing); default: run.name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experiment: Option<String>,
}

impl Config {
    /// The configuration without what only records a run (TensorBoard, MLflow, step logging, the
    /// peak MFU is measured against), how its steps are launched (`run.cuda_graphs`) or how it survives failures (`run.max_restarts`,
    /// `run.rejoin_timeout_s`, `checkpoint.async`): what the run id covers, since none of it
    /// changes what the run computes.
    pub fn without_tracking(&self) -> Config {
        let d = Trace::default();
        let trace = Trace { tensorboard: d.tensorboard, log_every_steps: d.log_every_steps, ..self.trace.clone() };
        let run = Run {
            max_restarts: 0,
            rejoin_timeout_s: REJOIN_TIMEOUT_S,
            peak_tflops: None,
            cuda_graphs: false,
            ..self.run.clone()
        };
        let checkpoint = Checkpoint { asynchronous: false, ..self.checkpoint.clone() };
        Config { trace, track: Track::default(), run, checkpoint, ..self.clone() }
    }
}
