//! The model against the data, on the plan: its architecture, SyncBatchNorm's preconditions,
//! the initial weights and the model's own files.
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
    let arch = data.filter(|_| model_ok).map(|d| crate::model::architecture(&model, &d.input, d.task.outputs()));
    if let (Some(arch), Some(d), Some(l)) = (&arch, data, layout) {
        probe::batch_norm(c, d, l, arch.as_ref(), bad);
    }
    if let (true, Some(arch)) = (c.wrap.sync_batchnorm, &arch) {
        sync_batchnorm(c, arch.as_ref(), bad);
    }
    let init_weights = c.wrap.init.as_ref().map(|rel| base.join(rel));
    if let (Some(path), Some(arch)) = (&init_weights, &arch) {
        if let Err(e) = crate::model::weights::check(path, &crate::model::sorted_parameters(arch.as_ref())) {
            bad("wrap.init", e);
        }
    }
    ModelParts { arch, init_weights, files: crate::model::files(&model) }
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
