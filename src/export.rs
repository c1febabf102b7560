//! `runner export RUN_DIR --hf OUT_DIR`: a finished run's transformer as a Hugging Face model
//! directory, as `save_pretrained` writes one: `config.json`, `model.safetensors` (or shards
//! `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json` past
//! `--max-shard-size`), float32, under the class's own names and layouts, and the run's
//! tokenizer (`tokenizer.json` and a `tokenizer_config.json` naming `PreTrainedTokenizerFast`, so
//! that `AutoTokenizer` gives the runner's ids) where it has one. The directory is written beside
//! OUT_DIR and renamed into place once complete: an export is whole or absent.
//!
//! A LoRA run (`wrap.lora`) exports its model merged (W + (alpha / r) · B · A, as PEFT's
//! `merge_and_unload`), or with `--peft OUT_DIR` its adapters alone, as PEFT saves them, with the
//! run's tokenizer ([`export_peft`]).
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::Context;
use serde_json::{json, Value};
use tch::{Kind, Tensor};

use crate::config::schema::Model;
use crate::model::hf::{Arch, Mapping, Part, CONFIG, INDEX, WEIGHTS};
use crate::model::transformer::lora::{self, Adapters};
use crate::model::transformer::Spec;
use crate::plan::Plan;
use crate::tensorfile::{Entry, TensorFile};
use crate::tokenizer::{Tokenizer, Vocabulary, END_OF_TEXT, TOKENIZER};

/// transformers' own default shard size.
pub const DEFAULT_SHARD: &str = "50GB";

/// A size as transformers' `convert_file_size_to_int` reads one: "50GB", "200MB", "10KB"
/// (decimal), "5GiB", "200MiB", "1KiB" (binary), the units in any case but a decimal one ending
/// in a lower-case `b`, which counts bits ("5Gb" is 625000000 bytes); here also a bare number of
/// bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let bad =
        || format!("{text:?} is not a size: give a whole number with GB, MB, KB, GiB, MiB or KiB (\"5GB\"), or bytes");
    let t = text.trim();
    let (digits, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let (scale, bits) = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => (1, false),
        "KIB" => (1 << 10, false),
        "MIB" => (1 << 20, false),
        "GIB" => (1 << 30, false),
        "KB" => (1_000, unit.ends_with('b')),
        "MB" => (1_000_000, unit.ends_with('b')),
        "GB" => (1_000_000_000, unit.ends_with('b')),
        _ => return Err(bad()),
    };
    let bytes = digits.parse::<u64>().ok().and_then(|n| n.checked_mul(scale)).map(|n| if bits { n / 8 } else { n });
    match bytes {
        Some(n) if n > 0 => Ok(n),
        _ => Err(bad()),
    }
}

/// One tensor of the export: the rows of one of the model's parameters it holds.
struct Out<'m> {
    name: String,
    mapping: &'m Mapping,
    /// Its first row in the parameter.
    offset: i64,
    part: &'m Part,
}

impl Out<'_> {
    fn shape(&self) -> Vec<i64> {
        self.part.stored_shape(&self.mapping.shape)
    }

    fn bytes(&self) -> u64 {
        self.shape().iter().product::<i64>() as u64 * 4
    }

    /// Its values, from the run's model file, with `adapters` merged in.
    fn tensor(&self, model: &TensorFile, adapters: Option<&Adapters>) -> anyhow::Result<Tensor> {
        let whole = merged(model, &self.mapping.ours, adapters)?;
        let rows = whole.narrow(0, self.offset, self.part.rows);
        Ok(if self.part.transposed { rows.tr().contiguous() } else { rows.contiguous() })
    }
}

/// The model's parameter `ours` from the run's model file (float32), with the updates of the
/// adapters on it added to their rows: W + (alpha / r) · B · A.
fn merged(model: &TensorFile, ours: &str, adapters: Option<&Adapters>) -> anyhow::Result<Tensor> {
    let read = |name: &str| model.tensor(name, u64::MAX).map(|t| t.to_kind(Kind::Float)).map_err(anyhow::Error::msg);
    let whole = read(ours)?;
    let Some((ad, (block, rest))) = adapters.zip(ours.strip_prefix("blocks.").and_then(|r| r.split_once('.'))) else {
        return Ok(whole);
    };
    let site = match rest {
        "qkv.weight" => lora::Site::Qkv,
        "proj.weight" => lora::Site::Proj,
        "fc.weight" => lora::Site::Fc,
        "out.weight" => lora::Site::Out,
        _ => return Ok(whole),
    };
    for t in ad.targets.iter().filter(|t| t.site == site) {
        let [(a, _), (b, _)] = t.parameters(&format!("blocks.{block}"), ad.rank);
        let update = read(&b)?.mm(&read(&a)?) * ad.scale();
        let mut rows = whole.narrow(0, t.rows.start, t.rows.end - t.rows.start);
        let _ = rows.g_add_(&update);
    }
    Ok(whole)
}

