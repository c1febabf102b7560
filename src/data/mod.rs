//! The data a run trains on: where the rows come from ([`synthetic`] or a csv / parquet [`file`]),
//! what is learned from them (the [`Task`]), how they divide across ranks ([`shard`]) and how they
//! are scaled ([`normalize`]). A [`Dataset`] is tensors of any shape (first axis = rows) plus
//! its task, so nothing downstream assumes 2-D features or argmax metrics. Files are encoded
//! by [`columns`] and split by [`split`].
pub mod columns;
pub mod file;
pub mod normalize;
pub mod shard;
pub mod split;
mod synthetic;
pub mod tensors;
pub mod tokens;

use serde::{Deserialize, Serialize};
use tch::{Kind, Reduction, Tensor};

pub use file::FileInfo;

use crate::config::schema::Source;

/// The data the load stage produces, with its shapes: everything the plan knows before any row
/// is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataSpec {
    pub source: Source,
    /// Training rows.
    pub rows: usize,
    pub validation_rows: usize,
    /// The shape of one sample's input: `[features]` for rows of numbers, `[C, H, W]` for images.
    pub input: Vec<usize>,
    pub task: Task,
    /// Synthetic only: the label noise.
    pub noise: f64,
    pub file: Option<FileInfo>,
    /// A language model's file of token ids or text (`None`: synthetic tokens, or not a
    /// language model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<tokens::TokenFile>,
    /// `load.source = "tensors"`: the arrays' file(s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<tensors::TensorsInfo>,
}

impl DataSpec {
    /// Values in one sample's input.
    pub fn input_size(&self) -> usize {
        self.input.iter().product()
    }
}

/// What the model learns from the rows, and so its loss and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Task {
    /// One of `classes` labels per row: cross-entropy over logits, accuracy.
    Classification { classes: usize },
    /// The next token at every position of a window of token ids: cross-entropy averaged over
    /// the positions (a sample's loss) and over the samples; accuracy is the share of positions
    /// whose most likely token is the next one. Inputs are int64 token ids, never normalised.
    LanguageModel { vocab: usize },
    /// One number per row: mean squared error on the normalised target; RMSE, MAE and R² in
    /// the target's own units.
    Regression,
}

impl Task {
    /// The model's outputs per sample.
    pub fn outputs(&self) -> usize {
        match self {
            Task::Classification { classes } => *classes,
            Task::LanguageModel { vocab } => *vocab,
            Task::Regression => 1,
        }
    }

    /// Each sample's loss (the batch loss is their mean).
    pub fn per_sample_loss(&self, out: &Tensor, y: &Tensor) -> Tensor {
        match self {
            Task::Classification { .. } => out.cross_entropy_loss::<Tensor>(y, None, Reduction::None, -100, 0.0),
            Task::LanguageModel { vocab } => {
                let (b, t) = (y.size()[0], y.size()[1]);
                out.reshape([-1, *vocab as i64])
                    .cross_entropy_loss::<Tensor>(&y.reshape([-1]), None, Reduction::None, -100, 0.0)
                    .view([b, t])
                    .mean_dim([-1i64].as_slice(), false, Kind::Float)
            }
            Task::Regression => (out.squeeze_dim(-1) - y).square(),
        }
    }

    /// 1.0 where a sample's prediction is right, 0.0 elsewhere (float32); NaN for regression,
    /// which has no accuracy.
    pub fn correct(&self, out: &Tensor, y: &Tensor) -> Tensor {
        match self {
            Task::Classification { .. } => out.argmax(-1, false).eq_tensor(y).to_kind(Kind::Float),
            Task::LanguageModel { .. } => {
                out.argmax(-1, false).eq_tensor(y).to_kind(Kind::Float).mean_dim([-1i64].as_slice(), false, Kind::Float)
            }
            Task::Regression => Tensor::full([y.size()[0]], f64::NAN, (Kind::Float, y.device())),
        }
    }

    pub fn is_language_model(&self) -> bool {
        matches!(self, Task::LanguageModel { .. })
    }

    /// Mean loss and accuracy of outputs `out` against targets `y`.
    pub fn metrics(&self, out: &Tensor, y: &Tensor) -> (f64, f64) {
        tch::no_grad(|| {
            let loss = match self {
                // torch's F.cross_entropy(out, y): the mean in float32, as the PyTorch twin reports it.
                Task::Classification { .. } => out.cross_entropy_for_logits(y).double_value(&[]),
                Task::LanguageModel { .. } | Task::Regression => {
                    self.per_sample_loss(out, y).mean(Kind::Double).double_value(&[])
                }
            };
            let acc = self.correct(out, y).mean(Kind::Double).double_value(&[]);
            (loss, acc)
        })
    }
}

/// Validation metrics; NaN where the task has none (accuracy and F1 for regression, RMSE, MAE
/// and R² for classification).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metrics {
    pub loss: f64,
    pub acc: f64,
    /// Macro-F1: the mean of each class's F1, over the classes present or predicted.
    pub f1: f64,
    pub rmse: f64,
    pub mae: f64,
    pub r2: f64,
}

/// Training and validation rows: inputs as float32 (N × input shape), or int64 token ids for a
/// language model; targets as int64 (class ids; N × seq_len for a language model) or float32
/// (regression: normalised by `target`).
#[derive(Debug)]
pub struct Dataset {
    pub train_x: Tensor,
    pub train_y: Tensor,
    pub val_x: Tensor,
    pub val_y: Tensor,
    pub task: Task,
    /// Regression: the target's (mean, std) over the training rows; the model learns (y - mean) / std.
    pub target: Option<(f64, f64)>,
}

