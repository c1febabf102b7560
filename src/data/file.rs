//! csv and parquet files read with polars: checked against the pipeline's needs on the plan
//! (target column, numeric features, nothing missing), read as rows on each rank.
use std::path::{Path, PathBuf};

use polars::prelude::*;
use serde::{Deserialize, Serialize};

use crate::config::schema::Source;

/// What the plan needs to know of a data file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    pub path: PathBuf,
    pub rows: usize,
    pub features: Vec<String>,
    pub target: String,
    /// Largest label + 1.
    pub classes: usize,
    /// tensors with an .npy `path`: the .npy file of the labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<PathBuf>,
}

/// The features (row-major, float32) and labels of every row of the file.
pub fn rows(info: &FileInfo, source: Source) -> Result<(Vec<f32>, Vec<i64>), String> {
    let df = read(&info.path, source)?;
    columns(&df, info)
}

fn read(path: &Path, source: Source) -> Result<DataFrame, String> {
    let fail = |e: PolarsError| format!("cannot read {}: {e}", path.display());
    if !path.is_file() {
        return Err(format!("{} does not exist (paths are relative to the pipeline file)", path.display()));
    }
    match source {
        Source::Parquet => {
            let file = std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            ParquetReader::new(file).finish().map_err(fail)
        }
        _ => CsvReadOptions::default()
            .with_has_header(true)
            .try_into_reader_with_file_path(Some(path.to_owned()))
            .and_then(|r| r.finish())
            .map_err(fail),
    }
}

/// Checks a data file against the pipeline's needs: the target exists and holds integer
/// labels, every other column is numeric, nothing is missing.
pub fn inspect(path: &Path, source: Source, target: &str) -> Result<FileInfo, String> {
    let df = read(path, source)?;
    let names: Vec<String> = df.get_column_names().iter().map(|s| s.to_string()).collect();
    if !names.iter().any(|n| n == target) {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let hint = crate::config::resolve::closest(target, &refs)
            .map(|c| format!("; did you mean `{c}`?"))
            .unwrap_or_default();
        return Err(format!("{} has no column `{target}`{hint} (columns: {})", path.display(), names.join(", ")));
    }
    for name in &names {
        let col = df.column(name).map_err(|e| e.to_string())?;
        if !col.dtype().is_primitive_numeric() {
            let role = if name == target { "the target" } else { "a feature" };
            return Err(format!(
                "column `{name}` of {} is {}, not numeric ({role} must be numbers)",
                path.display(),
                col.dtype()
            ));
        }
        if col.null_count() > 0 {
            return Err(format!("column `{name}` of {} has {} missing values", path.display(), col.null_count()));
        }
    }
    let labels = df.column(target).and_then(|c| c.cast(&DataType::Float64)).map_err(|e| e.to_string())?;
    let labels: Vec<f64> = labels.f64().map_err(|e| e.to_string())?.into_no_null_iter().collect();
    if let Some(bad) = labels.iter().find(|v| v.fract() != 0.0 || **v < 0.0) {
        return Err(format!(
            "target `{target}` of {} holds {bad}: class labels must be integers 0, 1, 2, ...",
            path.display()
        ));
    }
    let classes = labels.iter().fold(0.0f64, |m, v| m.max(*v)) as usize + 1;
    let features: Vec<String> = names.into_iter().filter(|n| n != target).collect();
    if features.is_empty() {
        return Err(format!("{} has no feature column besides the target `{target}`", path.display()));
    }
    Ok(FileInfo {
        path: path.to_owned(),
        rows: df.height(),
        features,
        target: target.to_owned(),
        classes,
        labels: None,
    })
}

fn columns(df: &DataFrame, info: &FileInfo) -> Result<(Vec<f32>, Vec<i64>), String> {
    let err = |e: PolarsError| format!("{}: {e}", info.path.display());
    let mut x = vec![0f32; df.height() * info.features.len()];
    let f = info.features.len();
    for (j, name) in info.features.iter().enumerate() {
        let col = df.column(name).and_then(|c| c.cast(&DataType::Float32)).map_err(err)?;
        for (i, v) in col.f32().map_err(err)?.into_no_null_iter().enumerate() {
            x[i * f + j] = v;
        }
    }
    let y = df.column(&info.target).and_then(|c| c.cast(&DataType::Int64)).map_err(err)?;
    let y: Vec<i64> = y.i64().map_err(err)?.into_no_null_iter().collect();
    Ok((x, y))
}
