//! `load.source = "tensors"`: arrays `x` (any shape, first axis = rows) and `y` (integer class
//! labels, one per row) from an .npz or .safetensors file holding both, or from two .npy files
//! (`load.path` for `x`, `load.labels` for `y`). Checked whole on the plan; read whole on each rank.
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use serde::{Deserialize, Serialize};

use super::{DataSpec, Task};
use crate::config::schema::{Load, Source};

/// What the plan knows of a tensors file (or .npy pair).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorsInfo {
    /// `x` (with `y`, unless `labels` holds it).
    pub path: PathBuf,
    /// The .npy file of `y`, with an .npy `path`.
    pub labels: Option<PathBuf>,
}

/// The inputs as float32 and the labels as int64 of every row of the file(s).
pub fn read(info: &TensorsInfo) -> Result<(Tensor, Tensor), String> {
    let (x, y) = arrays(&info.path, info.labels.as_deref())?;
    Ok((x.to_kind(Kind::Float), y.to_kind(Kind::Int64)))
}

/// `x` and `y` as stored.
fn arrays(path: &Path, labels: Option<&Path>) -> Result<(Tensor, Tensor), String> {
    let cannot = |p: &Path, e: tch::TchError| format!("cannot read {}: {e}", p.display());
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
    let named = match ext {
        "npz" => Tensor::read_npz(path).map_err(|e| cannot(path, e))?,
        "safetensors" => Tensor::read_safetensors(path).map_err(|e| cannot(path, e))?,
        "npy" => {
            let Some(labels) = labels else {
                return Err(format!(
                    "{}: an .npy file holds one array; name the labels' .npy file in load.labels",
                    path.display()
                ));
            };
            let x = Tensor::read_npy(path).map_err(|e| cannot(path, e))?;
            let y = Tensor::read_npy(labels).map_err(|e| cannot(labels, e))?;
            return Ok((x, y));
        }
        _ => return Err(format!("{}: use an .npz, .safetensors or .npy file", path.display())),
    };
    let mut x = None;
    let mut y = None;
    for (name, t) in named {
        match name.as_str() {
            "x" => x = Some(t),
            "y" => y = Some(t),
            _ => {}
        }
    }
    match (x, y) {
        (Some(x), Some(y)) => Ok((x, y)),
        _ => Err(format!("{} needs two arrays named `x` (the inputs) and `y` (the labels)", path.display())),
    }
}

/// Checks the arrays and returns (rows, one sample's shape, classes).
fn inspect(path: &Path, labels: Option<&Path>) -> Result<(usize, Vec<usize>, usize), String> {
    let (x, y) = arrays(path, labels)?;
    let p = path.display();
    if x.dim() < 2 {
        return Err(format!("`x` of {p} is {:?}: it needs a first axis of rows and at least one more", x.size()));
    }
    let rows = x.size()[0];
    if y.size() != [rows] {
        return Err(format!("`y` is {:?} but `x` of {p} has {rows} rows: give one label per row", y.size()));
    }
    if x.kind() == Kind::Bool {
        return Err(format!("`x` of {p} holds booleans, not numbers"));
    }
    if x.is_floating_point() {
        let finite = x.isfinite().sum(Kind::Int64).int64_value(&[]);
        if finite != x.numel() as i64 {
            return Err(format!("`x` of {p} holds {} NaN or infinite values", x.numel() as i64 - finite));
        }
    }
    if y.is_floating_point() || y.kind() == Kind::Bool {
        return Err(format!("`y` of {p} holds {:?}: class labels must be integers 0, 1, 2, ...", y.kind()));
    }
    let y = y.to_kind(Kind::Int64);
    let (lo, hi) = if rows > 0 { (y.min().int64_value(&[]), y.max().int64_value(&[])) } else { (0, 0) };
    if lo < 0 {
        return Err(format!("`y` of {p} holds {lo}: class labels must be integers 0, 1, 2, ..."));
    }
    let shape = x.size()[1..].iter().map(|&d| d as usize).collect();
    Ok((rows as usize, shape, hi as usize + 1))
}

