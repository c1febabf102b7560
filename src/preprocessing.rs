//! The preprocessing a run fitted, between a data file's cells and the model's input and between
//! its output and a prediction: `preprocessing.json` in the run directory (and the same JSON in
//! model.safetensors' metadata, so the model file alone is usable without the runner), written
//! by training, read by `runner predict`; and `split.json`, which rows trained and validated.
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::config::schema::{NormalizeMethod, NormalizeScope};
use crate::data::columns::Columns;
use crate::data::normalize::Normalizer;
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::rundir::{PREPROCESSING, SPLIT};

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

/// Rank 0 writes `preprocessing.json` with every rank's statistics; every rank takes part.
pub fn write(plan: &Plan, pg: &ProcessGroup, normalizer: &Normalizer, run_dir: &Path) -> anyhow::Result<()> {
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
        // The training examples are the file's first ones (or all of it with a validation file).
        crate::data::SourceSpec::Instructions(i) => Some(serde_json::json!({
            "file": i.path,
            "validation_file": i.validation_path,
            "train_examples": i.train_examples,
        })),
        crate::data::SourceSpec::Synthetic(_) | crate::data::SourceSpec::Tokens(_) => None,
    };
    if let Some(split) = split {
        crate::rundir::atomic_write(&run_dir.join(SPLIT), (split.to_string() + "\n").as_bytes())?;
    }
    Ok(())
}
