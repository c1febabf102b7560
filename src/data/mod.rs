//! The data a run trains on: where the rows come from ([`synthetic`] or a csv / parquet [`file`]),
//! what is learned from them (the [`Task`]), how they divide across ranks ([`shard`]) and how they
//! are scaled ([`normalize`]). A [`Dataset`] is tensors of any shape (first axis = rows) plus
//! its task, so nothing downstream assumes 2-D features or argmax metrics. Files are encoded
//! by [`columns`] and split by [`split`].
pub mod arrays;
pub mod columns;
pub mod file;
pub mod instructions;
pub mod normalize;
pub mod npy;
pub mod shard;
pub mod split;
pub mod synthetic;
mod task;
pub mod tensors;
pub mod tokens;

use serde::{Deserialize, Serialize};
use tch::Tensor;

pub use file::FileInfo;
pub use task::{macro_f1, metrics, Metrics, Task};

/// The data the load stage produces, with its shapes: everything the plan knows before any row
/// is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataSpec {
    /// Training rows (a language model's windows).
    pub rows: usize,
    pub validation_rows: usize,
    /// The shape of one sample's input: `[features]` for rows of numbers, `[C, H, W]` for images,
    /// `[seq_len]` for windows of tokens.
    pub input: Vec<usize>,
    pub task: Task,
    /// Where the rows come from: one variant per source, each owned by its module.
    pub source: SourceSpec,
}

/// The sources, one variant each (`load.source`): what the plan learned of it, enough for a rank
/// to read the same rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceSpec {
    /// Generated rows, images or tokens.
    Synthetic(synthetic::Spec),
    /// A csv or parquet file.
    Table(FileInfo),
    /// Arrays `x` and `y`.
    Tensors(tensors::TensorsInfo),
    /// Token files or text.
    Tokens(tokens::TokenSpec),
    /// Instruction examples (supervised fine-tuning).
    Instructions(instructions::InstructionsSpec),
}

impl DataSpec {
    /// Values in one sample's input.
    pub fn input_size(&self) -> usize {
        self.input.iter().product()
    }

    /// What the data-flow table and `runner predict` call the data.
    pub fn describe(&self) -> String {
        match &self.source {
            SourceSpec::Synthetic(s) if self.task.is_language_model() => {
                format!("synthetic tokens (seed {}, Markov chain, noise {})", s.seed, s.noise)
            }
            SourceSpec::Synthetic(s) => format!("synthetic (seed {}, noise {})", s.seed, s.noise),
            SourceSpec::Table(f) => f.path.display().to_string(),
            SourceSpec::Tensors(t) => t.describe(),
            SourceSpec::Tokens(t) => t.describe(),
            SourceSpec::Instructions(i) => i.describe(),
        }
    }

    /// The files the run reads, with the key that names each: the plan digests them.
    pub fn inputs(&self) -> Vec<(&'static str, std::path::PathBuf)> {
        match &self.source {
            SourceSpec::Synthetic(_) => Vec::new(),
            SourceSpec::Table(f) => f.inputs(),
            SourceSpec::Tensors(t) => t.inputs(),
            SourceSpec::Tokens(t) => t.inputs(),
            SourceSpec::Instructions(i) => i.inputs(),
        }
    }

    /// What the plan tells the user about the data (warnings, constant columns).
    pub fn notes(&self) -> &[String] {
        match &self.source {
            SourceSpec::Table(f) => &f.notes,
            SourceSpec::Tensors(t) => &t.notes,
            SourceSpec::Instructions(i) => &i.notes,
            SourceSpec::Synthetic(_) | SourceSpec::Tokens(_) => &[],
        }
    }

    /// A csv or parquet file's encoding.
    pub fn file(&self) -> Option<&FileInfo> {
        match &self.source {
            SourceSpec::Table(f) => Some(f),
            _ => None,
        }
    }

    /// A token source.
    pub fn tokens(&self) -> Option<&tokens::TokenSpec> {
        match &self.source {
            SourceSpec::Tokens(t) => Some(t),
            _ => None,
        }
    }

    /// Windows are drawn at random offsets every step (no epochs).
    pub fn random_windows(&self) -> bool {
        self.tokens().is_some_and(|t| t.sampling == crate::config::schema::Sampling::Random)
    }

