//! The trained model outside training: the preprocessing a run fitted (`preprocessing.json` in
//! the run directory, and the same JSON in model.safetensors' metadata, so the model file alone
//! is usable without the runner) and `runner predict RUN_DIR DATA`, which applies both to a csv
//! or parquet file.
use std::path::Path;

use anyhow::Context;
use polars::prelude::*;
use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

use crate::config::schema::{NormalizeMethod, NormalizeScope, Source};
use crate::data::columns::{Columns, Labels};
use crate::data::normalize::Normalizer;
use crate::dist::ProcessGroup;
use crate::plan::Plan;

pub use crate::rundir::PREPROCESSING;
pub use crate::rundir::SPLIT;

/// One rank's normalisation: x ↦ (x - offset) / scale per model input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Statistics {
    pub offset: Vec<f32>,
    pub scale: Vec<f32>,
}

/// Everything between a data file's cells and the model's input, and between its output and a
/// prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Preprocessing {
    pub run_id: String,
    /// The data file and its FNV-1a digest (absent for synthetic data).
    pub data_file: Option<crate::plan::InputFile>,
    /// The model's inputs in order (`column` or `column=value` for one-hot columns).
    pub inputs: Vec<String>,
    /// Feature encodings, missing-value fills, class names or the target's mean and std.
    pub columns: Option<Columns>,
    pub normalize_method: NormalizeMethod,
    pub normalize_scope: NormalizeScope,
    /// Each rank's statistics (all equal with scope "global").
    pub ranks: Vec<Statistics>,
    /// The rank whose statistics validation used, and `runner predict` uses.
    pub validation_rank: usize,
}

/// The run's model.safetensors. A run without one is refused saying how the run ended, from its
/// manifest.
pub fn trained_model(run_dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    use crate::rundir::manifest::{Manifest, Status};
    let path = run_dir.join(crate::rundir::MODEL);
    if path.exists() {
        return Ok(path);
    }
    let why = match Manifest::read(run_dir) {
        Ok(m) if m.status == Status::Complete => "its manifest says complete, but the file is gone".to_owned(),
        Ok(m) => format!(
            "the run did not finish (its manifest says {}{}); runner run --resume {} continues it from its newest \
             checkpoint",
            format!("{:?}", m.status).to_lowercase(),
            m.failure.map(|f| format!(": {f}")).unwrap_or_default(),
            run_dir.display()
        ),
        Err(_) => "it is not a run directory (no readable manifest.json)".to_owned(),
    };
    anyhow::bail!("{} has no {}: {why}", run_dir.display(), crate::rundir::MODEL)
}

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
    let weights = crate::model::read_weights(&trained_model(run_dir)?, &crate::model::sorted_parameters(arch.as_ref()))
        .map_err(anyhow::Error::msg)?;
    for (name, mut var) in vs.variables() {
        tch::no_grad(|| var.copy_(&weights[&name]));
    }
    Ok((vs, model))
}

/// Rank 0 writes `preprocessing.json` with every rank's statistics; every rank takes part.
pub fn save(plan: &Plan, pg: &ProcessGroup, normalizer: &Normalizer, run_dir: &Path) -> anyhow::Result<()> {
    let (offset, scale) = normalizer.parts();
    let f = offset.len();
    let mine: Vec<f32> = offset.into_iter().chain(scale).collect();
    let all = pg.all_gather(&Tensor::from_slice(&mine))?;
    if pg.rank() != 0 {
        return Ok(());
    }
    let ranks = all
        .iter()
        .map(|t| {
            let v = Vec::<f32>::try_from(t).unwrap_or_default();
            Statistics { offset: v[..f].to_vec(), scale: v[f..].to_vec() }
        })
        .collect();
    let columns = plan.data.file().map(|i| i.columns.clone());
    let inputs = match &columns {
        Some(c) => c.input_names(),
        None => (0..plan.data.input_size()).map(|j| format!("x{j}")).collect(),
    };
    let p = Preprocessing {
        run_id: plan.run_id.clone(),
        data_file: plan.inputs.iter().find(|i| i.key == "load.path").cloned(),
        inputs,
        columns,
        normalize_method: plan.config.normalize.method,
        normalize_scope: plan.config.normalize.scope,
        ranks,
        validation_rank: 0,
    };
    let json = serde_json::to_string_pretty(&p)? + "\n";
    crate::rundir::atomic_write(&run_dir.join(PREPROCESSING), json.as_bytes())?;
    // Which rows trained and validated, for every source with rows (a tensors file's too).
    let split = match &plan.data.source {
        crate::data::SourceSpec::Table(info) => {
            let rows = crate::data::file::load(info).map_err(anyhow::Error::msg)?;
            Some(serde_json::json!({
                "file": info.path,
                "validation_file": info.validation_path,
                "train": rows.train_rows,
                "validation": rows.val_rows,
            }))
        }
        crate::data::SourceSpec::Tensors(info) => {
            Some(crate::data::tensors::split_record(info).map_err(anyhow::Error::msg)?)
        }
        crate::data::SourceSpec::Synthetic(_) | crate::data::SourceSpec::Tokens(_) => None,
    };
    if let Some(split) = split {
        crate::rundir::atomic_write(&run_dir.join(SPLIT), (split.to_string() + "\n").as_bytes())?;
    }
    Ok(())
}