/// Writes `run_dir`'s model to `out` as a Hugging Face checkpoint, shards of at most
/// `max_shard` bytes (a LoRA run's adapters merged into it).
pub fn export(run_dir: &Path, out: &Path, max_shard: u64) -> anyhow::Result<u8> {
    let plan = Plan::load(&run_dir.join(crate::rundir::PLAN))?;
    let Model::Transformer(t) = &plan.config.wrap.model else {
        let why = format!("export --hf writes a language model, but this run trained a {}", plan.model().describe());
        return Err(crate::config::ConfigError::new(why).into());
    };
    let spec = Spec::of(t);
    let arch = Arch::of(&spec).map_err(|e| anyhow::anyhow!("{e}: Hugging Face has no class for it"))?;
    let model_path = crate::checkpoint::model::trained_model(run_dir)?;
    let model = TensorFile::open(&model_path).map_err(|e| anyhow::anyhow!("{}: {e}", model_path.display()))?;
    let shapes = crate::model::sorted_parameters(plan.model().as_ref());
    for (name, shape) in &shapes {
        let found = model.info(name).map(|i| i.shape.iter().map(|&d| d as i64).collect::<Vec<i64>>());
        anyhow::ensure!(
            found.as_ref() == Some(shape),
            "{} does not hold the run's model: `{name}` is {found:?}, the plan's {shape:?}",
            model_path.display()
        );
    }
    check_new(out)?;
    let mappings = arch.mappings(&spec, if arch == Arch::Gpt2 { "transformer." } else { "" });
    let tensors: Vec<Out> = mappings
        .iter()
        .flat_map(|m| {
            let mut offset = 0;
            m.parts.iter().map(move |part| {
                let o = Out { name: part.name.clone(), mapping: m, offset, part };
                offset += part.rows;
                o
            })
        })
        .collect();
    let tokenizer = tokenizer_of(&plan)?;
    let adapters = lora::of_wrap(&plan.config.wrap);
    let files = into_place(out, |tmp| {
        let mut files = write_dir(tmp, arch, &spec, &tensors, &model, adapters.as_ref(), max_shard)?;
        if let Some(t) = &tokenizer {
            files.extend(write_tokenizer(tmp, t, &spec, &chat_settings(&plan)?)?);
        }
        Ok(files)
    })?;
    let bytes: u64 = tensors.iter().map(Out::bytes).sum();
    crate::say!(
        "exported {} ({}, {} tensors, {:.1} MB in {}) to {}",
        plan.model().describe(),
        arch.class(),
        tensors.len(),
        bytes as f64 / 1e6,
        files.join(", "),
        out.display()
    );
    Ok(0)
}

/// Refuses an output directory that exists and is not empty.
fn check_new(out: &Path) -> anyhow::Result<()> {
    if out.exists() && std::fs::read_dir(out).map(|mut d| d.next().is_some()).unwrap_or(true) {
        let why = format!("{} already exists and is not empty: give a new directory", out.display());
        return Err(crate::config::ConfigError::new(why).into());
    }
    Ok(())
}

/// The directory `out` as `write` makes it, written beside it and renamed into place once
/// complete (removed on an error): whole or absent. The names of the files written.
fn into_place(out: &Path, write: impl FnOnce(&Path) -> anyhow::Result<Vec<String>>) -> anyhow::Result<Vec<String>> {
    let tmp = crate::rundir::tmp_path(out);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let files = match write(&tmp) {
        Ok(files) => files,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if out.exists() {
        std::fs::remove_dir(out).with_context(|| format!("cannot replace the empty {}", out.display()))?;
    }
    std::fs::rename(&tmp, out).with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))?;
    Ok(files)
}

