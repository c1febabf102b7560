//! `load.source = "tensors"`: arrays `x` (any shape, first axis = rows) and `y` (integer class
//! labels, one per row) from an .npz or .safetensors file holding both, or from two .npy files
//! (`load.path` for `x`, `load.labels` for `y`). The validation rows are held out as from a csv
//! file (`validate.fraction`, default 0.2, or `validate.rows`: a seeded shuffle stratified by
//! class), or come from another file of the same kind (`load.validation_path`). An .npy `x` is
//! checked by its header and scanned in chunks on the plan, and read row by row where it lies on
//! the ranks: only the labels are held whole.
mod spec;

pub use spec::spec;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::npy::Npy;
use super::split::{self, Holdout};

/// One file (or .npy pair) of arrays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Arrays {
    /// `x` (with `y`, unless `labels` holds it).
    pub path: PathBuf,
    /// The .npy file of `y`, with an .npy `path`.
    pub labels: Option<PathBuf>,
}

/// What the plan knows of a tensors source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorsInfo {
    pub train: Arrays,
    /// `load.validation_path` (with its own labels file for an .npy pair: `y` beside it is not
    /// guessed; it must be an .npz or .safetensors file, or named by the same stem `_y.npy`).
    pub validation: Option<Arrays>,
    /// How validation rows are held out of `train`, with `seed`; absent with `validation`.
    pub holdout: Option<Holdout>,
    pub seed: u64,
    /// Only the file's first rows (`load.rows`).
    pub limit: Option<usize>,
    pub notes: Vec<String>,
}

impl TensorsInfo {
    pub fn describe(&self) -> String {
        match &self.train.labels {
            Some(y) => format!("{} + {}", self.train.path.display(), y.display()),
            None => self.train.path.display().to_string(),
        }
    }

    pub fn inputs(&self) -> Vec<(&'static str, PathBuf)> {
        let mut v = vec![("load.path", self.train.path.clone())];
        v.extend(self.train.labels.iter().map(|p| ("load.labels", p.clone())));
        if let Some(val) = &self.validation {
            v.push(("load.validation_path", val.path.clone()));
        }
        v
    }

    /// The training and validation rows of the file (0-based), as the split holds them out.
    pub fn split_rows(&self, labels: &[i64]) -> (Vec<usize>, Vec<usize>) {
        let n = self.limit.map_or(labels.len(), |l| l.min(labels.len()));
        match self.holdout {
            Some(h) => {
                let ids: Vec<usize> = labels[..n].iter().map(|&c| c as usize).collect();
                split::split(n, h, self.seed, Some(&ids))
            }
            None => ((0..n).collect(), Vec::new()),
        }
    }
}

/// `x` of a file: in memory (.npz, .safetensors), or an .npy array read row by row.
enum X {
    Memory(Tensor),
    Npy(Npy),
}

impl X {
    fn rows(&self) -> usize {
        match self {
            X::Memory(t) => t.size().first().copied().unwrap_or(0) as usize,
            X::Npy(a) => a.rows(),
        }
    }

    fn sample_shape(&self) -> Vec<usize> {
        match self {
            X::Memory(t) => t.size().iter().skip(1).map(|&d| d as usize).collect(),
            X::Npy(a) => a.shape[1..].to_vec(),
        }
    }

    /// Rows `idx` as float32.
    fn gather(&self, idx: &[i64]) -> Result<Tensor, String> {
        match self {
            X::Memory(t) => Ok(t.index_select(0, &Tensor::from_slice(idx)).to_kind(Kind::Float)),
            X::Npy(a) => a.read_rows(idx, Kind::Float),
        }
    }
}