/// The plan's view of a tensors source; problems are reported through `bad`.
pub fn spec(load: &Load, base: &Path, bad: &mut impl FnMut(&str, String)) -> Option<DataSpec> {
    let Some(rel) = &load.path else {
        bad("load.path", "source = \"tensors\" needs a path to an .npz, .safetensors or .npy file".into());
        return None;
    };
    for (key, given) in [
        ("load.target", load.target.is_some()),
        ("load.image", load.image.is_some()),
        ("load.noise", load.noise != Load::default().noise),
    ] {
        if given {
            bad(key, "is not read by source = \"tensors\" (arrays `x` and `y`)".into());
        }
    }
    let path = base.join(rel);
    let labels: Option<PathBuf> = load.labels.as_ref().map(|l| base.join(l));
    let npy = path.extension().is_some_and(|e| e == "npy");
    if npy != labels.is_some() {
        let msg = if npy {
            "an .npy `path` holds `x` alone: name the .npy file of the labels here"
        } else {
            "is only read with an .npy `load.path` (an .npz or .safetensors file holds `y` itself)"
        };
        bad("load.labels", msg.into());
        return None;
    }
    for (key, p) in [("load.path", Some(&path)), ("load.labels", labels.as_ref())] {
        let Some(p) = p else { continue };
        if !p.exists() {
            bad(key, format!("{} does not exist (paths are relative to the pipeline file)", p.display()));
            return None;
        }
        if let Err(e) = crate::input::regular_file(p) {
            bad(key, e);
            return None;
        }
    }
    let (rows, input, found) = match inspect(&path, labels.as_deref()) {
        Ok(v) => v,
        Err(e) => {
            bad("load.path", e);
            return None;
        }
    };
    let size: usize = input.iter().product();
    match &load.features {
        Some(crate::config::schema::Features::Count(f)) if *f != size => {
            bad("load.features", format!("is {f} but a sample of {} holds {size} values ({input:?})", path.display()))
        }
        Some(crate::config::schema::Features::Columns(_)) => {
            bad("load.features", "names columns of a csv or parquet file; a tensors file has none".into())
        }
        _ => {}
    }
    let classes = load.classes.unwrap_or(found);
    if classes < found {
        bad("load.classes", format!("is {classes} but `y` has labels up to {}", found - 1));
    }
    if let Some(r) = load.rows.filter(|&r| r > rows) {
        bad("load.rows", format!("asks for {r} rows but {} has {rows}", path.display()));
    }
    let total = load.rows.unwrap_or(rows).min(rows);
    if load.validation_rows >= total {
        bad("load.validation_rows", format!("{} leaves no training rows out of {total}", load.validation_rows));
        return None;
    }
    Some(DataSpec {
        source: Source::Tensors,
        rows: total - load.validation_rows,
        validation_rows: load.validation_rows,
        input,
        task: Task::Classification { classes },
        noise: 0.0,
        file: None,
        tokens: None,
        tensors: Some(TensorsInfo { path, labels }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npz_safetensors_and_npy_pairs_read_alike_and_bad_labels_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let x = Tensor::arange(24, (Kind::Float, tch::Device::Cpu)).view([6, 1, 2, 2]);
        let y = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 2]);
        let named = [("x".to_string(), x.shallow_clone()), ("y".to_string(), y.shallow_clone())];
        Tensor::write_npz(&named, dir.path().join("d.npz")).unwrap();
        Tensor::write_safetensors(&named, dir.path().join("d.safetensors")).unwrap();
        x.write_npy(dir.path().join("x.npy")).unwrap();
        y.write_npy(dir.path().join("y.npy")).unwrap();
        for (file, labels) in [("d.npz", None), ("d.safetensors", None), ("x.npy", Some("y.npy"))] {
            let load = Load {
                source: Source::Tensors,
                path: Some(file.into()),
                labels: labels.map(PathBuf::from),
                validation_rows: 2,
                ..Load::default()
            };
            let mut errors = Vec::new();
            let spec = spec(&load, dir.path(), &mut |k, m| errors.push(format!("{k}: {m}"))).unwrap();
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!((spec.rows, spec.input.clone(), spec.task.outputs()), (4, vec![1, 2, 2], 3));
            let (rx, ry) = read(spec.tensors.as_ref().unwrap()).unwrap();
            assert!(rx.equal(&x) && ry.equal(&y), "{file}");
        }
        let bad = [("x".to_string(), x), ("y".to_string(), Tensor::from_slice(&[0.5f32, 1., 2., 0., 1., 2.]))];
        Tensor::write_npz(&bad, dir.path().join("bad.npz")).unwrap();
        let load = Load { source: Source::Tensors, path: Some("bad.npz".into()), ..Load::default() };
        let mut errors = Vec::new();
        assert!(spec(&load, dir.path(), &mut |k, m| errors.push(format!("{k}: {m}"))).is_none());
        assert!(errors[0].contains("class labels must be integers"), "{errors:?}");
    }
}
