//! Weights files (`.npz` or `.safetensors`: `wrap.init`, a run's `model.safetensors` read back by
//! `predict`), checked against a model's parameter and buffer names and shapes, and read one
//! tensor at a time: the plan checks the whole file holding one tensor at most ([`check`]), and a
//! rank reads only the rows it holds of each ([`WeightsFile::rows`]: under FSDP its shard).
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use tch::Tensor;

use crate::data::arrays::ArrayFile;

/// Checks that a weights file holds exactly the parameters and buffers of `shapes`, finite
/// floats (batch norm's `num_batches_tracked` an integer), reading one tensor at a time; says
/// what is missing, extra or misshapen otherwise.
pub fn check(path: &Path, shapes: &[(String, Vec<i64>)]) -> Result<(), String> {
    visit(path, shapes, |_, _| {})
}

/// Reads a weights file holding exactly the parameters and buffers of `shapes`, as float32
/// (batch norm's `num_batches_tracked` as int64); says what is missing, extra or misshapen
/// otherwise.
pub fn read_weights(path: &Path, shapes: &[(String, Vec<i64>)]) -> Result<BTreeMap<String, Tensor>, String> {
    let mut out = BTreeMap::new();
    visit(path, shapes, |name, t| {
        out.insert(name.to_owned(), t);
    })?;
    Ok(out)
}

/// Hands each tensor of `shapes` that the file holds as it should (converted as
/// [`read_weights`] returns it) to `keep`, one at a time; the problems found, all of them, in
/// the order of `shapes`, and the tensors not in `shapes` last.
fn visit(path: &Path, shapes: &[(String, Vec<i64>)], mut keep: impl FnMut(&str, Tensor)) -> Result<(), String> {
    if !path.exists() {
        return Err(format!("{} does not exist (paths are relative to the pipeline file)", path.display()));
    }
    crate::input::regular_file(path)?;
    // No array is read larger than the model's largest, as float64.
    let limit = shapes.iter().map(|(_, s)| s.iter().product::<i64>().max(1) as u64 * 8).max().unwrap_or(8);
    let wanted: BTreeMap<&str, &Vec<i64>> = shapes.iter().map(|(n, s)| (n.as_str(), s)).collect();
    // Each wanted tensor found: its problem, if any.
    let mut found: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut unexpected = std::collections::BTreeSet::new();
    crate::data::arrays::visit(path, limit, |name, t| {
        let Some(shape) = wanted.get(name.as_str()) else {
            // A PyTorch state_dict counts batch norm's batches: kept where the model has the
            // count (TorchScript modules), dropped where it has none (the built-in kinds).
            if !name.ends_with("num_batches_tracked") {
                unexpected.insert(name);
            }
            return Ok(());
        };
        let problem = match converted(&name, shape, t) {
            Ok(t) => {
                keep(&name, t);
                None
            }
            Err(e) => Some(e),
        };
        found.insert(name, problem);
        Ok(())
    })?;
    let mut problems = Vec::new();
    for (name, _) in shapes {
        match found.remove(name) {
            None => problems.push(format!("no `{name}`")),
            Some(Some(problem)) => problems.push(problem),
            Some(None) => {}
        }
    }
    if !unexpected.is_empty() {
        let names: Vec<String> = unexpected.iter().map(|k| format!("`{k}`")).collect();
        problems.push(format!("unexpected {}", names.join(", ")));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("{} does not fit the model: {}", path.display(), problems.join("; ")))
    }
}

/// `t` as the model takes `name` of `shape`, or what is wrong with it.
fn converted(name: &str, shape: &[i64], t: Tensor) -> Result<Tensor, String> {
    if t.size() != shape {
        return Err(format!("`{name}` is {:?}, the model's is {shape:?}", t.size()));
    }
    if name.ends_with("num_batches_tracked") && !t.is_floating_point() {
        return Ok(t.to_kind(tch::Kind::Int64));
    }
    if !t.is_floating_point() {
        return Err(format!("`{name}` holds {:?}, not floats", t.kind()));
    }
    if t.isfinite().all().int64_value(&[]) == 0 {
        let bad = t.numel() as i64 - t.isfinite().sum(tch::Kind::Int64).int64_value(&[]);
        return Err(format!("`{name}` holds {bad} NaN or infinite values"));
    }
    Ok(t.to_kind(tch::Kind::Float))
}

/// A weights file the plan has checked ([`check`]), open on a rank that reads what it holds of
/// each tensor.
pub struct WeightsFile {
    path: PathBuf,
    file: ArrayFile,
}

impl WeightsFile {
    pub fn open(path: &Path) -> anyhow::Result<WeightsFile> {
        let file = ArrayFile::open(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(WeightsFile { path: path.to_owned(), file })
    }

    /// Rows `rows` (dim 0) of `name`, in the file's element type (copying into a variable
    /// converts it); its other dimensions must be `like`'s.
    pub fn rows(&mut self, name: &str, rows: Range<i64>, like: &Tensor) -> anyhow::Result<Tensor> {
        let t = self.file.rows(name, rows).map_err(|e| anyhow::anyhow!("{}: {e}", self.path.display()))?;
        let (got, want) = (t.size(), like.size());
        anyhow::ensure!(
            got.get(1..) == want.get(1..),
            "{}: `{name}` is {:?} per row, the model's {:?}",
            self.path.display(),
            got.get(1..).unwrap_or(&[]),
            want.get(1..).unwrap_or(&[])
        );
        Ok(t)
    }

    /// The whole of `name`, shaped as `like`.
    pub fn whole(&mut self, name: &str, like: &Tensor) -> anyhow::Result<Tensor> {
        let rows = like.size().first().copied().unwrap_or(1);
        let t = self.rows(name, 0..rows, like)?;
        anyhow::ensure!(
            t.size() == like.size(),
            "{}: `{name}` is {:?}, the model's {:?}",
            self.path.display(),
            t.size(),
            like.size()
        );
        Ok(t)
    }
}
