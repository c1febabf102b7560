//! The initial weights `wrap.init` names, under the model's parameter names: a weights file
//! (`.safetensors`, `.npz`) holding every parameter and buffer as `model.safetensors` does, or a
//! Hugging Face model directory read through its adapter ([`super::hf`]). Any rows of any
//! parameter can be asked for on their own: what a rank that holds shards reads.
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use tch::nn;
use tch::Tensor;

use super::{hf, read_weights, sorted_parameters, transformer, Architecture};
use crate::config::schema::Model;

/// The opened initial weights.
pub enum InitWeights {
    /// A weights file, read whole and checked against the model.
    File(BTreeMap<String, Tensor>),
    /// A Hugging Face checkpoint, its headers checked; each read takes only the rows asked.
    Hf(hf::Checkpoint),
}

impl InitWeights {
    /// Opens `path` (resolved `wrap.init`) for `model`, whose architecture is `arch`.
    pub fn open(path: &Path, model: &Model, arch: &dyn Architecture) -> Result<InitWeights, String> {
        match model {
            Model::Transformer(t) if hf::is_model_dir(path) => {
                let (class, _) = hf::read_config(path)?;
                Ok(InitWeights::Hf(hf::Checkpoint::open(path, class, &transformer::Spec::of(t))?))
            }
            _ => Ok(InitWeights::File(read_weights(path, &sorted_parameters(arch))?)),
        }
    }

    /// Rows `rows` (dim 0) of the parameter or buffer `name`, as float32 (batch norm's count as
    /// int64).
    pub fn rows(&self, name: &str, rows: Range<i64>) -> Result<Tensor, String> {
        match self {
            InitWeights::File(weights) => {
                let t = weights.get(name).ok_or_else(|| format!("the initial weights hold no `{name}`"))?;
                Ok(if t.dim() == 0 { t.shallow_clone() } else { t.narrow(0, rows.start, rows.end - rows.start) })
            }
            InitWeights::Hf(checkpoint) => checkpoint.rows(name, rows),
        }
    }

    /// The whole of `name`.
    pub fn whole(&self, name: &str) -> Result<Tensor, String> {
        match self {
            InitWeights::File(weights) => weights
                .get(name)
                .map(Tensor::shallow_clone)
                .ok_or_else(|| format!("the initial weights hold no `{name}`")),
            InitWeights::Hf(checkpoint) => checkpoint.whole(name),
        }
    }
}

/// Copies the initial weights `path` holds into `vs`'s variables (those of the layers a rank
/// built), one tensor at a time.
pub fn load_init(path: &Path, model: &Model, arch: &dyn Architecture, vs: &nn::VarStore) -> Result<(), String> {
    let weights = InitWeights::open(path, model, arch)?;
    for (name, mut var) in vs.variables() {
        let values = weights.whole(&name)?;
        tch::no_grad(|| var.copy_(&values));
    }
    Ok(())
}
