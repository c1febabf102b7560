//! `config.json`: which architecture a checkpoint is, and its shape as the runner's
//! `[wrap.model]`; each key read with a message naming it when it is not what the runner takes.
use std::path::Path;

use serde_json::Value;

use super::{Arch, CONFIG};
use crate::config::schema::Transformer;

/// The most a `config.json` may hold.
const CAP: u64 = 16 << 20;

/// A `config.json`'s keys, and the file, for the messages.
pub struct Json {
    map: serde_json::Map<String, Value>,
}

impl Json {
    /// A key that must be a whole number.
    pub fn count(&self, key: &str) -> Result<usize, String> {
        self.count_or(key, None)
    }

    /// A whole number, or `default` where the key is absent or null.
    pub fn count_or(&self, key: &str, default: Option<usize>) -> Result<usize, String> {
        match self.map.get(key) {
            None | Some(Value::Null) => default.ok_or_else(|| format!("it has no `{key}`")),
            Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| format!("`{key}` is {v}, not a whole number")),
        }
    }

    /// A number, or `default` where the key is absent or null.
    pub fn number_or(&self, key: &str, default: f64) -> Result<f64, String> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| format!("`{key}` is {v}, not a number")),
        }
    }

    pub fn flag_or(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| format!("`{key}` is {v}, not true or false")),
        }
    }

    pub fn text_or<'a>(&'a self, key: &str, default: &'a str) -> Result<&'a str, String> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_str().ok_or_else(|| format!("`{key}` is {v}, not a string")),
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
}

/// The architecture `dir/config.json` describes and the model it makes; what is wrong otherwise
/// (the message names the file).
pub fn read_config(dir: &Path) -> Result<(Arch, Transformer), String> {
    let path = dir.join(CONFIG);
    if !path.exists() {
        return Err(format!(
            "{} is a directory without {CONFIG}: wrap.init names a weights file (.safetensors, .npz) or a Hugging Face \
             model directory (config.json and model.safetensors, as save_pretrained writes them)",
            dir.display()
        ));
    }
    let text = crate::input::read_capped(&path, CAP, "the checkpoint's configuration")?;
    let at = |e: String| format!("{}: {e}", path.display());
    let map = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Err(at("not a JSON object".into())),
        Err(e) => return Err(at(format!("not JSON ({e})"))),
    };
    let json = Json { map };
    if let Some(q) = json.get("quantization_config") {
        // Reading such weights as plain tensors would give another model, or none.
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unnamed");
        return Err(at(format!(
            "has a `quantization_config` (quant_method \"{method}\"): its weights are quantized, and the runner reads \
             only full-precision weights (float32, bfloat16, float16): give the unquantized model, or save a \
             dequantized copy with transformers (`model.dequantize()`, then `save_pretrained`)"
        )));
    }
    let arch = architecture(&json).map_err(at)?;
    let mut model = arch.read(&json).map_err(|e| at(format!("{} {e}", arch.class())))?;
    if model.tied == Some(true) && super::checkpoint::head_apart(dir, arch, &model)? {
        model.tied = Some(false);
    }
    Ok((arch, model))
}

/// The class `architectures` names (or `model_type`, in files without it).
fn architecture(json: &Json) -> Result<Arch, String> {
    let known = |name: &str| match name {
        "GPT2LMHeadModel" | "GPT2Model" => Some(Arch::Gpt2),
        "LlamaForCausalLM" | "LlamaModel" => Some(Arch::Llama),
        _ => None,
    };
    let theirs = match json.get("architectures") {
        Some(Value::Array(names)) => names.iter().filter_map(Value::as_str).map(str::to_owned).collect(),
        Some(v) => return Err(format!("`architectures` is {v}, not a list of class names")),
        None => match json.text_or("model_type", "")? {
            "gpt2" => return Ok(Arch::Gpt2),
            "llama" => return Ok(Arch::Llama),
            "" => return Err("it names no architecture (neither `architectures` nor `model_type`)".into()),
            other => vec![format!("model_type \"{other}\"")],
        },
    };
    match theirs.iter().find_map(|n| known(n)) {
        Some(arch) => Ok(arch),
        None => Err(format!(
            "it describes a {}, an architecture the runner does not have; it imports {} and {}",
            theirs.join(", "),
            Arch::Gpt2.class(),
            Arch::Llama.class()
        )),
    }
}
