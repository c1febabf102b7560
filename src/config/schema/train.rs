//! `[train]` and `[validate]`: the optimizer, its schedule, precision, early stopping and
//! validation.
use super::*;

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
