//! Columns: which cells of a data file become the model's input and target, and how. [`fit`]
//! learns the encoding from the training rows on the plan (feature columns in order, one-hot
//! vocabularies, fill values, class names or the target's scale); [`encode`] applies a saved
//! encoding to any file with those columns: the ranks' training file, a validation file, and
//! `runner predict`'s input.
//!
//! Rules: numeric and boolean columns are numbers (booleans 0/1); string columns are one-hot
//! encoded with the training rows' sorted values, and a value the training rows never held
//! (or a missing one, when filled) encodes as all zeros. Class labels (integers, strings or
//! booleans) map to ids in sorted order. Non-finite numbers (NaN, ±inf, values beyond float32)
//! are refused.
mod encode;

pub use encode::{encode, Encoded};

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use polars::prelude::*;
use serde::{Deserialize, Serialize};

use crate::config::schema::{Missing, TaskKind};

/// More distinct labels than this is not a classification (an ID, a measurement).
pub const MAX_CLASSES: usize = 1000;

/// A fitted encoding: saved in the plan, the run directory and the model's metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Columns {
    pub features: Vec<Feature>,
    pub target: String,
    pub labels: Labels,
    pub missing: Missing,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Feature {
    /// One input: the number (booleans 0/1); `fill` replaces a missing cell (load.missing =
    /// "mean", "median" or "zero").
    Numeric { name: String, fill: Option<f64> },
    /// One input per value the training rows hold, in sorted order: 1 for the row's value.
    OneHot { name: String, values: Vec<String> },
}

