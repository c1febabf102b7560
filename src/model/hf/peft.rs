//! LoRA adapters as PEFT saves them: `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
//! ...) and `adapter_model.safetensors`, whose keys are the base class's module paths under
//! `base_model.model.` with `lora_A.weight` / `lora_B.weight` (the adapter's name, `default`,
//! left out). Read as `wrap.lora.init`, written by `runner export --peft`: one table of names
//! ([`key`]) both ways.
use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};
use tch::{Kind, Tensor};

use super::{block_of, Arch};
use crate::model::transformer::lora::Adapters;
use crate::tensorfile::{Entry, TensorFile};

pub const CONFIG: &str = "adapter_config.json";
pub const WEIGHTS: &str = "adapter_model.safetensors";
/// An adapter directory's files.
pub const FILES: [&str; 2] = [CONFIG, WEIGHTS];

/// PEFT's key of the adapter parameter `ours` (`blocks.{i}.{module}.lora_A`).
pub fn key(class: Arch, ours: &str) -> String {
    let (i, rest) = block_of(ours).expect("an adapter is a block's parameter");
    let layer = match class {
        Arch::Llama => format!("model.layers.{i}"),
        Arch::Gpt2 => format!("transformer.h.{i}"),
    };
    format!("base_model.model.{layer}.{rest}.weight")
}

/// The adapters' parameters of a model of `layers` blocks, with their shapes.
pub fn parameters(adapters: &Adapters, layers: usize) -> Vec<(String, Vec<i64>)> {
    (0..layers)
        .flat_map(|i| adapters.targets.iter().flat_map(move |t| t.parameters(&format!("blocks.{i}"), adapters.rank)))
        .collect()
}

/// An adapter directory read: its configuration checked against `adapters`, its tensors'
/// headers against the model's adapters.
pub struct AdapterFile {
    file: TensorFile,
    class: Arch,
}

impl AdapterFile {
    /// Opens `dir` for `adapters` on a model of `layers` blocks: what `adapter_config.json` and the
    /// tensors' headers disagree with, said.
    pub fn open(dir: &Path, adapters: &Adapters, layers: usize) -> Result<AdapterFile, String> {
        let path = dir.join(CONFIG);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let config: Value = serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
        let number = |k: &str| config.get(k).and_then(Value::as_f64);
        if number("r") != Some(adapters.rank as f64) || number("lora_alpha") != Some(adapters.alpha) {
            return Err(format!(
                "{} has r = {}, lora_alpha = {}, but wrap.lora.rank is {} and wrap.lora.alpha {}: set them as the \
                 adapters were made",
                path.display(),
                config.get("r").unwrap_or(&Value::Null),
                config.get("lora_alpha").unwrap_or(&Value::Null),
                adapters.rank,
                adapters.alpha
            ));
        }
        let path = dir.join(WEIGHTS);
        let file = TensorFile::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut problems = Vec::new();
        let ours = parameters(adapters, layers);
        for (name, shape) in &ours {
            let k = key(adapters.class, name);
            match file.info(&k).map(|i| i.shape.iter().map(|&d| d as i64).collect::<Vec<i64>>()) {
                None => problems.push(format!("no `{k}`")),
                Some(s) if &s != shape => problems.push(format!("`{k}` is {s:?}, the model's is {shape:?}")),
                Some(_) => {}
            }
        }
        let known: Vec<String> = ours.iter().map(|(n, _)| key(adapters.class, n)).collect();
        problems.extend(
            file.entries()
                .into_iter()
                .filter(|(k, _)| !known.contains(k))
                .map(|(k, _)| format!("unexpected `{k}` (wrap.lora.targets leave it out)")),
        );
        if !problems.is_empty() {
            problems.truncate(5);
            return Err(format!("{} does not fit wrap.lora: {}", path.display(), problems.join("; ")));
        }
        Ok(AdapterFile { file, class: adapters.class })
    }

    /// The adapter parameter `ours`, as float32.
    pub fn tensor(&self, ours: &str) -> Result<Tensor, String> {
        Ok(self.file.tensor(&key(self.class, ours), u64::MAX)?.to_kind(Kind::Float))
    }
}

/// Checks the adapter directory `dir` against `adapters` on a model of `layers` blocks.
pub fn check(dir: &Path, adapters: &Adapters, layers: usize) -> Result<(), String> {
    AdapterFile::open(dir, adapters, layers).map(|_| ())
}

/// Writes `tensors` (the adapters' parameters by the runner's names) into `dir` as PEFT saves an
/// adapter of `base` (the base model's directory, recorded as `base_model_name_or_path`).
pub fn write(dir: &Path, adapters: &Adapters, base: &str, tensors: &[(String, Tensor)]) -> anyhow::Result<()> {
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": adapters.rank,
        "lora_alpha": adapters.alpha,
        "lora_dropout": adapters.dropout,
        "target_modules": adapters.names(),
        "bias": "none",
        // GPT-2's Conv1D stores its weights transposed; PEFT sets this for it.
        "fan_in_fan_out": adapters.class == Arch::Gpt2,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "use_rslora": false,
        "use_dora": false,
    });
    crate::rundir::atomic_write(&dir.join(CONFIG), (serde_json::to_string_pretty(&config)? + "\n").as_bytes())?;
    let entries = tensors
        .iter()
        .map(|(name, t)| Entry {
            name: key(adapters.class, name),
            kind: Kind::Float,
            shape: t.size(),
            bytes: Box::new(move || Ok(crate::tensorfile::bytes_of(&t.to_kind(Kind::Float).contiguous()).into())),
        })
        .collect();
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    crate::tensorfile::write(&dir.join(WEIGHTS), Some(metadata), entries)
}
