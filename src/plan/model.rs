//! The model against the data, on the plan: its architecture, SyncBatchNorm's preconditions,
//! the initial weights (a weights file, or a Hugging Face checkpoint whose config.json gives
//! `[wrap.model]`) and the model's own files.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::schema::*;
use crate::data::shard::ShardLayout;
use crate::data::DataSpec;
use crate::model::Architecture;

use super::probe;

/// The model's part of a plan: what the checks found.
pub(super) struct ModelParts {
    pub arch: Option<Box<dyn Architecture>>,
    pub init_weights: Option<PathBuf>,
    /// The files `wrap.init` names: the file, or a checkpoint's config.json and weights.
    pub init_files: Vec<PathBuf>,
    pub files: Vec<(&'static str, PathBuf)>,
}

/// The model against the data: its architecture (a TorchScript module runs a batch here),
/// SyncBatchNorm's preconditions, the initial weights and the model's own files.
pub(super) fn model_parts(
    c: &Config,
    base: &Path,
    data: Option<&DataSpec>,
    layout: Option<&ShardLayout>,
    model_ok: bool,
    bad: &mut impl FnMut(&str, String),
) -> ModelParts {
    let model = crate::model::resolve_paths(&c.wrap.model, base);
    let model_ok = model_ok
        && data.is_some_and(|d| {
            let probe = || layout.and_then(|l| probe::torchscript_probe(c, d, l));
            crate::model::check_input(&model, &d.input, d.task.outputs(), probe, bad)
        });
    // Checked whatever else is wrong with the model: a refusal names every problem.
    let lora_ok = c.wrap.lora.as_ref().is_none_or(|l| lora(c, base, &model, l, bad));
    let model_ok = model_ok && lora_ok;
    let arch = data
        .filter(|_| model_ok)
        .map(|d| crate::model::architecture(&model, &d.input, d.task.outputs(), c.wrap.lora.as_ref()));
    if let (Some(arch), Some(d), Some(l)) = (&arch, data, layout) {
        probe::batch_norm(c, d, l, arch.as_ref(), bad);
    }
    if let (true, Some(arch)) = (c.wrap.sync_batchnorm, &arch) {
        sync_batchnorm(c, arch.as_ref(), bad);
    }
    activation_checkpointing(c, bad);
    let init_weights = c.wrap.init.as_ref().map(|rel| base.join(rel));
    let mut init_files = init_weights.iter().cloned().collect();
    match (&init_weights, &arch, &c.wrap.model) {
        (Some(dir), Some(_), Model::Transformer(t)) if crate::model::hf::is_model_dir(dir) => {
            match hf_checkpoint(dir, t) {
                Ok(files) => init_files = files,
                Err(e) => bad("wrap.init", e),
            }
        }
        (Some(path), Some(arch), _) => {
            if let Err(e) = crate::model::weights::check(path, &crate::model::sorted_parameters(arch.as_ref())) {
                bad("wrap.init", e);
            }
        }
        _ => {}
    }
    let mut files = crate::model::files(&model);
    if let Some(init) = c.wrap.lora.as_ref().and_then(|l| l.init.as_ref()) {
        let dir = base.join(init);
        files.extend(crate::model::hf::peft::FILES.iter().map(|f| ("wrap.lora.init", dir.join(f))));
    }
    ModelParts { arch, init_weights, init_files, files }
}

/// `wrap.lora` on `model`: a transformer read from a Hugging Face checkpoint, adapters that fit
/// it, initial adapters (`wrap.lora.init`) that fit them; `false` when it cannot be built.
fn lora(c: &Config, base: &Path, model: &Model, l: &Lora, bad: &mut impl FnMut(&str, String)) -> bool {
    let hf_init = c.wrap.init.as_ref().is_some_and(|rel| crate::model::hf::is_model_dir(&base.join(rel)));
    let t = match model {
        Model::Transformer(t) if hf_init => t,
        Model::Transformer(_) => {
            bad(
                "wrap.init",
                "is not set, but [wrap.lora] fine-tunes a published model: set wrap.init to a Hugging Face model \
                 directory (config.json and model.safetensors of a LlamaForCausalLM or GPT2LMHeadModel)"
                    .into(),
            );
            return false;
        }
        other => {
            let kind = match other {
                Model::Torchscript(_) => "a TorchScript module (its layers are its own)",
                Model::Cnn(_) => "a CNN",
                _ => "an MLP",
            };
            bad(
                "wrap.model.kind",
                format!(
                    "makes {kind}, but [wrap.lora] adapts a transformer's linear layers: remove [wrap.lora], or set \
                     wrap.init to a Hugging Face model directory"
                ),
            );
            return false;
        }
    };
    let spec = crate::model::transformer::Spec::of(t);
    let adapters = match crate::model::transformer::lora::resolve(&spec, l) {
        Ok(a) => a,
        Err(problems) => {
            for (key, problem) in problems {
                bad(key, problem);
            }
            return false;
        }
    };
    if let Some(init) = &l.init {
        if let Err(e) = crate::model::hf::peft::check(&base.join(init), &adapters, spec.layers) {
            bad("wrap.lora.init", e);
            return false;
        }
    }
    true
}

/// The strategies LoRA runs under: whole replicas (DDP, or none), one replica per rank, or FSDP
/// (the frozen base sharded, the adapters whole on every rank).
pub(super) fn lora_strategy(c: &Config, bad: &mut impl FnMut(&str, String)) {
    if c.wrap.lora.is_none() {
        return;
    }
    if c.wrap.strategy == WrapStrategy::Pipeline {
        bad(
            "wrap.strategy",
            "is \"pipeline\", but [wrap.lora] does not cut its frozen base into stages yet; use wrap.strategy = \
             \"fsdp\", which shards the base, or \"ddp\", which all-reduces only the adapters' gradients"
                .into(),
        );
    }
    if c.wrap.mesh.tensor.is_some_and(|t| t > 1) {
        bad(
            "wrap.mesh.tensor",
            "splits each layer across ranks, which [wrap.lora] does not support yet (its adapters are whole); \
             remove it, or set it to 1"
                .into(),
        );
    }
    if c.wrap.threads_per_replica.is_some_and(|t| t < super::values::threads_per_rank(c)) {
        bad(
            "wrap.threads_per_replica",
            "splits a rank into thread replicas, which [wrap.lora] does not support yet; remove it".into(),
        );
    }
    if c.wrap.activation_checkpointing.policy != crate::config::schema::CheckpointPolicy::None {
        bad(
            "wrap.activation_checkpointing.policy",
            "recomputes whole blocks, which [wrap.lora]'s adapters do not take part in yet; use policy = \"none\" \
             with [wrap.lora]"
                .into(),
        );
    }
}

/// A Hugging Face checkpoint's tensors checked against the model (their headers alone); its
/// files. A config.json that cannot be read was reported by [`import_hf`].
fn hf_checkpoint(dir: &Path, t: &Transformer) -> Result<Vec<PathBuf>, String> {
    use crate::model::hf;
    let Ok((arch, _)) = hf::read_config(dir) else { return Ok(Vec::new()) };
    hf::Checkpoint::open(dir, arch, &crate::model::transformer::Spec::of(t))?;
    hf::checkpoint::files(dir)
}

/// The source that values read from a checkpoint's config.json show.
const FROM_CHECKPOINT: &str = "wrap.init config.json";

/// With `wrap.init` naming a Hugging Face model directory, `[wrap.model]` becomes the model its
/// config.json describes (the keys a file, the environment or `--set` gave must agree with it;
/// `seq_len` and `dropout` stay the run's own), and `sources` says where those values came from.
/// Returns the problems found, by key.
pub(super) fn import_hf(c: &mut Config, sources: &mut BTreeMap<String, String>, base: &Path) -> Vec<(String, String)> {
    let Some(dir) = c.wrap.init.as_ref().map(|rel| base.join(rel)).filter(|p| crate::model::hf::is_model_dir(p)) else {
        return Vec::new();
    };
    let (arch, theirs) = match crate::model::hf::read_config(&dir) {
        Ok(read) => read,
        Err(e) => return vec![("wrap.init".into(), e)],
    };
    let given = |sources: &BTreeMap<String, String>, key: &str| sources.get(key).is_some_and(|s| s != "default");
    let ours = match &c.wrap.model {
        Model::Transformer(t) => t.clone(),
        // No kind given: the checkpoint's.
        _ if !given(sources, "wrap.model.kind") => Transformer::default(),
        other => {
            let kind = toml::Value::try_from(other).ok().and_then(|v| v.get("kind").cloned());
            let kind = kind.map(|k| k.to_string()).unwrap_or_default();
            return vec![(
                "wrap.model.kind".into(),
                format!(
                    "is {kind}, but wrap.init is a Hugging Face checkpoint of a {} (a transformer); remove \
                     wrap.model.kind or set it to \"transformer\"",
                    arch.class()
                ),
            )];
        }
    };
    let table = |t: &Transformer| {
        crate::config::schema::with_every_key(|| toml::Value::try_from(t)).expect("a model serializes")
    };
    let (mine, checkpoint) = (table(&ours), table(&theirs));
    let mut problems = Vec::new();
    for (name, value) in checkpoint.as_table().into_iter().flatten() {
        if name == "seq_len" || name == "dropout" {
            continue;
        }
        let key = format!("wrap.model.{name}");
        let set = given(sources, &key);
        match mine.get(name) {
            Some(v) if set && v != value => problems.push((
                key,
                format!(
                    "is {v}, but {} ({}) makes it {value}: remove it from [wrap.model] (the checkpoint sets it), or give another \
                     wrap.init",
                    dir.join(crate::model::hf::CONFIG).display(),
                    arch.class()
                ),
            )),
            _ if !set => {
                sources.insert(key, FROM_CHECKPOINT.into());
            }
            _ => {}
        }
    }
    c.wrap.model = Model::Transformer(Transformer { seq_len: ours.seq_len, dropout: ours.dropout, ..theirs });
    sources.insert("wrap.model.kind".into(), FROM_CHECKPOINT.into());
    problems
}

/// `wrap.activation_checkpointing` needs blocks the runner computes itself: a transformer's, an
/// MLP's hidden layers.
fn activation_checkpointing(c: &Config, bad: &mut impl FnMut(&str, String)) {
    let ac = c.wrap.activation_checkpointing;
    if ac.every == 0 {
        bad("wrap.activation_checkpointing.every", "must be at least 1 (1: every block, k: every k-th block)".into());
    } else if ac.policy == CheckpointPolicy::None && ac.every != 1 {
        bad("wrap.activation_checkpointing.every", "is only read with a policy other than \"none\"; remove it".into());
    }
    if ac.policy == CheckpointPolicy::None {
        return;
    }
    let why = match &c.wrap.model {
        Model::Transformer(_) => return,
        Model::Mlp(_) if ac.policy == CheckpointPolicy::Selective => {
            let why = "\"selective\" recomputes a transformer block's norms and activation between its products, \
                       which an MLP's layers do not have; set it to \"full\" (an MLP's hidden layers recomputed whole)";
            return bad("wrap.activation_checkpointing.policy", why.into());
        }
        Model::Mlp(m) if !m.hidden.is_empty() => return,
        Model::Mlp(_) => "an MLP without hidden layers has no layer to recompute",
        Model::Cnn(_) => "a CNN's blocks cannot be recomputed (not implemented)",
        Model::Torchscript(_) => "a TorchScript module runs its own layers, which the runner cannot recompute",
    };
    bad(
        "wrap.activation_checkpointing.policy",
        format!("{why}; set it to \"none\" (a transformer's blocks and an MLP's hidden layers can be checkpointed)"),
    );
}

/// `wrap.sync_batchnorm` needs batch norm layers the runner owns, in replicas.
fn sync_batchnorm(c: &Config, arch: &dyn Architecture, bad: &mut impl FnMut(&str, String)) {
    if matches!(c.wrap.model, Model::Torchscript(_)) {
        bad(
            "wrap.sync_batchnorm",
            format!(
                "{} runs its own layers: the runner cannot synchronise batch norm inside it; remove it (or use a \
                 built-in model kind, such as \"cnn\" with batch_norm blocks)",
                arch.describe()
            ),
        );
    } else if !arch.has_batch_norm() {
        bad("wrap.sync_batchnorm", format!("{} has no batch norm layers to synchronise; remove it", arch.describe()));
    } else if c.wrap.strategy == WrapStrategy::Pipeline {
        bad(
            "wrap.sync_batchnorm",
            "is not available with wrap.strategy = \"pipeline\": each rank of a pipeline holds other layers, and a \
             batch norm layer normalises each micro-batch on its own; synchronising over the pipeline's copies is not \
             implemented (torch has no equivalent either). Use wrap.strategy = \"ddp\", or remove it"
                .into(),
        );
    }
}
