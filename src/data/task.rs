//! What the model learns from the rows ([`Task`]): its loss, accuracy and validation metrics.
use serde::{Deserialize, Serialize};
use tch::{Kind, Reduction, Tensor};

use super::instructions;

/// What the model learns from the rows, and so its loss and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Task {
    /// One of `classes` labels per row: cross-entropy over logits, accuracy.
    Classification { classes: usize },
    /// The next token at every position of a window of token ids: cross-entropy averaged over
    /// the positions (a sample's loss) and over the samples; accuracy is the share of positions
    /// whose most likely token is the next one. Inputs are int64 token ids, never normalised.
    /// `masked` (instruction data): a target of [`instructions::IGNORE`] does not count, and a
    /// sample's loss and accuracy are over the positions that do.
    LanguageModel {
        vocab: usize,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        masked: bool,
    },
    /// One number per row: mean squared error on the normalised target; RMSE, MAE and R² in
    /// the target's own units.
    Regression,
}

impl Task {
    /// The model's outputs per sample.
    pub fn outputs(&self) -> usize {
        match self {
            Task::Classification { classes } => *classes,
            Task::LanguageModel { vocab, .. } => *vocab,
            Task::Regression => 1,
        }
    }

    /// Each sample's loss (the batch loss is their mean).
    pub fn per_sample_loss(&self, out: &Tensor, y: &Tensor) -> Tensor {
        match self {
            Task::Classification { .. } => out.cross_entropy_loss::<Tensor>(y, None, Reduction::None, -100, 0.0),
            Task::LanguageModel { vocab, masked } => {
                let (b, t) = (y.size()[0], y.size()[1]);
                let each = out
                    .reshape([-1, *vocab as i64])
                    .cross_entropy_loss::<Tensor>(&y.reshape([-1]), None, Reduction::None, instructions::IGNORE, 0.0)
                    .view([b, t]);
                if *masked {
                    // Ignored targets are 0 in `each`: the mean over the counted ones.
                    each.sum_dim_intlist([-1i64].as_slice(), false, Kind::Float) / counted(y)
                } else {
                    each.mean_dim([-1i64].as_slice(), false, Kind::Float)
                }
            }
            Task::Regression => (out.squeeze_dim(-1) - y).square(),
        }
    }

    /// 1.0 where a sample's prediction is right, 0.0 elsewhere (float32); NaN for regression,
    /// which has no accuracy.
    pub fn correct(&self, out: &Tensor, y: &Tensor) -> Tensor {
        match self {
            Task::Classification { .. } => out.argmax(-1, false).eq_tensor(y).to_kind(Kind::Float),
            Task::LanguageModel { masked: true, .. } => {
                let right = out.argmax(-1, false).eq_tensor(y).to_kind(Kind::Float);
                right.sum_dim_intlist([-1i64].as_slice(), false, Kind::Float) / counted(y)
            }
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

/// The targets of each sample that count (not [`instructions::IGNORE`]), as float32.
fn counted(y: &Tensor) -> Tensor {
    y.ne(instructions::IGNORE).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)
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