    /// Bytes a rank holds for the data itself: rows in memory as float32 (and their labels), or,
    /// for data read where it lies (token files, .npy arrays), nothing beyond its batches.
    pub fn resident_bytes(&self) -> f64 {
        let row = 4.0 * (self.input_size() as f64 + 1.0);
        let validation = row * self.validation_rows as f64;
        match &self.source {
            // Token ids are int64 in a batch: windows of inputs and targets.
            SourceSpec::Instructions(_) => {
                2.0 * 8.0 * self.input_size() as f64 * (self.rows + self.validation_rows) as f64
            }
            SourceSpec::Tokens(_) => 2.0 * 8.0 * self.input_size() as f64 * self.validation_rows as f64,
            // The labels (8 bytes a row) and the validation rows.
            SourceSpec::Tensors(t) if t.train.labels.is_some() => 8.0 * self.rows as f64 + validation,
            _ => row * self.rows as f64 + validation,
        }
    }
}

/// A rank's training rows: in memory, or read per batch where they lie.
#[derive(Debug)]
pub enum Rows {
    /// Inputs as float32 (N × input shape), or int64 token ids; targets as int64 (class ids;
    /// N × seq_len for a language model) or float32 (regression: normalised by `target`).
    Memory { x: Tensor, y: Tensor },
    /// Windows of token files.
    Windows(tokens::Windows),
    /// Rows of an .npy array.
    Arrays(tensors::Rows),
}

impl Rows {
    pub fn len(&self) -> usize {
        match self {
            Rows::Memory { y, .. } => y.size()[0] as usize,
            Rows::Windows(w) => w.count,
            Rows::Arrays(a) => a.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The rows at positions `idx` among the training rows: inputs and targets, on the CPU.
    pub fn gather(&self, idx: &[i64]) -> anyhow::Result<(Tensor, Tensor)> {
        match self {
            Rows::Memory { x, y } => {
                let i = Tensor::from_slice(idx).to_device(x.device());
                Ok((x.index_select(0, &i), y.index_select(0, &i)))
            }
            Rows::Windows(w) => w.gather(idx).map_err(anyhow::Error::msg),
            Rows::Arrays(a) => a.gather(idx).map_err(anyhow::Error::msg),
        }
    }

    /// Whether the rows are held in memory (an epoch's rows are then gathered at once).
    pub fn in_memory(&self) -> bool {
        matches!(self, Rows::Memory { .. })
    }
}

/// A rank's data: the training rows and the validation rows (in memory).
#[derive(Debug)]
pub struct Dataset {
    pub train: Rows,
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

impl Dataset {
    /// The same rows on `device` (once per rank); rows read per batch stay where they lie.
    pub fn to_device(self, device: tch::Device) -> Dataset {
        let train = match self.train {
            Rows::Memory { x, y } => Rows::Memory { x: x.to_device(device), y: y.to_device(device) },
            other => other,
        };
        Dataset {
            train,
            val_x: self.val_x.to_device(device),
            val_y: self.val_y.to_device(device),
            task: self.task,
            target: self.target,
        }
    }
}

/// Reads (or generates, or opens) the rows the plan describes: the validation rows are the first
/// `validation_rows` of the source's (`validate.batches` may take fewer than it holds).
pub fn load(data: &DataSpec) -> Result<Dataset, String> {
    let mut d = load_source(data)?;
    let v = (data.validation_rows as i64).min(d.val_x.size()[0]);
    d.val_x = d.val_x.narrow(0, 0, v);
    d.val_y = d.val_y.narrow(0, 0, v);
    Ok(d)
}

fn load_source(data: &DataSpec) -> Result<Dataset, String> {
    let memory = |x: Tensor, y: Tensor| {
        let n = data.rows as i64;
        let v = data.validation_rows as i64;
        Dataset {
            train: Rows::Memory { x: x.narrow(0, 0, n), y: y.narrow(0, 0, n) },
            val_x: x.narrow(0, n, v),
            val_y: y.narrow(0, n, v),
            task: data.task,
            target: None,
        }
    };
    match &data.source {
        SourceSpec::Table(info) => load_file(data, info),
        SourceSpec::Synthetic(s) if data.task.is_language_model() => {
            let (x, y) = tokens::synthetic_windows(
                data.task.outputs(),
                s.noise,
                data.input[0],
                data.rows + data.validation_rows,
                s.seed,
            );
            Ok(memory(x, y))
        }
        SourceSpec::Synthetic(s) => {
            let shape: Vec<i64> = std::iter::once(-1).chain(data.input.iter().map(|&d| d as i64)).collect();
            let (x, y) = synthetic::rows(data, s);
            Ok(memory(Tensor::from_slice(&x).view(shape.as_slice()), Tensor::from_slice(&y)))
        }
        SourceSpec::Tensors(t) => {
            let (rows, val_x, val_y) = tensors::load(t)?;
            let train = if t.train.labels.is_some() {
                Rows::Arrays(rows)
            } else {
                // In memory anyway: one gather of every training row.
                let all: Vec<i64> = (0..rows.len() as i64).collect();
                let (x, y) = rows.gather(&all)?;
                Rows::Memory { x, y }
            };
            Ok(Dataset { train, val_x, val_y, task: data.task, target: None })
        }
        SourceSpec::Instructions(spec) => {
            let (x, y, val_x, val_y) = instructions::load(spec)?;
            Ok(Dataset { train: Rows::Memory { x, y }, val_x, val_y, task: data.task, target: None })
        }
        SourceSpec::Tokens(t) => {
            let seq_len = data.input[0];
            let train = tokens::Windows::open(&t.train, seq_len, data.rows)?;
            let val = tokens::Windows::open(&t.validation, seq_len, t.validation.windows(seq_len))?;
            let (val_x, val_y) = match (t.validation_windows, t.sampling) {
                (Some(n), crate::config::schema::Sampling::Random) => {
                    val.random(n, seed_of(data), tokens::VALIDATION_STREAM)?
                }
                (n, _) => {
                    let idx: Vec<i64> = (0..n.unwrap_or(val.count) as i64).collect();
                    val.gather(&idx)?
                }
            };
            Ok(Dataset { train: Rows::Windows(train), val_x, val_y, task: data.task, target: None })
        }
    }
}

/// The seed of a token source's fixed random validation windows: the run's, kept in the plan.
fn seed_of(data: &DataSpec) -> u64 {
    match &data.source {
        SourceSpec::Tokens(t) => t.seed,
        _ => 0,
    }
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
        train: Rows::Memory { x: Tensor::from_slice(&rows.train_x).view(shape.as_slice()), y: y(&rows.train_y) },
        val_x: Tensor::from_slice(&rows.val_x).view(shape.as_slice()),
        val_y: y(&rows.val_y),
        task: data.task,
        target,
    })
}

/// `validate.batches` = `b` batches of `batch` asks for more than the `held` validation `unit`s
/// (rows, windows) hold: what to say; `None` when they hold them (or hold none, which is said
/// elsewhere).
pub fn batches_beyond(b: usize, batch: usize, held: usize, unit: &str) -> Option<String> {
    let most = held.div_ceil(batch.max(1));
    (b > most && held > 0).then(|| {
        format!(
            "asks for {b} batches of {batch}, but the validation set holds {held} {unit} ({most} batch{}): give at \
             most {most}, or leave it out to validate on every one",
            if most == 1 { "" } else { "es" }
        )
    })
}

#[cfg(test)]
mod tests {
    use tch::{Kind, Tensor};

