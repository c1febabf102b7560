//! Stage 1, load: the synthetic task (a deterministic function of the seed: the same data on every
//! rank and at every world size) or a csv / parquet file read with polars.
use std::path::PathBuf;

use polars::prelude::*;
use tch::Tensor;

use crate::config::plan::DataSpec;
use crate::config::schema::Source;
use crate::rng::Rng;

/// What the plan needs to know of a data file.
#[derive(Debug, Clone)]
pub struct FileInfo {
    pub path: PathBuf,
    pub rows: usize,
    pub features: Vec<String>,
    pub target: String,
    /// Largest label + 1.
    pub classes: usize,
}

/// Training and validation rows: features as float32, labels as int64.
#[derive(Debug)]
pub struct Dataset {
    pub train_x: Tensor,
    pub train_y: Tensor,
    pub val_x: Tensor,
    pub val_y: Tensor,
}

pub fn load(data: &DataSpec, seed: u64) -> Result<Dataset, String> {
    let (x, y) = match &data.file {
        None => synthetic(data, seed),
        Some(info) => {
            let df = read(&info.path, data.source)?;
            columns(&df, info)?
        }
    };
    let f = data.features as i64;
    let x = Tensor::from_slice(&x).view([-1, f]);
    let y = Tensor::from_slice(&y);
    let n = data.rows as i64;
    let v = data.validation_rows as i64;
    Ok(Dataset {
        train_x: x.narrow(0, 0, n),
        train_y: y.narrow(0, 0, n),
        val_x: x.narrow(0, n, v),
        val_y: y.narrow(0, n, v),
    })
}

/// Rows from a random teacher network: features on varied scales and offsets (so normalising
/// matters), labels = argmax of the teacher's logits plus `noise`-scaled Gaussian noise.
fn synthetic(d: &DataSpec, seed: u64) -> (Vec<f32>, Vec<i64>) {
    let (f, c, h) = (d.features, d.classes, 16);
    let mut rng = Rng::new(seed, 0xDA7A);
    let offset: Vec<f64> = (0..f).map(|_| rng.normal() * 5.0).collect();
    let scale: Vec<f64> = (0..f).map(|_| 0.5 + rng.uniform() * 4.5).collect();
    let w1: Vec<f64> = (0..f * h).map(|_| rng.normal() * 2.0 / (f as f64).sqrt()).collect();
    let b1: Vec<f64> = (0..h).map(|_| rng.normal() * 0.5).collect();
    let w2: Vec<f64> = (0..h * c).map(|_| rng.normal() * 2.0).collect();
    let n = d.rows + d.validation_rows;
    let (mut xs, mut ys) = (Vec::with_capacity(n * f), Vec::with_capacity(n));
    let mut z = vec![0.0; f];
    let mut hidden = vec![0.0; h];
    for _ in 0..n {
        for j in 0..f {
            z[j] = rng.normal();
            xs.push((offset[j] + scale[j] * z[j]) as f32);
        }
        for (k, out) in hidden.iter_mut().enumerate() {
            *out = (b1[k] + (0..f).map(|j| z[j] * w1[j * h + k]).sum::<f64>()).tanh();
        }
        let label = (0..c)
            .map(|k| (0..h).map(|i| hidden[i] * w2[i * c + k]).sum::<f64>() + d.noise * rng.normal())
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(k, _)| k as i64)
            .unwrap_or(0);
        ys.push(label);
    }
    (xs, ys)
}

fn read(path: &std::path::Path, source: Source) -> Result<DataFrame, String> {
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
pub fn inspect_file(path: &std::path::Path, source: Source, target: &str) -> Result<FileInfo, String> {
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
    Ok(FileInfo { path: path.to_owned(), rows: df.height(), features, target: target.to_owned(), classes })
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