impl Feature {
    pub fn name(&self) -> &str {
        match self {
            Feature::Numeric { name, .. } | Feature::OneHot { name, .. } => name,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Labels {
    /// Class id i is `names[i]`.
    Classes { names: Vec<String> },
    /// Regression: the model learns (y - mean) / std; predictions are un-normalised.
    Values { mean: f64, std: f64 },
}

impl Columns {
    /// The model's inputs, in order: `name` or `name=value` for one-hot columns.
    pub fn input_names(&self) -> Vec<String> {
        self.features
            .iter()
            .flat_map(|f| match f {
                Feature::Numeric { name, .. } => vec![name.clone()],
                Feature::OneHot { name, values } => values.iter().map(|v| format!("{name}={v}")).collect(),
            })
            .collect()
    }

    pub fn classes(&self) -> Option<&[String]> {
        match &self.labels {
            Labels::Classes { names } => Some(names),
            Labels::Values { .. } => None,
        }
    }
}

/// What the pipeline asks of the columns.
#[derive(Debug, Clone)]
pub struct Choice<'a> {
    pub target: &'a str,
    /// Absent: every column but the target and `exclude`.
    pub features: Option<&'a [String]>,
    pub exclude: &'a [String],
    pub missing: Missing,
    pub task: TaskKind,
}

/// Cells of one column: numbers (as float64) or text.
enum Cells {
    Num(Vec<Option<f64>>),
    Text(Vec<Option<String>>),
}

impl Cells {
    fn is_null(&self, i: usize) -> bool {
        match self {
            Cells::Num(v) => v[i].is_none(),
            Cells::Text(v) => v[i].is_none(),
        }
    }
}

fn cells(df: &DataFrame, name: &str, path: &Path, as_text: bool) -> Result<Cells, String> {
    let col = df.column(name).map_err(|e| format!("{}: {e}", path.display()))?;
    let err = |e: PolarsError| format!("column `{name}` of {}: {e}", path.display());
    let dtype = col.dtype().clone();
    if !as_text && (dtype.is_primitive_numeric() || dtype == DataType::Boolean) {
        let c = col.cast(&DataType::Float64).map_err(err)?;
        return Ok(Cells::Num(c.f64().map_err(err)?.iter().collect()));
    }
    if dtype == DataType::String || dtype.is_primitive_numeric() || dtype == DataType::Boolean {
        if dtype.is_float() {
            // Integral float labels (1.0) name the same class as the integer (1).
            let c = col.cast(&DataType::Float64).map_err(err)?;
            let v = c.f64().map_err(err)?.iter();
            return Ok(Cells::Text(v.map(|o| o.map(label_text)).collect()));
        }
        let c = col.cast(&DataType::String).map_err(err)?;
        return Ok(Cells::Text(c.str().map_err(err)?.iter().map(|o| o.map(str::to_owned)).collect()));
    }
    Err(format!("column `{name}` of {} is {dtype}: columns must hold numbers, strings or booleans", path.display()))
}

fn label_text(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// The feature columns `choice` names, checked against the file's columns.
fn feature_names(names: &[String], choice: &Choice, path: &Path) -> Result<Vec<String>, String> {
    let missing_col = |name: &str, key: &str| {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let hint =
            crate::config::resolve::closest(name, &refs).map(|c| format!("; did you mean `{c}`?")).unwrap_or_default();
        format!("{key} names `{name}`, which {} does not have{hint} (columns: {})", path.display(), names.join(", "))
    };
    for e in choice.exclude {
        if !names.contains(e) {
            return Err(missing_col(e, "load.exclude"));
        }
    }
    let chosen: Vec<String> = match choice.features {
        Some(list) => {
            for f in list {
                if !names.contains(f) {
                    return Err(missing_col(f, "load.features"));
                }
                if f == choice.target {
                    return Err(format!(
                        "load.features names the target `{f}`: a model cannot take its answer as input"
                    ));
                }
            }
            if let Some(dup) = list.iter().enumerate().find(|(i, f)| list[..*i].contains(f)) {
                return Err(format!("load.features names `{}` twice", dup.1));
            }
            list.iter().filter(|f| !choice.exclude.contains(f)).cloned().collect()
        }
        None => names.iter().filter(|n| *n != choice.target && !choice.exclude.contains(n)).cloned().collect(),
    };
    if chosen.is_empty() {
        return Err(format!("{} has no feature column left besides the target `{}`", path.display(), choice.target));
    }
    Ok(chosen)
}

/// What [`fit`] learned and found.
#[derive(Debug)]
pub struct Fitted {
    pub columns: Columns,
    /// Rows kept (file order) and their target: class id, or value.
    pub rows: usize,
    pub y: Vec<f64>,
    /// What the user should know: dropped rows, filled cells.
    pub notes: Vec<String>,
}

/// Learns the encoding of `df` under `choice`, its statistics from the rows `train` picks out
/// of the kept rows (given their targets).
pub fn fit(
    df: &DataFrame,
    path: &Path,
    choice: &Choice,
    train: impl FnOnce(&[f64]) -> Result<Vec<usize>, String>,
) -> Result<Fitted, String> {
    let names: Vec<String> = df.get_column_names().iter().map(|s| s.to_string()).collect();
    let target = choice.target;
    if !names.iter().any(|n| n == target) {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let hint = crate::config::resolve::closest(target, &refs)
            .map(|c| format!("; did you mean `{c}`?"))
            .unwrap_or_default();
        return Err(format!("{} has no column `{target}`{hint} (columns: {})", path.display(), names.join(", ")));
    }
    let features = feature_names(&names, choice, path)?;
    let classification = choice.task == TaskKind::Classification;
    let tcells = cells(df, target, path, classification)?;
    let labels = labels(&tcells, classification, target, path)?;
    let mut fcells = Vec::new();
    for name in &features {
        fcells.push(cells(df, name, path, false)?);
    }
    let mut columns = Columns {
        features: features
            .iter()
            .zip(&fcells)
            .map(|(name, c)| match c {
                Cells::Num(_) => Feature::Numeric { name: name.clone(), fill: None },
                Cells::Text(_) => Feature::OneHot { name: name.clone(), values: Vec::new() },
            })
            .collect(),
        target: target.to_owned(),
        labels,
        missing: choice.missing,
    };
    let (kept, mut notes) = keep(df.height(), &tcells, &fcells, &columns, path)?;
    let y = targets(&tcells, &kept, &columns, path)?;
    for (name, c) in features.iter().zip(&fcells) {
        if let Cells::Num(v) = c {
            finite(name, v, path)?;
        }
    }
    let train = train(&y)?;
    // Statistics of the training rows only.
    let train_rows: Vec<usize> = train.iter().map(|&i| kept[i]).collect();
    for (f, c) in columns.features.iter_mut().zip(&fcells) {
        fit_feature(f, c, &train_rows, &kept, choice.missing, path, &mut notes)?;
    }
    if let Labels::Values { mean, std } = &mut columns.labels {
        let t: Vec<f64> = train.iter().map(|&i| y[i]).collect();
        let n = t.len().max(1) as f64;
        *mean = t.iter().sum::<f64>() / n;
        let var = t.iter().map(|v| (v - *mean) * (v - *mean)).sum::<f64>() / n;
        *std = if var.sqrt() > 0.0 { var.sqrt() } else { 1.0 };
    }
    Ok(Fitted { columns, rows: kept.len(), y, notes })
}

/// The target's labels: the classes found (integers in numeric order), or a value to predict.
fn labels(cells: &Cells, classification: bool, target: &str, path: &Path) -> Result<Labels, String> {
    match (cells, classification) {
        (Cells::Text(v), true) => {
            if let Some(bad) = v.iter().flatten().find(|s| s.parse::<f64>().is_ok_and(|x| x.fract() != 0.0)) {
                return Err(format!(
                    "target `{target}` of {} holds {bad}: class labels are integers, strings or booleans; to predict \
                     numbers set train.task = \"regression\"",
                    path.display()
                ));
            }
            let distinct: BTreeSet<&String> = v.iter().flatten().collect();
            let mut names: Vec<String> = distinct.into_iter().cloned().collect();
            // Integer labels sort as numbers (2 before 10).
            if names.iter().all(|n| n.parse::<i64>().is_ok()) {
                names.sort_by_key(|n| n.parse::<i64>().unwrap_or(0));
            }
            if names.len() > MAX_CLASSES {
                return Err(format!(
                    "target `{target}` of {} has {} distinct labels, more than the {MAX_CLASSES} classes a \
                     classification may have: is it a number to predict (train.task = \"regression\") or an ID?",
                    path.display(),
                    names.len()
                ));
            }
            if names.len() < 2 {
                return Err(format!(
                    "target `{target}` of {} holds a single class ({}): a classification needs at least 2",
                    path.display(),
                    names.first().map(String::as_str).unwrap_or("none")
                ));
            }
            Ok(Labels::Classes { names })
        }
        (Cells::Num(_), false) => Ok(Labels::Values { mean: 0.0, std: 1.0 }),
        _ => Err(format!(
            "target `{target}` of {} holds text: train.task = \"regression\" needs numbers",
            path.display()
        )),
    }
}

/// One feature's statistics from the training rows: a numeric column's fill for missing cells, a
/// text column's one-hot values.
fn fit_feature(
    feature: &mut Feature,
    cells: &Cells,
    train_rows: &[usize],
    kept: &[usize],
    missing: Missing,
    path: &Path,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    match (feature, cells) {
        (Feature::Numeric { name, fill }, Cells::Num(v)) => {
            let mut present: Vec<f64> = train_rows.iter().filter_map(|&i| v[i]).collect();
            let absent = kept.iter().filter(|&&i| v[i].is_none()).count();
            *fill = match missing {
                Missing::Mean if !present.is_empty() => Some(present.iter().sum::<f64>() / present.len() as f64),
                Missing::Median if !present.is_empty() => {
                    present.sort_by(f64::total_cmp);
                    let m = present.len() / 2;
                    Some(if present.len() % 2 == 1 { present[m] } else { (present[m - 1] + present[m]) / 2.0 })
                }
                Missing::Mean | Missing::Median | Missing::Zero => Some(0.0),
                Missing::Error | Missing::Drop => None,
            };
            if absent > 0 {
                notes.push(format!(
                    "column `{name}`: {absent} missing cells filled with {}",
                    fill.map(|x| format!("{x}")).unwrap_or_default()
                ));
            }
        }
        (Feature::OneHot { name, values }, Cells::Text(v)) => {
            let distinct: BTreeSet<&String> = train_rows.iter().filter_map(|&i| v[i].as_ref()).collect();
            *values = distinct.into_iter().cloned().collect();
            if values.len() > MAX_CLASSES {
                return Err(format!(
                    "column `{name}` of {} holds {} distinct strings, more than the {MAX_CLASSES} a one-hot \
                     column may have: leave it out with load.exclude (an ID?) or convert it to numbers",
                    path.display(),
                    values.len()
                ));
            }
            let absent = kept.iter().filter(|&&i| v[i].is_none()).count();
            if absent > 0 {
                notes.push(format!("column `{name}`: {absent} missing cells encoded as no category"));
            }
        }
        _ => unreachable!("features were made from their cells"),
    }
    Ok(())
}

/// The rows kept under `load.missing`, and a note of those dropped.
fn keep(
    height: usize,
    target: &Cells,
    features: &[Cells],
    columns: &Columns,
    path: &Path,
) -> Result<(Vec<usize>, Vec<String>), String> {
    let mut notes = Vec::new();
    if columns.missing == Missing::Error {
        let mut counts = Vec::new();
        for (name, c) in std::iter::once(columns.target.as_str())
            .chain(columns.features.iter().map(Feature::name))
            .zip(std::iter::once(target).chain(features))
        {
            let n = (0..height).filter(|&i| c.is_null(i)).count();
            if n > 0 {
                counts.push(format!("`{name}` {n}"));
            }
        }
        if !counts.is_empty() {
            return Err(format!(
                "{} has missing values (empty, NA, N/A or null cells) in columns {}: set load.missing = \"drop\", \
                 \"mean\", \"median\" or \"zero\"",
                path.display(),
                counts.join(", ")
            ));
        }
    }
    let drop_features = columns.missing == Missing::Drop;
    let kept: Vec<usize> = (0..height)
        .filter(|&i| !(target.is_null(i) || drop_features && features.iter().any(|c| c.is_null(i))))
        .collect();
    if kept.len() < height {
        let how = format!("{:?}", columns.missing).to_lowercase();
        notes.push(format!(
            "{} of {height} rows dropped for missing values (load.missing = \"{how}\"; rows without a target are \
             always dropped)",
            height - kept.len(),
        ));
    }
    Ok((kept, notes))
}

/// Each kept row's target: class id, or value.
fn targets(cells: &Cells, kept: &[usize], columns: &Columns, path: &Path) -> Result<Vec<f64>, String> {
    match (cells, &columns.labels) {
        (Cells::Text(v), Labels::Classes { names }) => {
            let ids: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
            kept.iter()
                .map(|&i| {
                    let label = v[i].as_deref().unwrap_or_default();
                    ids.get(label).map(|&id| id as f64).ok_or_else(|| {
                        format!(
                            "target `{}` of {} holds `{label}` (row {}), not one of the run's classes ({})",
                            columns.target,
                            path.display(),
                            i + 1,
                            names.join(", ")
                        )
                    })
                })
                .collect()
        }
        (Cells::Num(v), Labels::Values { .. }) => {
            finite(&columns.target, v, path)?;
            Ok(kept.iter().map(|&i| v[i].unwrap_or(f64::NAN)).collect())
        }
        _ => {
            Err(format!("target `{}` of {} does not hold what the run was trained on", columns.target, path.display()))
        }
    }
}

/// Refuses cells that are not finite numbers as float32 (NaN, ±inf, beyond ±3.4e38).
fn finite(name: &str, v: &[Option<f64>], path: &Path) -> Result<(), String> {
    let bad: Vec<(usize, f64)> =
        v.iter().enumerate().filter_map(|(i, x)| x.filter(|x| !(*x as f32).is_finite()).map(|x| (i, x))).collect();
    if let Some((row, x)) = bad.first() {
        let x = if x.is_finite() && x.abs() >= 1e15 { format!("{x:e}") } else { format!("{x}") };
        return Err(format!(
            "column `{name}` of {} holds {x} (row {}{}): values must be finite numbers within float32's range; \
             remove them or leave the cells empty and set load.missing",
            path.display(),
            row + 1,
            if bad.len() > 1 { format!(", and {} more", bad.len() - 1) } else { String::new() }
        ));
    }
    Ok(())
}
