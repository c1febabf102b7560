//! Trackers: what rank 0 sends to TensorBoard (`trace.tensorboard`) and MLflow (`[track]`) as
//! the run goes. The stage loop calls [`Tracker::row`] each time a trace row is produced (every
//! epoch, or every `validate.every_steps` interval), [`Tracker::step`] every
//! `trace.log_every_steps` optimizer steps, and [`Tracker::finish`] at the end. A tracker never
//! fails a run: a problem is said once on stderr and that tracker stops.
use std::path::{Path, PathBuf};

use crate::config::schema::Config;
use crate::plan::Plan;
use crate::trace::mlflow::{self, Mlflow};
use crate::trace::tensorboard::{self, EventWriter};
use crate::trace::EpochRow;

/// The scalars of a trace row (rank 0's row, which holds the global training metrics), by the
/// names TensorBoard and MLflow show; absent metrics (no validation, no clipping) are left out.
pub fn row_scalars(r: &EpochRow) -> Vec<(String, f64)> {
    let acc = Some(r.global_train_acc).filter(|a| !a.is_nan());
    let all = [
        ("train/loss", Some(r.global_train_loss)),
        ("train/accuracy", acc),
        ("train/perplexity", r.perplexity),
        ("train/lr", Some(r.lr)),
        ("train/grad_norm", r.grad_norm_mean),
        ("val/loss", r.val_loss),
        ("val/accuracy", r.val_acc),
        ("val/f1", r.val_f1),
        ("val/rmse", r.val_rmse),
        ("val/mae", r.val_mae),
        ("val/r2", r.val_r2),
        ("val/perplexity", r.val_perplexity),
        ("throughput/samples_per_s", Some(r.samples_per_s)),
        ("throughput/tokens_per_s", r.tokens_per_s),
        ("throughput/mfu", r.mfu),
        ("time/epoch_s", Some(r.epoch_s)),
    ];
    all.into_iter().filter_map(|(k, v)| Some((k.to_owned(), v?))).collect()
}

/// Rank 0's training metrics at one optimizer step.
#[derive(Debug, Clone, Copy)]
pub struct StepMetrics {
    /// Rank 0's mean loss over the step's rows; `None` where rank 0 does not compute the loss
    /// (a pipeline's first stage).
    pub loss: Option<f64>,
    pub lr: f64,
    pub grad_norm: Option<f64>,
}

pub struct Tracker {
    tensorboard: Option<EventWriter>,
    mlflow: Option<Mlflow>,
    log_every: usize,
}

impl Tracker {
    /// Rank 0's trackers (none on the other ranks): opens the event file, writes the
    /// configuration and the hparams, and starts the MLflow run.
    pub fn start(plan: &Plan, run_dir: &Path, rank: usize) -> Tracker {
        let c = &plan.config;
        let mut t = Tracker { tensorboard: None, mlflow: None, log_every: c.trace.log_every_steps };
        if rank != 0 {
            return t;
        }
        if c.trace.tensorboard {
            let opened = EventWriter::create(run_dir).and_then(|mut w| {
                w.text("config", &format!("```toml\n{}\n```", plan.annotated_toml()))?;
                let hparams = params(plan).into_iter().map(|(k, v)| (k, tensorboard::hparam(&v))).collect();
                w.hparams_start(hparams, &c.run.name)?;
                Ok(w)
            });
            t.tensorboard = warn_on_error(opened, run_dir);
        }
        if let Some(url) = &c.track.mlflow {
            let text = |v: &toml::Value| v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            let mut tags = vec![("runner.run_id".to_owned(), plan.run_id.clone())];
            tags.extend(sweep_axes(plan).into_iter().map(|(k, v)| (k, text(&v))));
            t.mlflow = Some(Mlflow::start(mlflow::Target {
                url: url.clone(),
                experiment: experiment(c),
                run_name: run_name(plan, run_dir),
                params: params(plan).iter().map(|(k, v)| (k.clone(), text(v))).collect(),
                tags,
            }));
        }
        t
    }

    /// Whether [`Tracker::step`] wants the metrics of the step that made `done` steps.
    pub fn wants_step(&self, done: usize) -> bool {
        (self.tensorboard.is_some() || self.mlflow.is_some())
            && self.log_every > 0
            && done.is_multiple_of(self.log_every)
    }