/// Writes `run_dir`'s LoRA adapters to `out` as PEFT saves them (`adapter_config.json`,
/// `adapter_model.safetensors`), for `PeftModel.from_pretrained` over the run's wrap.init.
pub fn export_peft(run_dir: &Path, out: &Path) -> anyhow::Result<u8> {
    let plan = Plan::load(&run_dir.join(crate::rundir::PLAN))?;
    let (Some(adapters), Model::Transformer(t)) = (lora::of_wrap(&plan.config.wrap), &plan.config.wrap.model) else {
        let why = format!(
            "export --peft writes LoRA adapters, but this run trained every weight of {} (it has no [wrap.lora]); \
             use export --hf",
            plan.model().describe()
        );
        return Err(crate::config::ConfigError::new(why).into());
    };
    let model_path = crate::checkpoint::model::trained_model(run_dir)?;
    let model = TensorFile::open(&model_path).map_err(|e| anyhow::anyhow!("{}: {e}", model_path.display()))?;
    let tensors = crate::model::hf::peft::parameters(&adapters, t.layers)
        .into_iter()
        .map(|(name, _)| {
            let t = model.tensor(&name, u64::MAX).map_err(|e| anyhow::anyhow!("{}: {e}", model_path.display()))?;
            Ok((name, t))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    check_new(out)?;
    let base = plan.init_weights.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
    let tokenizer = tokenizer_of(&plan)?;
    let files = into_place(out, |tmp| {
        crate::model::hf::peft::write(tmp, &adapters, &base, &tensors)?;
        let mut files: Vec<String> = crate::model::hf::peft::FILES.iter().map(|f| f.to_string()).collect();
        if let Some(tokenizer) = &tokenizer {
            files.extend(write_tokenizer(tmp, tokenizer, &Spec::of(t), &chat_settings(&plan)?)?);
        }
        Ok(files)
    })?;
    crate::say!(
        "exported the LoRA adapters of {} (rank {}, alpha {}, on {}; {} tensors in {}) to {}",
        plan.model().describe(),
        adapters.rank,
        adapters.alpha,
        adapters.names().join(", "),
        tensors.len(),
        files.join(", "),
        out.display()
    );
    Ok(0)
}

/// The checkpoint's files in `dir`: config.json, then the shards (and their index); their names.
fn write_dir(
    dir: &Path,
    arch: Arch,
    spec: &Spec,
    tensors: &[Out],
    model: &TensorFile,
    adapters: Option<&Adapters>,
    max_shard: u64,
) -> anyhow::Result<Vec<String>> {
    let mut config = arch.write(spec);
    config.insert("dtype".into(), json!("float32"));
    // No special token but a tokenizer's end of text: generation stops only there, or at its length.
    config.insert("bos_token_id".into(), Value::Null);
    config.insert("eos_token_id".into(), Value::Null);
    crate::rundir::atomic_write(&dir.join(CONFIG), (serde_json::to_string_pretty(&config)? + "\n").as_bytes())?;
    // Shards in the model's order, each as full as the size allows (one tensor at least).
    let mut shards: Vec<Vec<&Out>> = vec![Vec::new()];
    let mut size = 0;
    for t in tensors {
        let last = shards.last_mut().expect("a shard");
        if !last.is_empty() && size + t.bytes() > max_shard {
            shards.push(vec![t]);
            size = t.bytes();
        } else {
            last.push(t);
            size += t.bytes();
        }
    }
    let n = shards.len();
    let name = |i: usize| if n == 1 { WEIGHTS.to_owned() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let entries = shard
            .iter()
            .map(|t| {
                weight_map.insert(t.name.clone(), name(i));
                Entry {
                    name: t.name.clone(),
                    kind: Kind::Float,
                    shape: t.shape(),
                    bytes: Box::new(move || Ok(crate::tensorfile::bytes_of(&t.tensor(model, adapters)?).into())),
                }
            })
            .collect();
        let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
        crate::tensorfile::write(&dir.join(name(i)), Some(metadata), entries)?;
    }
    let mut files = vec![CONFIG.to_owned()];
    files.extend((0..n).map(name));
    if n > 1 {
        let total: u64 = tensors.iter().map(Out::bytes).sum();
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        crate::rundir::atomic_write(&dir.join(INDEX), (serde_json::to_string_pretty(&index)? + "\n").as_bytes())?;
        files.push(INDEX.to_owned());
    }
    Ok(files)
}

/// The run's tokenizer, when its vocabulary is a tokenizer.json (characters and bytes have no
/// Hugging Face form); refused when it changed since the run.
fn tokenizer_of(plan: &Plan) -> anyhow::Result<Option<Tokenizer>> {
    if plan.vocabulary.is_none() {
        return Ok(None);
    }
    Ok(match plan.read_vocabulary()? {
        Vocabulary::Tokenizer(t) => Some(*t),
        Vocabulary::Chars(_) | Vocabulary::Bytes => None,
    })
}

/// An instruction run's chat template and special tokens, from the `tokenizer_config.json` (and
/// `chat_template.jinja`, which transformers prefers) its plan read, refused if they changed since.
fn chat_settings(plan: &Plan) -> anyhow::Result<serde_json::Map<String, Value>> {
    use crate::data::instructions::template::{CONFIG as SETTINGS, JINJA};
    let mut out = serde_json::Map::new();
    for then in plan.inputs.iter().filter(|i| i.key == "load.tokenizer") {
        let name = then.path.file_name().unwrap_or_default();
        if name != SETTINGS && name != JINJA {
            continue;
        }
        let now = crate::plan::InputFile::read(&then.key, &then.path).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            now.digest == then.digest,
            "{} is not the one this run trained with: it changed since (digest {} then, {} now); put it back",
            then.path.display(),
            then.digest,
            now.digest
        );
        let text =
            std::fs::read_to_string(&then.path).with_context(|| format!("cannot read {}", then.path.display()))?;
        if name == JINJA {
            out.insert("chat_template".into(), json!(text));
            continue;
        }
        let settings: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not JSON", then.path.display()))?;
        for key in ["chat_template", "bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(v) = settings.get(key).filter(|v| !v.is_null()) {
                out.entry(key).or_insert_with(|| v.clone());
            }
        }
    }
    Ok(out)
}

