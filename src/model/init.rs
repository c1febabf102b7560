//! The initial weights `wrap.init` names, under the model's parameter names: a weights file
//! (`.safetensors`, `.npz`) holding every parameter and buffer as `model.safetensors` does, or a
//! Hugging Face model directory read through its adapter ([`super::hf`]). Any rows of any
//! parameter can be asked for on their own, and only those are read: what a rank that holds
//! shards reads (FSDP builds and loads the model a unit at a time); and a tensor rank's slice
//! ([`InitWeights::slice`]): its rows, or of a Hugging Face checkpoint its columns alone.
use std::ops::Range;
use std::path::Path;

use tch::nn;
use tch::Tensor;

use super::weights::WeightsFile;
use super::{hf, transformer, TensorSlice};
use crate::config::schema::Model;

/// The opened initial weights (checked by the plan).
pub enum InitWeights {
    /// A weights file, read by rows.
    File(WeightsFile),
    /// A Hugging Face checkpoint, its headers checked; each read takes only the rows asked.
    Hf(hf::Checkpoint),
}

impl InitWeights {
    /// Opens `path` (resolved `wrap.init`) for `model`.
    pub fn open(path: &Path, model: &Model) -> anyhow::Result<InitWeights> {
        match model {
            Model::Transformer(t) if hf::is_model_dir(path) => {
                let (class, _) = hf::read_config(path).map_err(anyhow::Error::msg)?;
                let checkpoint = hf::Checkpoint::open(path, class, &transformer::Spec::of(t));
                Ok(InitWeights::Hf(checkpoint.map_err(anyhow::Error::msg)?))
            }
            _ => Ok(InitWeights::File(WeightsFile::open(path)?)),
        }
    }

    /// Rows `rows` (dim 0) of the parameter or buffer `name`; its other dimensions are `like`'s.
    pub fn rows(&mut self, name: &str, rows: Range<i64>, like: &Tensor) -> anyhow::Result<Tensor> {
        match self {
            InitWeights::File(file) => file.rows(name, rows, like),
            InitWeights::Hf(checkpoint) => checkpoint.rows(name, rows).map_err(anyhow::Error::msg),
        }
    }

    /// Tensor rank's `slice` of `name`, whose whole is shaped as `like`: rows read alone; columns
    /// of a Hugging Face checkpoint read alone (a run of each stored row), of a weights file cut
    /// from the whole.
    pub fn slice(&mut self, name: &str, slice: &TensorSlice, like: &Tensor) -> anyhow::Result<Tensor> {
        let parts: anyhow::Result<Vec<Tensor>> = slice
            .ranges
            .iter()
            .map(|r| match (slice.dim, &mut *self) {
                (0, _) => self.rows(name, r.clone(), like),
                (1, InitWeights::Hf(checkpoint)) => checkpoint.columns(name, r.clone()).map_err(anyhow::Error::msg),
                _ => Ok(self.whole(name, like)?.narrow(slice.dim, r.start, r.end - r.start)),
            })
            .collect();
        Ok(Tensor::cat(&parts?, slice.dim))
    }

    /// The whole of `name`, shaped as `like`.
    pub fn whole(&mut self, name: &str, like: &Tensor) -> anyhow::Result<Tensor> {
        match self {
            InitWeights::File(file) => file.whole(name, like),
            InitWeights::Hf(checkpoint) => checkpoint.whole(name).map_err(anyhow::Error::msg),
        }
    }
}

/// Copies the initial weights `path` holds into `vs`'s variables (those of the layers a rank
/// built), one tensor at a time.
pub fn load_init(path: &Path, model: &Model, vs: &nn::VarStore) -> anyhow::Result<()> {
    let mut weights = InitWeights::open(path, model)?;
    for (name, mut var) in vs.variables() {
        // LoRA's adapters are no part of the base model (`wrap.lora.init` gives them).
        if transformer::lora::is_adapter(&name) {
            continue;
        }
        let values = weights.whole(&name, &var)?;
        tch::no_grad(|| var.copy_(&values));
    }
    Ok(())
}
