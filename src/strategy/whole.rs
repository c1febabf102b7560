//! The training state whole, as checkpoints and `model.safetensors` hold it: every variable and
//! the optimizer's state gathered (a tensor group's slices put together) or loaded and cut to what
//! this rank holds; and the buffers rank 0 broadcasts.
use tch::nn;
use tch::{Kind, Tensor};

use super::tensor;
use crate::checkpoint::{Piece, Reader};
use crate::dist::ProcessGroup;
use crate::model::optim::{self, Optimizer};
use crate::plan::Plan;

/// One tensor of the whole model.
#[derive(Debug, Clone)]
pub struct ModelTensor {
    pub name: String,
    pub kind: Kind,
    pub shape: Vec<i64>,
}

/// The variables of `vs` a checkpoint holds, sorted by name: every parameter and buffer but the
/// frozen ones (a LoRA run's base model, read from `wrap.init` again on resume).
pub(super) fn saved_variables(plan: &Plan, vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let arch = plan.model();
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(n, _)| !arch.frozen(n)).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// Every variable of `vs` a checkpoint holds ([`saved_variables`]) and the optimizer's state,
/// each whole (under tensor parallelism, `slices`, gathered over the tensor group: every rank of
/// it calls this); with `steps`, the optimizer's step count too.
pub(super) fn whole_state(
    plan: &Plan,
    vs: &nn::VarStore,
    optimizer: &Optimizer,
    steps: bool,
    slices: Option<&tensor::Slices>,
) -> crate::dist::Result<Vec<Piece>> {
    let whole = |param: &str, t: &Tensor| slices.map_or_else(|| Ok(t.shallow_clone()), |tp| tp.whole(param, t));
    let vars = saved_variables(plan, vs);
    let mut pieces = Vec::new();
    for (name, t) in vars {
        pieces.push(Piece::whole(name.clone(), &whole(&name, &t)?));
    }
    for s in optimizer.state() {
        pieces.push(Piece::whole(s.name, &whole(&s.param, &s.tensor)?));
    }
    if steps {
        pieces.push(Piece::whole(optim::STEPS.to_owned(), &Tensor::from(optimizer.steps() as i64)));
    }
    Ok(pieces)
}

/// Every variable of `vs` and the optimizer's state, whole, from `reader` (under tensor
/// parallelism, this rank's `slices` of them).
pub(super) fn load_whole(
    plan: &Plan,
    reader: &Reader,
    vs: &nn::VarStore,
    optimizer: &mut Optimizer,
    slices: Option<&tensor::Slices>,
) -> anyhow::Result<()> {
    let read = |name: &str, param: &str| -> anyhow::Result<Tensor> {
        let saved = reader.whole(name)?;
        Ok(match slices {
            Some(tp) if tp.is_split(param) => {
                let shape = tp.whole_shape(param, &[]);
                anyhow::ensure!(
                    saved.size() == shape,
                    "the checkpoint's `{name}` is {:?}, the model's is {shape:?}",
                    saved.size()
                );
                tp.local(param, &saved)
            }
            _ => saved,
        })
    };
    for (name, mut t) in saved_variables(plan, vs) {
        let saved = read(&name, &name)?;
        // Shapes and kinds as the model's (floats, or a module buffer's integer count).
        anyhow::ensure!(
            saved.size() == t.size() && saved.is_floating_point() == t.is_floating_point(),
            "the checkpoint's `{name}` is {:?} {:?}, the model's is {:?} {:?}",
            saved.kind(),
            saved.size(),
            t.kind(),
            t.size()
        );
        tch::no_grad(|| t.f_copy_(&saved))
            .map_err(|e| anyhow::anyhow!("`{name}`: {}", crate::checked::torch_message(&e)))?;
    }
    optimizer.load_state(|name, param, _| read(name, param))?;
    let steps = reader.whole(optim::STEPS)?;
    anyhow::ensure!(
        steps.numel() == 1 && !steps.is_floating_point(),
        "the checkpoint's `{}` is {:?} {:?}, not one integer",
        optim::STEPS,
        steps.kind(),
        steps.size()
    );
    optimizer.set_steps(steps.int64_value(&[]).max(0) as usize);
    Ok(())
}

/// The model's buffers (batch norm's running statistics, a TorchScript module's buffers), by name.
pub(super) fn buffers(plan: &Plan, vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let arch = plan.model();
    let vars = vs.variables();
    arch.buffers(0..arch.layers().len())
        .into_iter()
        .map(|(name, _)| (name.clone(), vars[&name].shallow_clone()))
        .collect()
}

/// Copies rank 0's `buffers` into every rank's: one broadcast per element type (float statistics,
/// integer counts) of the buffers flattened together, as torch's `_sync_module_buffers` coalesces.
pub(crate) fn broadcast_from_rank0(pg: &ProcessGroup, buffers: &[Tensor]) -> anyhow::Result<()> {
    for floating in [true, false] {
        let group: Vec<&Tensor> = buffers.iter().filter(|b| b.is_floating_point() == floating).collect();
        if group.is_empty() {
            continue;
        }
        let mut flat = Tensor::cat(&group.iter().map(|b| b.detach().reshape([-1])).collect::<Vec<_>>(), 0);
        pg.broadcast(&mut flat, 0)?;
        let mut at = 0;
        for b in group {
            let n = b.numel() as i64;
            tch::no_grad(|| b.detach().copy_(&flat.narrow(0, at, n).view_as(b)));
            at += n;
        }
    }
    Ok(())
}