/// `tokenizer.json` as the run had it, and the `tokenizer_config.json` that makes
/// `AutoTokenizer` load it as it is (no token added to the texts it encodes); the end-of-text
/// token, where the vocabulary has one, as the end of a sequence, unless `chat` (an instruction
/// run's chat template and special tokens) names others. Their names.
fn write_tokenizer(
    dir: &Path,
    t: &Tokenizer,
    spec: &Spec,
    chat: &serde_json::Map<String, Value>,
) -> anyhow::Result<Vec<String>> {
    let bytes = std::fs::read(t.path()).with_context(|| format!("cannot read {}", t.path().display()))?;
    crate::rundir::atomic_write(&dir.join(TOKENIZER), &bytes)?;
    let end = (t.encode(END_OF_TEXT)?.len() == 1).then_some(END_OF_TEXT);
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": spec.max_positions,
        "clean_up_tokenization_spaces": false,
        "add_bos_token": false,
        "add_eos_token": false,
        "bos_token": end,
        "eos_token": end,
    });
    chat.iter().for_each(|(k, v)| config[k] = v.clone());
    crate::rundir::atomic_write(
        &dir.join(TOKENIZER_CONFIG),
        (serde_json::to_string_pretty(&config)? + "\n").as_bytes(),
    )?;
    // The model's config names the same tokens by id (a token is its text, or {"content": ...}).
    let id = |key: &str| -> anyhow::Result<Option<u32>> {
        let text = config.get(key).and_then(|v| v.as_str().or_else(|| v.get("content")?.as_str()));
        Ok(match text {
            Some(text) => Some(t.encode(text)?).filter(|ids| ids.len() == 1).map(|ids| ids[0]),
            None => None,
        })
    };
    let (bos, eos) = (id("bos_token")?, id("eos_token")?);
    // An adapter's directory has no config.json.
    let path = dir.join(CONFIG);
    if (bos.is_some() || eos.is_some()) && path.exists() {
        let mut model: serde_json::Map<String, Value> = serde_json::from_slice(&std::fs::read(&path)?)?;
        bos.map(|id| model.insert("bos_token_id".into(), json!(id)));
        eos.map(|id| model.insert("eos_token_id".into(), json!(id)));
        crate::rundir::atomic_write(&path, (serde_json::to_string_pretty(&model)? + "\n").as_bytes())?;
    }
    Ok(vec![TOKENIZER.to_owned(), TOKENIZER_CONFIG.to_owned()])
}

/// The tokenizer's settings for transformers.
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_transformers_reads_them() {
        assert_eq!(parse_size("50GB"), Ok(50_000_000_000));
        assert_eq!(parse_size("200MB"), Ok(200_000_000));
        assert_eq!(parse_size("10KB"), Ok(10_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        // transformers' binary units, and its bits: a decimal unit ending in a lower-case b
        // (convert_file_size_to_int gives 1024, 2097152, 3221225472, 1250 and 625000000).
        assert_eq!(parse_size("1KiB"), Ok(1024));
        assert_eq!(parse_size("2mib"), Ok(2 << 20));
        assert_eq!(parse_size("3GiB"), Ok(3 << 30));
        assert_eq!(parse_size("10 kb"), Ok(1250));
        assert_eq!(parse_size("5Gb"), Ok(625_000_000));
        for bad in ["0", "5TB", "GB", "1.5GB", "1 TiB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
