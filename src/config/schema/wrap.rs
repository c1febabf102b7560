//! `[wrap]`: the strategy, the device mesh, FSDP's and the pipeline's settings, activation
//! checkpointing and LoRA.
use super::*;

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
