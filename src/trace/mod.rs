//! Traces: one row per rank per epoch (`trace.parquet`) and the phases of sampled training steps
//! (`steps.parquet`), written atomically with polars; plus the terminal views of them, and what
//! the trackers write and send (TensorBoard event files, MLflow's REST API).

pub mod event;
pub mod mlflow;
pub mod progress;
pub mod tensorboard;
pub mod view;

use std::path::Path;

use polars::prelude::*;

/// Columns of trace.parquet that measure time, the process's resident memory (which depends on
/// the allocator's history) and the bytes sent (a resumed run's process groups set up again: DDP's
/// Reducer sends its bucket order once more): they differ from run to run by nature.
pub const TIMING_COLUMNS: &[&str] = &[
    "epoch_s",
    "samples_per_s",
    "comm_s",
    "compute_s",
    "bubble",
    "tokens_per_s",
    "mfu",
    "peak_rss_bytes",
    "sent_data_bytes",
    "sent_tensor_bytes",
    "sent_pipeline_bytes",
];

/// One rank's epoch. `global_*` are all-reduced over every rank (the same on each row).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EpochRow {
    /// The epoch in progress at the row's end (with random windows: the passes over the
    /// stream's windows so far, plus one).
    pub epoch: u32,
    /// Optimizer steps done over the run at the row's end.
    #[serde(default)]
    pub step: u64,
    pub rank: u32,
    /// The ranks of the run when the row was trained: a resume at another world size leaves the
    /// rows before it as they were (0 in a checkpoint of an older runner: see the checkpoint's
    /// layout).
    #[serde(default)]
    pub world_size: u32,
    pub train_loss: f64,
    pub train_acc: f64,
    pub global_train_loss: f64,
    pub global_train_acc: f64,
    pub val_loss: Option<f64>,
    pub val_acc: Option<f64>,
    /// Real (not padding) samples trained on.
    pub samples: u64,
    pub steps: u64,
    pub epoch_s: f64,
    pub samples_per_s: f64,
    /// Gradient all-reduce time measured by c10d's Reducer, summed over the epoch's steps.
    pub comm_s: f64,
    /// Time in forward, loss, backward and update, summed over the epoch's steps (with DDP,
    /// backward includes the wait for the last gradient buckets).
    #[serde(default)]
    pub compute_s: f64,
    /// Pipelines: the fraction of the epoch's training time this rank spent in send and recv,
    /// waiting for its neighbours (null for the other strategies).
    #[serde(default)]
    pub bubble: Option<f64>,
    /// Classification: the validation set's macro-F1 (mean of the classes' F1).
    #[serde(default)]
    pub val_f1: Option<f64>,
    /// Regression: validation RMSE, MAE (in the target's units) and R².
    #[serde(default)]
    pub val_rmse: Option<f64>,
    #[serde(default)]
    pub val_mae: Option<f64>,
    #[serde(default)]
    pub val_r2: Option<f64>,
    /// Language models: exp(train_loss), exp(val_loss), and training tokens per second
    /// (samples_per_s × seq_len); null for the other tasks.
    #[serde(default)]
    pub perplexity: Option<f64>,
    #[serde(default)]
    pub val_perplexity: Option<f64>,
    #[serde(default)]
    pub tokens_per_s: Option<f64>,
    /// Transformers: model FLOPs utilisation, the model's training FLOPs per second on the rank
    /// over its device's peak (`run.peak_tflops`, or measured), a fraction; null where no peak
    /// is known or for other models.
    #[serde(default)]
    pub mfu: Option<f64>,
    /// The learning rate of the epoch's last optimizer step.
    #[serde(default)]
    pub lr: f64,
    /// With train.clip_grad_norm: the global gradient norm before clipping, mean and max over the
    /// epoch's optimizer steps (null without clipping).
    #[serde(default)]
    pub grad_norm_mean: Option<f64>,
    #[serde(default)]
    pub grad_norm_max: Option<f64>,
    /// Bytes of the training state the rank holds: its parameters, their gradients and the
    /// optimizer's state (under FSDP its shards, plus the most gathered at once over the row's
    /// steps: `plan::memory` says what each part counts).
    #[serde(default)]
    pub param_bytes: u64,
    #[serde(default)]
    pub grad_bytes: u64,
    #[serde(default)]
    pub optim_bytes: u64,
    /// The rank process's peak resident memory so far (getrusage's ru_maxrss), in bytes.
    #[serde(default)]
    pub peak_rss_bytes: u64,
    /// Bytes the rank sent per optimizer step in its group of each mesh dimension (data,
    /// tensor, pipeline), counted in the process group as the collectives and sends start
    /// (`dist::Sent` says what counts): the mean over the row's steps. 0 along a dimension of
    /// one rank.
    #[serde(default)]
    pub sent_data_bytes: f64,
    #[serde(default)]
    pub sent_tensor_bytes: f64,
    #[serde(default)]
    pub sent_pipeline_bytes: f64,
}