/// Opens the arrays: `x` (whole for .npz / .safetensors, by its header for .npy) and `y` whole.
fn open(a: &Arrays) -> Result<(X, Tensor), String> {
    let path = &a.path;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
    let named = match ext {
        // Headers checked against the bytes there (as `wrap.init`'s).
        "npz" | "safetensors" => super::arrays::read(path, u64::MAX)?,
        "npy" => {
            let Some(labels) = &a.labels else {
                return Err(format!(
                    "{}: an .npy file holds one array; name the labels' .npy file in load.labels",
                    path.display()
                ));
            };
            let x = Npy::open(path)?;
            if x.dtype == super::npy::Dtype::Bool {
                return Err(format!("`x` of {} holds booleans, not numbers", path.display()));
            }
            let y = Npy::open(labels)?;
            if y.shape.len() != 1 {
                return Err(format!("`y` of {} is {:?}: give one label per row", labels.display(), y.shape));
            }
            if !y.dtype.is_integer() {
                return Err(format!(
                    "`y` of {} holds {:?}: class labels must be integers 0, 1, 2, ...",
                    labels.display(),
                    y.dtype
                ));
            }
            let raw = y.read_elements(0, y.rows())?;
            let y = super::npy::to_tensor(&raw, y.dtype, &[y.rows() as i64])?.to_kind(Kind::Int64);
            return Ok((X::Npy(x), y));
        }
        _ => return Err(format!("{}: use an .npz, .safetensors or .npy file", path.display())),
    };
    let (mut x, mut y) = (None, None);
    for (name, t) in named {
        match name.as_str() {
            "x" => x = Some(t),
            "y" => y = Some(t),
            _ => {}
        }
    }
    let (Some(x), Some(y)) = (x, y) else {
        return Err(format!("{} needs two arrays named `x` (the inputs) and `y` (the labels)", path.display()));
    };
    if x.kind() == Kind::Bool {
        return Err(format!("`x` of {} holds booleans, not numbers", path.display()));
    }
    if y.is_floating_point() || y.kind() == Kind::Bool {
        return Err(format!(
            "`y` of {} holds {:?}: class labels must be integers 0, 1, 2, ...",
            path.display(),
            y.kind()
        ));
    }
    Ok((X::Memory(x), y.to_kind(Kind::Int64)))
}

/// Checks the arrays: shapes, one integer label ≥ 0 per row, finite inputs (scanned in chunks).
/// Returns `x`, the labels and one sample's shape.
fn inspect(a: &Arrays) -> Result<(X, Vec<i64>, Vec<usize>), String> {
    let (x, y) = open(a)?;
    let p = a.path.display();
    let dims = match &x {
        X::Memory(t) => t.dim(),
        X::Npy(n) => n.shape.len(),
    };
    if dims < 2 {
        return Err(format!("`x` of {p} has {dims} axis: it needs a first axis of rows and at least one more"));
    }
    let rows = x.rows();
    if y.size() != [rows as i64] {
        return Err(format!("`y` is {:?} but `x` of {p} has {rows} rows: give one label per row", y.size()));
    }
    // Chunks of about 16 MiB of float32, so the scan's memory does not grow with the file.
    let chunk = ((1usize << 22) / x.sample_shape().iter().product::<usize>().max(1)).max(1);
    for start in (0..rows).step_by(chunk) {
        let idx: Vec<i64> = (start as i64..(start + chunk).min(rows) as i64).collect();
        let part = x.gather(&idx)?;
        let finite = part.isfinite().sum(Kind::Int64).int64_value(&[]);
        if finite != part.numel() as i64 {
            return Err(format!(
                "`x` of {p} holds {} NaN or infinite values (rows {start} on)",
                part.numel() as i64 - finite
            ));
        }
    }
    let labels: Vec<i64> = Vec::try_from(&y).map_err(|e| format!("`y` of {p}: {e}"))?;
    if let Some((i, l)) = labels.iter().enumerate().find(|(_, &l)| l < 0) {
        let which = a.labels.as_ref().map_or(format!("`y` of {p}"), |l| format!("`y` ({})", l.display()));
        return Err(format!("{which} holds {l} at row {i}: class labels must be integers 0, 1, 2, ..."));
    }
    let shape = x.sample_shape();
    Ok((x, labels, shape))
}

/// A rank's training rows of a tensors source: `x` by file row, the labels of the training rows.
pub struct Rows {
    x: X,
    /// The file row of each training row.
    rows: Vec<i64>,
    y: Tensor,
}

impl Rows {
    pub fn gather(&self, idx: &[i64]) -> Result<(Tensor, Tensor), String> {
        let file_rows: Vec<i64> = idx.iter().map(|&i| self.rows[i as usize]).collect();
        Ok((self.x.gather(&file_rows)?, self.y.index_select(0, &Tensor::from_slice(idx))))
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

impl std::fmt::Debug for Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tensors::Rows({} rows)", self.rows.len())
    }
}

/// `split.json` for a tensors source: the file(s) and the 0-based rows of `x` that trained and
/// validated (`validation` is empty with `validation_file`: every row of that file validates).
pub fn split_record(info: &TensorsInfo) -> Result<serde_json::Value, String> {
    let (_, y) = open(&info.train)?;
    let labels: Vec<i64> = Vec::try_from(&y).map_err(|e: tch::TchError| e.to_string())?;
    let (train, validation) = info.split_rows(&labels);
    Ok(serde_json::json!({
        "file": info.train.path,
        "labels_file": info.train.labels,
        "validation_file": info.validation.as_ref().map(|v| &v.path),
        "train": train,
        "validation": validation,
    }))
}

