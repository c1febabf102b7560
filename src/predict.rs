//! The trained model outside training: the run's model, built for inference, and `runner
//! predict RUN_DIR DATA`, which applies the preprocessing the run fitted
//! ([`crate::preprocessing`]) and the model to a csv or parquet file.
use std::path::Path;

use anyhow::Context;
use polars::prelude::*;
use tch::{nn, Kind, Tensor};

use crate::config::schema::Source;
use crate::data::columns::{Columns, Feature, Labels};
use crate::data::normalize::Normalizer;
use crate::plan::Plan;

use crate::preprocessing::Preprocessing;
use crate::rundir::PREPROCESSING;

/// The run's trained model (its model.safetensors) built on `device` for inference: every layer,
/// every variable loaded; the module and the variables it computes with.
pub fn trained_module(
    plan: &Plan,
    run_dir: &Path,
    device: tch::Device,
) -> anyhow::Result<(nn::VarStore, Box<dyn nn::ModuleT + 'static>)> {
    let arch = plan.model();
    let vs = nn::VarStore::new(device);
    let model = arch.build(&vs.root(), 0..arch.layers().len(), &crate::model::BuildContext::new(plan.config.run.seed));
    let weights = crate::model::read_weights(
        &crate::checkpoint::model::trained_model(run_dir)?,
        &crate::model::sorted_parameters(arch.as_ref()),
    )
    .map_err(anyhow::Error::msg)?;
    for (name, mut var) in vs.variables() {
        tch::no_grad(|| var.copy_(&weights[&name]));
    }
    Ok((vs, model))
}

/// Which weights `runner predict` applies: the run's last model, its best (early stopping), or a
/// weights file of the same model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelChoice {
    Final,
    Best,
    File(std::path::PathBuf),
}

impl std::str::FromStr for ModelChoice {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "final" => ModelChoice::Final,
            "best" => ModelChoice::Best,
            path => ModelChoice::File(path.into()),
        })
    }
}

/// `runner predict`'s choices beyond the run's own: the weights, and the keys of the new file's
/// reading (`--set load.missing=...`, `--set load.delimiter=...`).
#[derive(Debug, Clone)]
pub struct Options {
    pub model: ModelChoice,
    pub set: Vec<String>,
}

/// The keys `runner predict --set` honours: how the new file is read. Everything else (the
/// columns, encodings, normalisation) is the run's and cannot change.
pub const PREDICT_KEYS: &[&str] = &["load.missing", "load.delimiter"];

/// The weights file `choice` names in `run_dir`.
fn weights_file(run_dir: &Path, choice: &ModelChoice) -> anyhow::Result<std::path::PathBuf> {
    match choice {
        ModelChoice::Final => crate::checkpoint::model::trained_model(run_dir),
        ModelChoice::Best => {
            let path = run_dir.join(crate::rundir::BEST_MODEL);
            anyhow::ensure!(
                path.exists(),
                "{} has no {}: the best model is kept by runs with [train.early_stop]; --model final takes the \
                 last one",
                run_dir.display(),
                crate::rundir::BEST_MODEL
            );
            Ok(path)
        }
        ModelChoice::File(path) => {
            crate::input::regular_file(path).map_err(anyhow::Error::msg)?;
            Ok(path.clone())
        }
    }
}

/// The run's columns with `--set load.missing` and the delimiter `--set load.delimiter` gives.
fn with_sets(columns: &Columns, delimiter: u8, set: &[String]) -> anyhow::Result<(Columns, u8)> {
    use crate::config::schema::Missing;
    let (mut columns, mut delimiter) = (columns.clone(), delimiter);
    for s in set {
        let bad = |why: String| crate::config::ConfigError::new(format!("--set {s}: {why}"));
        let (key, raw) = s.split_once('=').ok_or_else(|| bad("expected KEY=VALUE".into()))?;
        let raw = raw.trim();
        let value: toml::Value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(raw.to_owned()));
        match key.trim() {
            "load.missing" => {
                let m: Missing = value.try_into().map_err(|_| {
                    bad("load.missing is one of \"error\", \"drop\", \"mean\", \"median\", \"zero\"".into())
                })?;
                let fitted = columns.features.iter().all(|f| match f {
                    Feature::Numeric { fill, .. } => fill.is_some(),
                    Feature::OneHot { .. } => true,
                });
                if matches!(m, Missing::Mean | Missing::Median) && !fitted {
                    return Err(bad(format!(
                        "the run fitted no {} of its training rows (it trained with load.missing = \"{}\"): use \
                         \"drop\" or \"zero\"",
                        format!("{m:?}").to_lowercase(),
                        format!("{:?}", columns.missing).to_lowercase()
                    ))
                    .into());
                }
                if m == Missing::Zero {
                    for f in &mut columns.features {
                        if let Feature::Numeric { fill, .. } = f {
                            *fill = Some(0.0);
                        }
                    }
                }
                columns.missing = m;
            }
            "load.delimiter" => match value.as_str().map(|v| v.chars().collect::<Vec<_>>()) {
                Some(c) if c.len() == 1 && c[0].is_ascii() => delimiter = c[0] as u8,
                _ => return Err(bad("load.delimiter is one ASCII character, e.g. \";\"".into()).into()),
            },
            other => {
                return Err(bad(format!(
                    "runner predict reads the new file with the run's columns, encodings and normalisation; it \
                     takes only {} (`{other}` is the run's)",
                    PREDICT_KEYS.join(" and ")
                ))
                .into())
            }
        }
    }
    Ok((columns, delimiter))
}