impl Dataset {
    /// Loss, accuracy and the task's other metrics of outputs `out` against targets `y`.
    pub fn metrics(&self, out: &Tensor, y: &Tensor) -> Metrics {
        metrics(self.task, self.target, out, y)
    }
}

/// Validation metrics; `target` un-normalises regression errors into the target's units.
pub fn metrics(task: Task, target: Option<(f64, f64)>, out: &Tensor, y: &Tensor) -> Metrics {
    let (loss, acc) = task.metrics(out, y);
    let nan = f64::NAN;
    tch::no_grad(|| match task {
        Task::Classification { classes } => {
            let pred: Vec<i64> = Vec::try_from(out.argmax(-1, false)).unwrap_or_default();
            let truth: Vec<i64> = Vec::try_from(y).unwrap_or_default();
            Metrics { loss, acc, f1: macro_f1(&pred, &truth, classes), rmse: nan, mae: nan, r2: nan }
        }
        Task::LanguageModel { .. } => Metrics { loss, acc, f1: nan, rmse: nan, mae: nan, r2: nan },
        Task::Regression => {
            let std = target.map_or(1.0, |t| t.1);
            let err = (out.squeeze_dim(-1) - y).to_kind(Kind::Double);
            let mse = err.square().mean(Kind::Double).double_value(&[]);
            let mae = err.abs().mean(Kind::Double).double_value(&[]);
            let yd = y.to_kind(Kind::Double);
            let var = (&yd - yd.mean(Kind::Double)).square().mean(Kind::Double).double_value(&[]);
            Metrics { loss, acc: nan, f1: nan, rmse: mse.sqrt() * std, mae: mae * std, r2: 1.0 - mse / var }
        }
    })
}

/// The mean F1 over the classes that are present in `truth` or predicted.
pub fn macro_f1(pred: &[i64], truth: &[i64], classes: usize) -> f64 {
    let (mut tp, mut fp, mut fn_) = (vec![0usize; classes], vec![0usize; classes], vec![0usize; classes]);
    for (&p, &t) in pred.iter().zip(truth) {
        let (p, t) = (p as usize, t as usize);
        if p == t {
            tp[t] += 1;
        } else {
            fp[p] += 1;
            fn_[t] += 1;
        }
    }
    let f1: Vec<f64> = (0..classes)
        .filter(|&c| tp[c] + fp[c] + fn_[c] > 0)
        .map(|c| 2.0 * tp[c] as f64 / (2 * tp[c] + fp[c] + fn_[c]) as f64)
        .collect();
    if f1.is_empty() {
        f64::NAN
    } else {
        f1.iter().sum::<f64>() / f1.len() as f64
    }
}

impl Dataset {
    /// The same rows on `device` (once per rank: every epoch's tensors are cut from them there).
    pub fn to_device(self, device: tch::Device) -> Dataset {
        Dataset {
            train_x: self.train_x.to_device(device),
            train_y: self.train_y.to_device(device),
            val_x: self.val_x.to_device(device),
            val_y: self.val_y.to_device(device),
            task: self.task,
            target: self.target,
        }
    }
}

/// Reads (or generates) the rows the plan describes.
pub fn load(data: &DataSpec, seed: u64) -> Result<Dataset, String> {
    if let Some(info) = &data.file {
        return load_file(data, info);
    }
    let (x, y) = if data.task.is_language_model() {
        tokens::windows(data, seed)?
    } else if let Some(t) = &data.tensors {
        tensors::read(t)?
    } else {
        let shape: Vec<i64> = std::iter::once(-1).chain(data.input.iter().map(|&d| d as i64)).collect();
        let (x, y) = synthetic::rows(data, seed);
        (Tensor::from_slice(&x).view(shape.as_slice()), Tensor::from_slice(&y))
    };
    let n = data.rows as i64;
    let v = data.validation_rows as i64;
    Ok(Dataset {
        train_x: x.narrow(0, 0, n),
        train_y: y.narrow(0, 0, n),
        val_x: x.narrow(0, n, v),
        val_y: y.narrow(0, n, v),
        task: data.task,
        target: None,
    })
}

fn load_file(data: &DataSpec, info: &FileInfo) -> Result<Dataset, String> {
    let rows = file::load(info)?;
    let shape: Vec<i64> = std::iter::once(-1).chain(data.input.iter().map(|&d| d as i64)).collect();
    let target = match info.columns.labels {
        columns::Labels::Values { mean, std } => Some((mean, std)),
        columns::Labels::Classes { .. } => None,
    };
    let y = |v: &[f64]| match target {
        Some((mean, std)) => Tensor::from_slice(&v.iter().map(|y| ((y - mean) / std) as f32).collect::<Vec<f32>>()),
        None => Tensor::from_slice(&v.iter().map(|&y| y as i64).collect::<Vec<i64>>()),
    };
    Ok(Dataset {
        train_x: Tensor::from_slice(&rows.train_x).view(shape.as_slice()),
        train_y: y(&rows.train_y),
        val_x: Tensor::from_slice(&rows.val_x).view(shape.as_slice()),
        val_y: y(&rows.val_y),
        task: data.task,
        target,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn macro_f1_averages_per_class_f1() {
        // class 0: tp 1, fn 1 → 2/3; class 1: tp 1, fp 1 → 2/3; class 2 absent.
        let f1 = super::macro_f1(&[0, 1, 1], &[0, 0, 1], 3);
        assert!((f1 - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(super::macro_f1(&[2, 2], &[2, 2], 3), 1.0);
    }
}
