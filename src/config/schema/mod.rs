//! The pipeline file's sections, one struct per stage, every field with its default.
//! Unknown keys are errors (`deny_unknown_fields`); kinds are closed enums.
mod data;
mod model;
mod run;
mod train;
mod wrap;

pub use data::*;
pub use model::*;
pub use run::*;
pub use train::*;
pub use wrap::*;

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