/// The model's inputs (not yet normalised) and, when the file holds them, the targets: from a
/// csv or parquet file with the run's columns, or from arrays (`.npy` of `x`; `.npz` of `x` and
/// optionally `y`) shaped as the model's inputs.
struct Inputs {
    x: Tensor,
    y: Option<Vec<f64>>,
    /// The file's row of each input.
    rows: Vec<u64>,
}

fn read_inputs(plan: &Plan, data: &Path, options: &Options) -> anyhow::Result<Inputs> {
    // A data file that cannot be read is the command line's mistake, as a missing pipeline file is.
    crate::input::regular_file(data).map_err(crate::config::ConfigError::new)?;
    let ext = data.extension().and_then(|e| e.to_str()).unwrap_or_default().to_ascii_lowercase();
    if ext == "npy" || ext == "npz" {
        anyhow::ensure!(
            options.set.is_empty(),
            "--set reads csv and parquet files; {} holds arrays, read as they are",
            data.display()
        );
        return read_arrays(plan, data, &ext);
    }
    let info = plan.data.file().with_context(|| {
        format!(
            "this run trained on {}: runner predict reads its inputs from .npy or .npz arrays (x, and y for the \
             metrics), not from csv or parquet files",
            plan.data.describe()
        )
    })?;
    let (columns, delimiter) = with_sets(&info.columns, info.delimiter, &options.set)?;
    let source = if ext == "parquet" { Source::Parquet } else { Source::Csv };
    let df = crate::data::file::read(data, source, delimiter, None).map_err(anyhow::Error::msg)?;
    let enc = crate::data::columns::encode(&df, data, &columns).map_err(|e| {
        // At predict time the key is set on the command line.
        let e = e.replace("set load.missing = ", "pass --set load.missing=");
        anyhow::anyhow!(e)
    })?;
    if enc.unseen > 0 {
        crate::say_err!(
            "note: {} cells of one-hot columns hold values the training rows did not; they encode as no category",
            enc.unseen
        );
    }
    let shape: Vec<i64> =
        std::iter::once(enc.rows.len() as i64).chain(plan.data.input.iter().map(|&d| d as i64)).collect();
    let x = Tensor::from_slice(&enc.x).view(shape.as_slice());
    Ok(Inputs { x, y: enc.y, rows: enc.rows.iter().map(|&r| r as u64).collect() })
}

/// `x` (and `y`) from an `.npy` or `.npz` file, checked against the model's input shape.
fn read_arrays(plan: &Plan, data: &Path, ext: &str) -> anyhow::Result<Inputs> {
    anyhow::ensure!(
        !plan.data.task.is_language_model(),
        "this run is a language model: runner predict --prompt samples text from it"
    );
    let shown = data.display();
    let (x, y) = if ext == "npy" {
        (Tensor::read_npy(data).with_context(|| format!("cannot read {shown} as an .npy array"))?, None)
    } else {
        let arrays = Tensor::read_npz(data).with_context(|| format!("cannot read {shown} as an .npz archive"))?;
        let get = |name: &str| arrays.iter().find(|(n, _)| n == name).map(|(_, t)| t.shallow_clone());
        let x = get("x").with_context(|| {
            let names: Vec<&str> = arrays.iter().map(|(n, _)| n.as_str()).collect();
            format!("{shown} has no array `x` (it holds {}): name the inputs x, and the targets y", names.join(", "))
        })?;
        (x, get("y"))
    };
    let want: Vec<i64> = plan.data.input.iter().map(|&d| d as i64).collect();
    let size = x.size();
    anyhow::ensure!(
        size.len() == want.len() + 1 && size[1..] == want[..],
        "{shown}: x is {:?}, but the model takes rows of {:?} (N × {}): {}",
        size,
        want,
        want.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(" × "),
        match plan.data.file() {
            Some(info) => format!("the run's inputs, in order: {}", info.columns.input_names().join(", ")),
            None => "the shape of load.path's x".into(),
        }
    );
    let x = x.to_kind(Kind::Float);
    anyhow::ensure!(x.isfinite().all().int64_value(&[]) == 1, "{shown}: x holds NaN or infinite values");
    let n = size[0];
    let y = match y {
        None => None,
        Some(y) => {
            anyhow::ensure!(
                y.size() == [n],
                "{shown}: y is {:?}, but x has {n} rows: y holds one target per row",
                y.size()
            );
            let v: Vec<f64> = Vec::try_from(y.to_kind(Kind::Double))?;
            if let crate::data::Task::Classification { classes: k } = plan.data.task {
                if let Some(bad) = v.iter().find(|&&c| c < 0.0 || c.fract() != 0.0 || c >= k as f64) {
                    anyhow::bail!("{shown}: y holds {bad}, not a class id of this run (0 to {})", k - 1);
                }
            }
            Some(v)
        }
    };
    Ok(Inputs { x, y, rows: (0..n as u64).collect() })
}

