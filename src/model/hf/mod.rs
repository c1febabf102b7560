//! Hugging Face checkpoints, in and out: a model directory as `save_pretrained` writes it
//! (`config.json`, and `model.safetensors` or shards named by `model.safetensors.index.json`)
//! read as the runner's transformer ([`read_config`], [`Checkpoint`]), and a run's model written
//! as one ([`export`]).
//!
//! Each architecture's names and layouts live in one small adapter ([`gpt2`] for
//! `GPT2LMHeadModel`, [`llama`] for `LlamaForCausalLM`), as torchtitan's `StateDictAdapter`s do:
//! for every tensor of the model, the checkpoint's tensors that make it (its rows, in order, each
//! stored as is or transposed), and the `config.json` keys of its shape. Import and export use the
//! same table, so the two cannot disagree; the model code knows nothing of Hugging Face. RoPE is
//! the model's in Hugging Face's rotate-half layout, so Llama's query and key rows load without a
//! permutation; GPT-2's `Conv1D` weights are stored transposed and are read column-wise.
pub mod checkpoint;
mod config;
mod gpt2;
mod llama;
pub mod peft;

use std::path::Path;

use crate::config::schema::Transformer;
use crate::model::transformer::Spec;
pub use checkpoint::Checkpoint;
pub use config::read_config;

/// The checkpoint's configuration file.
pub const CONFIG: &str = "config.json";
/// The weights in one file, or the index of the shards.
pub const WEIGHTS: &str = "model.safetensors";
pub const INDEX: &str = "model.safetensors.index.json";

/// The Hugging Face classes the runner reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Gpt2,
    Llama,
}

impl Arch {
    /// The class name `config.json` lists under `architectures`.
    pub fn class(self) -> &'static str {
        match self {
            Arch::Gpt2 => "GPT2LMHeadModel",
            Arch::Llama => "LlamaForCausalLM",
        }
    }

    /// The class a model of `spec` is exported as: the one whose block it has, or why neither.
    pub fn of(spec: &Spec) -> Result<Arch, String> {
        let gpt2 = gpt2::differences(spec);
        let llama = llama::differences(spec);
        if gpt2.is_empty() {
            Ok(Arch::Gpt2)
        } else if llama.is_empty() {
            Ok(Arch::Llama)
        } else {
            Err(format!(
                "the model is neither a GPT2LMHeadModel ({}) nor a LlamaForCausalLM ({})",
                gpt2.join(", "),
                llama.join(", ")
            ))
        }
    }

    /// How each of the model's parameters is made of the checkpoint's tensors.
    pub fn mappings(self, spec: &Spec, prefix: &str) -> Vec<Mapping> {
        let arch = crate::model::transformer::TransformerArch::from_spec(spec.clone());
        use crate::model::Architecture;
        let all = 0..arch.layers().len();
        arch.parameters(all)
            .into_iter()
            .map(|(ours, shape)| {
                let parts = match self {
                    Arch::Gpt2 => gpt2::parts(spec, &ours, prefix),
                    Arch::Llama => llama::parts(spec, &ours),
                };
                Mapping { ours, shape, parts }
            })
            .collect()
    }

    /// Tensors a checkpoint may hold that are no parameters (old files' attention masks and
    /// rotary frequencies): skipped on import.
    fn ignored(self, name: &str) -> bool {
        match self {
            Arch::Gpt2 => name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias"),
            Arch::Llama => name.ends_with(".rotary_emb.inv_freq"),
        }
    }

    /// The model's configuration as `config.json` describes it: every part set.
    fn read(self, json: &config::Json) -> Result<Transformer, String> {
        match self {
            Arch::Gpt2 => gpt2::read(json),
            Arch::Llama => llama::read(json),
        }
    }

    /// The `config.json` of a model of `spec`.
    pub fn write(self, spec: &Spec) -> serde_json::Map<String, serde_json::Value> {
        match self {
            Arch::Gpt2 => gpt2::write(spec),
            Arch::Llama => llama::write(spec),
        }
    }
}

/// One of the model's parameters and the checkpoint's tensors it is made of: their rows, one
/// after another along the parameter's dim 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapping {
    pub ours: String,
    pub shape: Vec<i64>,
    pub parts: Vec<Part>,
}

/// A checkpoint's tensor that makes `rows` rows of one of the model's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    pub name: String,
    pub rows: i64,
    /// Stored transposed: the parameter's rows are the stored tensor's columns (GPT-2's Conv1D).
    pub transposed: bool,
}

impl Part {
    fn new(name: String, rows: i64) -> Part {
        Part { name, rows, transposed: false }
    }

    /// The stored tensor's shape, for a parameter of `shape`.
    pub fn stored_shape(&self, shape: &[i64]) -> Vec<i64> {
        if self.transposed {
            vec![shape[1], self.rows]
        } else {
            std::iter::once(self.rows).chain(shape.iter().skip(1).copied()).collect()
        }
    }
}

/// Whether `path` is a Hugging Face model directory (a directory: it must hold `config.json`).
pub fn is_model_dir(path: &Path) -> bool {
    path.is_dir()
}

/// `blocks.{i}.{rest}` → (i, rest).
fn block_of(ours: &str) -> Option<(usize, &str)> {
    let rest = ours.strip_prefix("blocks.")?;
    let (i, rest) = rest.split_once('.')?;
    Some((i.parse().ok()?, rest))
}