/// A rank's view: the training rows (read per batch from an .npy `x`) and the validation rows.
pub fn load(info: &TensorsInfo) -> Result<(Rows, Tensor, Tensor), String> {
    let (x, y) = open(&info.train)?;
    let labels: Vec<i64> = Vec::try_from(&y).map_err(|e: tch::TchError| e.to_string())?;
    let (train, val) = info.split_rows(&labels);
    let (val_x, val_y) = match &info.validation {
        Some(v) => {
            let (vx, vy) = open(v)?;
            let all: Vec<i64> = (0..vx.rows() as i64).collect();
            (vx.gather(&all)?, vy)
        }
        None => {
            let idx: Vec<i64> = val.iter().map(|&i| i as i64).collect();
            (x.gather(&idx)?, y.index_select(0, &Tensor::from_slice(&idx)))
        }
    };
    let rows: Vec<i64> = train.iter().map(|&i| i as i64).collect();
    let train_y = y.index_select(0, &Tensor::from_slice(&rows));
    Ok((Rows { x, rows, y: train_y }, val_x, val_y))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::{Config, Load, Source};
    use crate::data::SourceSpec;

    fn config(load: Load) -> Config {
        Config { load, ..Config::default() }
    }

    #[test]
    fn npz_safetensors_and_npy_pairs_read_alike_and_bad_labels_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let x = Tensor::arange(40, (Kind::Float, tch::Device::Cpu)).view([10, 1, 2, 2]);
        let y = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 2, 0, 1, 2, 0]);
        let named = [("x".to_string(), x.shallow_clone()), ("y".to_string(), y.shallow_clone())];
        Tensor::write_npz(&named, dir.path().join("d.npz")).unwrap();
        Tensor::write_safetensors(&named, dir.path().join("d.safetensors")).unwrap();
        x.write_npy(dir.path().join("x.npy")).unwrap();
        y.write_npy(dir.path().join("y.npy")).unwrap();
        let mut seen = Vec::new();
        for (file, labels) in [("d.npz", None), ("d.safetensors", None), ("x.npy", Some("y.npy"))] {
            let mut c = config(Load {
                source: Source::Tensors,
                path: Some(file.into()),
                labels: labels.map(PathBuf::from),
                ..Load::default()
            });
            c.validate.rows = Some(3);
            let mut errors = Vec::new();
            let spec = spec(&c, dir.path(), &mut |k, m| errors.push(format!("{k}: {m}"))).unwrap();
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(
                (spec.rows, spec.validation_rows, spec.input.clone(), spec.task.outputs()),
                (7, 3, vec![1, 2, 2], 3)
            );
            let SourceSpec::Tensors(info) = &spec.source else { panic!("tensors") };
            let (rows, vx, vy) = load(info).unwrap();
            let all: Vec<i64> = (0..7).collect();
            let (tx, ty) = rows.gather(&all).unwrap();
            // Every row lands on one side, with its own label.
            let both = Tensor::cat(&[tx.view([-1, 4]), vx.view([-1, 4])], 0);
            let order = both.select(1, 0).argsort(0, false);
            assert!(both.index_select(0, &order).equal(&x.view([-1, 4])), "{file}");
            let labels = Tensor::cat(&[ty, vy], 0).index_select(0, &order);
            assert!(labels.equal(&y), "{file}");
            seen.push(Vec::<f32>::try_from(vx.reshape([-1])).unwrap());
        }
        assert!(seen.windows(2).all(|w| w[0] == w[1]), "the same split whatever the format");
        let bad = [
            ("x".to_string(), x),
            ("y".to_string(), Tensor::from_slice(&[0.5f32, 1., 2., 0., 1., 2., 0., 1., 2., 0.])),
        ];
        Tensor::write_npz(&bad, dir.path().join("bad.npz")).unwrap();
        let c = config(Load { source: Source::Tensors, path: Some("bad.npz".into()), ..Load::default() });
        let mut errors = Vec::new();
        assert!(spec(&c, dir.path(), &mut |k, m| errors.push(format!("{k}: {m}"))).is_none());
        assert!(errors[0].contains("class labels must be integers"), "{errors:?}");
    }
}