impl EpochRow {
    /// Fills the language-model columns of a row over windows of `seq_len` tokens.
    pub fn language_model(&mut self, seq_len: usize) {
        self.perplexity = Some(self.train_loss.exp());
        self.val_perplexity = self.val_loss.map(f64::exp);
        self.tokens_per_s = Some(self.samples_per_s * seq_len as f64);
    }
}

/// The phases of one sampled training step on one rank, in seconds.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepRow {
    pub epoch: u32,
    pub step: u32,
    pub rank: u32,
    pub batch_s: f64,
    pub forward_s: f64,
    pub loss_s: f64,
    pub backward_s: f64,
    /// Reducer: first bucket all-reduce start → last one's end; in a pipeline, the time in
    /// send and recv.
    pub sync_s: f64,
    /// Reducer: the part of sync that overlapped backward computation.
    pub overlap_s: f64,
    pub update_s: f64,
    /// The part of backward spent recomputing checkpointed blocks (`wrap.activation_checkpointing`;
    /// 0 without).
    #[serde(default)]
    pub recompute_s: f64,
}

/// The column names and types of `trace.parquet`; tests pin them.
pub const EPOCH_COLUMNS: &[&str] = &[
    "run_id",
    "epoch",
    "rank",
    "world_size",
    "train_loss",
    "train_acc",
    "global_train_loss",
    "global_train_acc",
    "val_loss",
    "val_acc",
    "samples",
    "steps",
    "epoch_s",
    "samples_per_s",
    "comm_s",
    "compute_s",
    "bubble",
    "val_f1",
    "val_rmse",
    "val_mae",
    "val_r2",
    "perplexity",
    "val_perplexity",
    "tokens_per_s",
    "mfu",
    "lr",
    "grad_norm_mean",
    "grad_norm_max",
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "peak_rss_bytes",
    "sent_data_bytes",
    "sent_tensor_bytes",
    "sent_pipeline_bytes",
];