    /// The training metrics after `done` optimizer steps (`step/loss`, `step/lr`, `step/grad_norm`).
    pub fn step(&mut self, done: usize, m: StepMetrics) {
        let values: Vec<(String, f64)> =
            [("step/loss", m.loss), ("step/lr", Some(m.lr)), ("step/grad_norm", m.grad_norm)]
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_owned(), v?)))
                .collect();
        self.send(done as u64, &values);
    }

    /// A trace row was produced: its scalars at its optimizer step.
    pub fn row(&mut self, row: &EpochRow) {
        self.send(row.step, &row_scalars(row));
    }

    fn send(&mut self, step: u64, values: &[(String, f64)]) {
        if let Some(w) = self.tensorboard.as_mut() {
            if let Err(e) = w.scalars(step, values) {
                crate::say_err!("warning: TensorBoard events are no longer written to {}: {e}", w.path.display());
                self.tensorboard = None;
            }
        }
        if let Some(m) = self.mlflow.as_mut() {
            m.metrics(step, values);
        }
    }

    /// The run ended: the hparams session's end, and MLflow's artifacts (the run directory's
    /// config, plan, traces and model) and report line.
    pub fn finish(mut self, run_dir: &Path) {
        self.end(Some(run_dir));
    }

    /// Ends the trackers; without `run_dir` (an error left the stage loop), as a failed run
    /// with no artifacts.
    fn end(&mut self, run_dir: Option<&Path>) {
        if let Some(mut w) = self.tensorboard.take() {
            if let Err(e) = w.hparams_end(run_dir.is_some()) {
                crate::say_err!("warning: {}: {e}", w.path.display());
            }
        }
        if let Some(m) = self.mlflow.take() {
            use crate::rundir::*;
            let files: Vec<PathBuf> = run_dir
                .map(|d| [CONFIG, PLAN, TRACE, STEPS, MODEL, BEST_MODEL].iter().map(|f| d.join(f)).collect())
                .unwrap_or_default();
            crate::say!("  {}", m.finish(files, run_dir.is_some()));
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.end(None);
    }
}

fn warn_on_error<T>(r: std::io::Result<T>, run_dir: &Path) -> Option<T> {
    r.map_err(|e| {
        crate::say_err!(
            "warning: no TensorBoard events: cannot write {}: {e}",
            run_dir.join(crate::rundir::TENSORBOARD).display()
        )
    })
    .ok()
}

/// The experiment MLflow files the run under: `track.experiment`, or the run's name.
pub fn experiment(c: &Config) -> String {
    c.track.experiment.clone().unwrap_or_else(|| c.run.name.clone())
}

/// The MLflow run's name: the run directory's name (a sweep point's directory, or the run id).
fn run_name(plan: &Plan, run_dir: &Path) -> String {
    run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| plan.run_id.clone())
}

/// The hyperparameters: every value the configuration sets (not defaults), and the run's
/// identity (seed, world size, batch, rate, length).
fn params(plan: &Plan) -> Vec<(String, toml::Value)> {
    const ALWAYS: &[&str] =
        &["run.seed", "run.world_size", "train.batch_size", "train.lr", "train.epochs", "train.optimizer"];
    let value = toml::Value::try_from(plan.config.without_tracking()).expect("a Config serializes");
    let mut leaves = Vec::new();
    crate::config::resolve::flatten("", &value, &mut leaves);
    leaves
        .into_iter()
        .filter(|(k, _)| ALWAYS.contains(&k.as_str()) || plan.sources.get(k).is_some_and(|s| s != "default"))
        .collect()
}

/// The keys a sweep set on this point, and their values.
fn sweep_axes(plan: &Plan) -> Vec<(String, toml::Value)> {
    let value = toml::Value::try_from(&plan.config).expect("a Config serializes");
    let mut leaves = Vec::new();
    crate::config::resolve::flatten("", &value, &mut leaves);
    let axis = crate::config::resolve::AXIS_LABEL;
    leaves.into_iter().filter(|(k, _)| plan.sources.get(k).is_some_and(|s| s.starts_with(axis))).collect()
}

/// The plan's lines about tracking: where TensorBoard writes (in `run_dir`, when known), and
/// whether the MLflow server answers (asked once, here, with a short timeout).
pub fn plan_lines(plan: &Plan, run_dir: Option<&Path>) -> Vec<String> {
    let c = &plan.config;
    let mut out = Vec::new();
    if c.trace.tensorboard {
        let dir = run_dir.map_or("RUN_DIR".to_owned(), |d| d.display().to_string());
        out.push(format!("tensorboard: events in {dir}/{} (tensorboard --logdir {dir})", crate::rundir::TENSORBOARD));
    }
    if let Some(url) = &c.track.mlflow {
        out.push(mlflow::probe(url, &experiment(c)));
    }
    out
}