    #[test]
    fn a_masked_language_model_counts_only_the_targets_that_are_not_ignored() {
        let task = super::Task::LanguageModel { vocab: 5, masked: true };
        let out = Tensor::randn([2, 3, 5], (Kind::Float, tch::Device::Cpu));
        let y = Tensor::from_slice(&[1i64, -100, 3, -100, -100, 4]).view([2, 3]);
        let each = |b: i64, t: i64| {
            let logits = out.get(b).get(t).unsqueeze(0);
            logits.cross_entropy_for_logits(&y.get(b).get(t).unsqueeze(0)).double_value(&[])
        };
        let got = Vec::<f32>::try_from(task.per_sample_loss(&out, &y)).unwrap();
        assert!((got[0] as f64 - (each(0, 0) + each(0, 2)) / 2.0).abs() < 1e-6);
        assert!((got[1] as f64 - each(1, 2)).abs() < 1e-6);
    }

    #[test]
    fn macro_f1_averages_per_class_f1() {
        // class 0: tp 1, fn 1 → 2/3; class 1: tp 1, fp 1 → 2/3; class 2 absent.
        let f1 = super::macro_f1(&[0, 1, 1], &[0, 0, 1], 3);
        assert!((f1 - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(super::macro_f1(&[2, 2], &[2, 2], 3), 1.0);
    }
}