pub fn epochs_frame(run_id: &str, rows: &[EpochRow]) -> PolarsResult<DataFrame> {
    let n = rows.len();
    let f = |g: fn(&EpochRow) -> f64| Column::new("".into(), rows.iter().map(g).collect::<Vec<_>>());
    let cols = vec![
        Column::new("run_id".into(), vec![run_id; n]),
        Column::new("epoch".into(), rows.iter().map(|r| r.epoch).collect::<Vec<_>>()),
        Column::new("step".into(), rows.iter().map(|r| r.step).collect::<Vec<_>>()),
        Column::new("rank".into(), rows.iter().map(|r| r.rank).collect::<Vec<_>>()),
        Column::new("world_size".into(), rows.iter().map(|r| r.world_size).collect::<Vec<_>>()),
        f(|r| r.train_loss).with_name("train_loss".into()),
        f(|r| r.train_acc).with_name("train_acc".into()),
        f(|r| r.global_train_loss).with_name("global_train_loss".into()),
        f(|r| r.global_train_acc).with_name("global_train_acc".into()),
        Column::new("val_loss".into(), rows.iter().map(|r| r.val_loss).collect::<Vec<_>>()),
        Column::new("val_acc".into(), rows.iter().map(|r| r.val_acc).collect::<Vec<_>>()),
        Column::new("samples".into(), rows.iter().map(|r| r.samples).collect::<Vec<_>>()),
        Column::new("steps".into(), rows.iter().map(|r| r.steps).collect::<Vec<_>>()),
        f(|r| r.epoch_s).with_name("epoch_s".into()),
        f(|r| r.samples_per_s).with_name("samples_per_s".into()),
        f(|r| r.comm_s).with_name("comm_s".into()),
        f(|r| r.compute_s).with_name("compute_s".into()),
        Column::new("bubble".into(), rows.iter().map(|r| r.bubble).collect::<Vec<_>>()),
        Column::new("val_f1".into(), rows.iter().map(|r| r.val_f1).collect::<Vec<_>>()),
        Column::new("val_rmse".into(), rows.iter().map(|r| r.val_rmse).collect::<Vec<_>>()),
        Column::new("val_mae".into(), rows.iter().map(|r| r.val_mae).collect::<Vec<_>>()),
        Column::new("val_r2".into(), rows.iter().map(|r| r.val_r2).collect::<Vec<_>>()),
        Column::new("perplexity".into(), rows.iter().map(|r| r.perplexity).collect::<Vec<_>>()),
        Column::new("val_perplexity".into(), rows.iter().map(|r| r.val_perplexity).collect::<Vec<_>>()),
        Column::new("tokens_per_s".into(), rows.iter().map(|r| r.tokens_per_s).collect::<Vec<_>>()),
        Column::new("mfu".into(), rows.iter().map(|r| r.mfu).collect::<Vec<_>>()),
        f(|r| r.lr).with_name("lr".into()),
        Column::new("grad_norm_mean".into(), rows.iter().map(|r| r.grad_norm_mean).collect::<Vec<_>>()),
        Column::new("grad_norm_max".into(), rows.iter().map(|r| r.grad_norm_max).collect::<Vec<_>>()),
        Column::new("param_bytes".into(), rows.iter().map(|r| r.param_bytes).collect::<Vec<_>>()),
        Column::new("grad_bytes".into(), rows.iter().map(|r| r.grad_bytes).collect::<Vec<_>>()),
        Column::new("optim_bytes".into(), rows.iter().map(|r| r.optim_bytes).collect::<Vec<_>>()),
        Column::new("peak_rss_bytes".into(), rows.iter().map(|r| r.peak_rss_bytes).collect::<Vec<_>>()),
        f(|r| r.sent_data_bytes).with_name("sent_data_bytes".into()),
        f(|r| r.sent_tensor_bytes).with_name("sent_tensor_bytes".into()),
        f(|r| r.sent_pipeline_bytes).with_name("sent_pipeline_bytes".into()),
    ];
    DataFrame::new(n, cols)
}

pub fn steps_frame(run_id: &str, rows: &[StepRow]) -> PolarsResult<DataFrame> {
    let n = rows.len();
    let f = |name: &str, g: fn(&StepRow) -> f64| Column::new(name.into(), rows.iter().map(g).collect::<Vec<_>>());
    let cols = vec![
        Column::new("run_id".into(), vec![run_id; n]),
        Column::new("epoch".into(), rows.iter().map(|r| r.epoch).collect::<Vec<_>>()),
        Column::new("step".into(), rows.iter().map(|r| r.step).collect::<Vec<_>>()),
        Column::new("rank".into(), rows.iter().map(|r| r.rank).collect::<Vec<_>>()),
        f("batch_s", |r| r.batch_s),
        f("forward_s", |r| r.forward_s),
        f("loss_s", |r| r.loss_s),
        f("backward_s", |r| r.backward_s),
        f("sync_s", |r| r.sync_s),
        f("overlap_s", |r| r.overlap_s),
        f("update_s", |r| r.update_s),
        f("recompute_s", |r| r.recompute_s),
    ];
    DataFrame::new(n, cols)
}

/// Writes `df` to `path` atomically (complete or absent, never half-written).
pub fn write_parquet(path: &Path, df: &mut DataFrame) -> anyhow::Result<()> {
    let mut buf = Vec::new();
    ParquetWriter::new(&mut buf).finish(df)?;
    crate::rundir::atomic_write(path, &buf)
}

pub fn read_parquet(path: &Path) -> anyhow::Result<DataFrame> {
    use anyhow::Context;
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let df = ParquetReader::new(file).finish();
    anyhow::Context::with_context(df, || format!("cannot read {}", path.display()))
}