/// `runner predict`: predictions for every row of `data` (parquet at `out`), and the metrics
/// when the file holds the targets.
pub fn predict(run_dir: &Path, data: &Path, out: Option<&Path>, options: &Options) -> anyhow::Result<u8> {
    let plan = Plan::load(&run_dir.join(crate::rundir::PLAN))?;
    let pre_path = run_dir.join(PREPROCESSING);
    let pre: Preprocessing =
        serde_json::from_str(&std::fs::read_to_string(&pre_path).with_context(|| {
            format!("cannot read {} (a run of an older runner, or not finished?)", pre_path.display())
        })?)
        .with_context(|| format!("{} is damaged", pre_path.display()))?;
    let model_path = weights_file(run_dir, &options.model)?;
    let inputs = read_inputs(&plan, data, options)?;
    tch::set_num_threads(plan.threads_per_rank as i32);
    let n = inputs.rows.len();
    let stats = &pre.ranks[pre.validation_rank];
    let x = Normalizer::from_parts(&stats.offset, &stats.scale).apply(&inputs.x);
    let arch = plan.model();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = arch.build(&vs.root(), 0..arch.layers().len(), &crate::model::BuildContext::new(plan.config.run.seed));
    let weights = crate::model::read_weights(&model_path, &crate::model::sorted_parameters(arch.as_ref()))
        .map_err(anyhow::Error::msg)?;
    for (name, mut var) in vs.variables() {
        tch::no_grad(|| var.copy_(&weights[&name]));
    }
    // A user's module that raises ends the command with its one-line message.
    let forward = std::panic::AssertUnwindSafe(|| tch::no_grad(|| model.forward_t(&x, false)));
    let output =
        std::panic::catch_unwind(forward).map_err(|panic| match panic.downcast::<crate::checked::Failure>() {
            Ok(failure) => anyhow::anyhow!(failure.0),
            Err(_) => anyhow::anyhow!("the model failed on {}", data.display()),
        })?;

    let columns = plan.data.file().map(|i| &i.columns);
    let target = match columns.map(|c| &c.labels) {
        Some(Labels::Values { mean, std }) => Some((*mean, *std)),
        _ if plan.data.task == crate::data::Task::Regression => Some((0.0, 1.0)),
        _ => None,
    };
    let mut cols = vec![Column::new("row".into(), inputs.rows.clone())];
    match target {
        None => {
            let probs = output.softmax(-1, Kind::Float);
            let pred: Vec<i64> = Vec::try_from(output.argmax(-1, false))?;
            let names: Vec<String> = match columns.and_then(Columns::classes) {
                Some(names) => names.to_vec(),
                None => (0..plan.data.task.outputs()).map(|k| k.to_string()).collect(),
            };
            cols.push(Column::new(
                "prediction".into(),
                pred.iter().map(|&p| names[p as usize].clone()).collect::<Vec<_>>(),
            ));
            for (k, name) in names.iter().enumerate() {
                let p: Vec<f32> = Vec::try_from(probs.select(1, k as i64).contiguous())?;
                cols.push(Column::new(format!("p_{name}").into(), p));
            }
        }
        Some((mean, std)) => {
            let v: Vec<f32> = Vec::try_from(output.squeeze_dim(-1).contiguous())?;
            cols.push(Column::new("prediction".into(), v.iter().map(|&y| y as f64 * std + mean).collect::<Vec<_>>()));
        }
    }
    let out_path = out.map(Path::to_owned).unwrap_or_else(|| run_dir.join("predictions.parquet"));
    let mut frame = DataFrame::new(rows_len(&cols), cols)?;
    crate::trace::write_parquet(&out_path, &mut frame)?;
    crate::say!("{} predictions written to {}", n, out_path.display());
    if let Some(y) = &inputs.y {
        let y = match target {
            Some((mean, std)) => Tensor::from_slice(&y.iter().map(|v| ((v - mean) / std) as f32).collect::<Vec<f32>>()),
            None => Tensor::from_slice(&y.iter().map(|&v| v as i64).collect::<Vec<i64>>()),
        };
        let m = crate::data::metrics(plan.data.task, target, &output, &y);
        let mut line = format!("loss {}", m.loss);
        for (name, v) in [("acc", m.acc), ("f1", m.f1), ("rmse", m.rmse), ("mae", m.mae), ("r2", m.r2)] {
            if !v.is_nan() {
                line += &format!("  {name} {v}");
            }
        }
        crate::say!("{line}");
    }
    Ok(0)
}

fn rows_len(cols: &[Column]) -> usize {
    cols.first().map_or(0, |c| c.len())
}