/// `runner predict`: predictions for every row of `data` (parquet at `out`), and the metrics
/// when the file holds the target.
pub fn predict(run_dir: &Path, data: &Path, out: Option<&Path>) -> anyhow::Result<u8> {
    let plan = Plan::load(&run_dir.join(crate::rundir::PLAN))?;
    let pre_path = run_dir.join(PREPROCESSING);
    let pre: Preprocessing =
        serde_json::from_str(&std::fs::read_to_string(&pre_path).with_context(|| {
            format!("cannot read {} (a run of an older runner, or not finished?)", pre_path.display())
        })?)
        .with_context(|| format!("{} is damaged", pre_path.display()))?;
    let info = plan.data.file().with_context(|| {
        format!(
            "this run trained on {}: runner predict reads csv or parquet files with the run's columns",
            plan.data.describe()
        )
    })?;
    let columns = &info.columns;
    crate::input::regular_file(data).map_err(anyhow::Error::msg)?;
    let source = match data.extension().and_then(|e| e.to_str()) {
        Some("parquet") => Source::Parquet,
        _ => Source::Csv,
    };
    let df = crate::data::file::read(data, source, info.delimiter, None).map_err(anyhow::Error::msg)?;
    let enc = crate::data::columns::encode(&df, data, columns).map_err(anyhow::Error::msg)?;
    if enc.unseen > 0 {
        crate::say_err!(
            "note: {} cells of one-hot columns hold values the training rows did not; they encode as no category",
            enc.unseen
        );
    }
    tch::set_num_threads(plan.threads_per_rank as i32);
    let n = enc.rows.len() as i64;
    let shape: Vec<i64> = std::iter::once(n).chain(plan.data.input.iter().map(|&d| d as i64)).collect();
    let x = Tensor::from_slice(&enc.x).view(shape.as_slice());
    let stats = &pre.ranks[pre.validation_rank];
    let x = Normalizer::from_parts(&stats.offset, &stats.scale).apply(&x);
    let arch = plan.model();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = arch.build(&vs.root(), 0..arch.layers().len(), &crate::model::BuildContext::new(plan.config.run.seed));
    let model_path = trained_model(run_dir)?;
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

    let rows: Vec<u64> = enc.rows.iter().map(|&r| r as u64).collect();
    let mut cols = vec![Column::new("row".into(), rows)];
    let target = match columns.labels {
        Labels::Values { mean, std } => Some((mean, std)),
        Labels::Classes { .. } => None,
    };
    match (&columns.labels, target) {
        (Labels::Classes { names }, _) => {
            let probs = output.softmax(-1, Kind::Float);
            let pred: Vec<i64> = Vec::try_from(output.argmax(-1, false))?;
            cols.push(Column::new(
                "prediction".into(),
                pred.iter().map(|&p| names[p as usize].clone()).collect::<Vec<_>>(),
            ));
            for (k, name) in names.iter().enumerate() {
                let p: Vec<f32> = Vec::try_from(probs.select(1, k as i64).contiguous())?;
                cols.push(Column::new(format!("p_{name}").into(), p));
            }
        }
        (Labels::Values { .. }, Some((mean, std))) => {
            let v: Vec<f32> = Vec::try_from(output.squeeze_dim(-1).contiguous())?;
            cols.push(Column::new("prediction".into(), v.iter().map(|&y| y as f64 * std + mean).collect::<Vec<_>>()));
        }
        _ => unreachable!("values have a target scale"),
    }
    let out_path = out.map(Path::to_owned).unwrap_or_else(|| run_dir.join("predictions.parquet"));
    let mut frame = DataFrame::new(rows_len(&cols), cols)?;
    crate::trace::write_parquet(&out_path, &mut frame)?;
    crate::say!("{} predictions written to {}", n, out_path.display());
    if let Some(y) = &enc.y {
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
