//! The data a run trains on: where the rows come from ([`synthetic`] or a csv / parquet [`file`]),
//! what is learned from them (the [`Task`]), how they divide across ranks ([`shard`]) and how they
//! are scaled ([`normalize`]). A [`Dataset`] is tensors of any shape (first axis = rows) plus
//! its task, so nothing downstream assumes 2-D features or argmax metrics.
pub mod file;
pub mod normalize;
pub mod shard;
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
}

impl Task {
    /// The model's outputs per sample.
    pub fn outputs(&self) -> usize {
        match self {
            Task::Classification { classes } => *classes,
            Task::LanguageModel { vocab } => *vocab,
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
        }
    }

    /// 1.0 where a sample's prediction is right, 0.0 elsewhere (float32).
    pub fn correct(&self, out: &Tensor, y: &Tensor) -> Tensor {
        match self {
            Task::Classification { .. } => out.argmax(-1, false).eq_tensor(y).to_kind(Kind::Float),
            Task::LanguageModel { .. } => {
                out.argmax(-1, false).eq_tensor(y).to_kind(Kind::Float).mean_dim([-1i64].as_slice(), false, Kind::Float)
            }
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
                Task::LanguageModel { .. } => self.per_sample_loss(out, y).mean(Kind::Double).double_value(&[]),
            };
            let acc = self.correct(out, y).mean(Kind::Double).double_value(&[]);
            (loss, acc)
        })
    }
}

/// Training and validation rows: inputs as float32 (N × input shape), or int64 token ids for a
/// language model; targets as int64 (N, or N × seq_len for a language model).
#[derive(Debug)]
pub struct Dataset {
    pub train_x: Tensor,
    pub train_y: Tensor,
    pub val_x: Tensor,
    pub val_y: Tensor,
    pub task: Task,
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
        }
    }
}

/// Reads (or generates) the rows the plan describes.
pub fn load(data: &DataSpec, seed: u64) -> Result<Dataset, String> {
    let (x, y) = if data.task.is_language_model() {
        tokens::windows(data, seed)?
    } else {
        let shape: Vec<i64> = std::iter::once(-1).chain(data.input.iter().map(|&d| d as i64)).collect();
        let from_vecs =
            |(x, y): (Vec<f32>, Vec<i64>)| (Tensor::from_slice(&x).view(shape.as_slice()), Tensor::from_slice(&y));
        match &data.file {
            None => from_vecs(synthetic::rows(data, seed)),
            Some(info) if data.source == Source::Tensors => tensors::read(info)?,
            Some(info) => from_vecs(file::rows(info, data.source)?),
        }
    };
    let n = data.rows as i64;
    let v = data.validation_rows as i64;
    Ok(Dataset {
        train_x: x.narrow(0, 0, n),
        train_y: y.narrow(0, 0, n),
        val_x: x.narrow(0, n, v),
        val_y: y.narrow(0, n, v),
        task: data.task,
    })
}
