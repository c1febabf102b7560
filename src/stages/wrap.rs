//! Stage 4, wrap: the model from `[wrap.model]` (the layers this rank holds, each seeded from
//! (seed, layer) alone, so every rank and every strategy starts from the same weights, or read
//! from `wrap.init`, which holds every parameter and buffer under the names `model.safetensors`
//! uses, or is a Hugging Face checkpoint), its strategy (DDP, FSDP, a pipeline stage, or none;
//! DDP and FSDP broadcast the buffers) and its optimizer, over the parameters this rank holds
//! (under FSDP, its shards, built and read one unit at a time: [`wrap_sharded`]).
use std::sync::Arc;

use tch::nn::{self, ModuleT};
use tch::Tensor;

use crate::config::schema::WrapStrategy;
use crate::dist::{ProcessGroup, Sharded};
use crate::model::batchnorm::StatsGroup;
use crate::model::optim::Optimizer;
use crate::model::tensor_group::TensorGroup;
use crate::model::InitWeights;
use crate::model::{Architecture, BuildContext};
use crate::plan::Plan;
use crate::strategy::fsdp::{Fsdp, ShardedModel};
use crate::strategy::tensor::Slices;
use crate::strategy::threads::ThreadReplicas;
use crate::strategy::{MeshGroups, Strategy};

pub struct Wrapped<'pg> {
    pub vs: nn::VarStore,
    /// Its batch norm layers may hold the process group (`wrap.sync_batchnorm`).
    pub model: Box<dyn ModuleT + 'pg>,
    pub strategy: Strategy<'pg>,
    pub optimizer: Optimizer,
}

/// `device`: where this rank keeps its model ([`Plan::device`]). `buckets`: the DDP bucket layout
/// of the checkpoint a run resumes from.
pub fn wrap<'pg>(
    plan: &Plan,
    pg: &'pg ProcessGroup,
    groups: &'pg MeshGroups,
    device: tch::Device,
    buckets: Option<&[Vec<usize>]>,
) -> anyhow::Result<Wrapped<'pg>> {
    let c = &plan.config;
    let vs = nn::VarStore::new(device);
    let arch = plan.model();
    let layers = plan.stages[pg.rank()].clone();
    // With wrap.sync_batchnorm under DDP or FSDP, batch norm's statistics cover the data-parallel
    // group: every rank of the job. The step reports a failed collective.
    let batch_norm = plan.syncs_batch_norm().then(|| StatsGroup::new(pg));
    let tensor = groups.tensor().map(|g| TensorGroup::new(g.clone(), c.wrap.mesh.sequence_parallel));
    let ctx = BuildContext { seed: c.run.seed, batch_norm, tensor, checkpointing: c.wrap.activation_checkpointing };
    if c.wrap.strategy == WrapStrategy::Fsdp {
        return wrap_sharded(plan, groups.data(pg), vs, arch.as_ref(), &ctx);
    }
    let model = arch.build(&vs.root(), layers.clone(), &ctx);
    if let Some(path) = &plan.init_weights {
        // The file holds the whole model; a pipeline stage takes its own layers from it, one
        // tensor at a time.
        match &ctx.tensor {
            Some(group) => load_init_slices(path, plan, arch.as_ref(), &vs, group)?,
            None => crate::model::load_init(path, &c.wrap.model, &vs)?,
        }
    }
    load_adapters(plan, &vs)?;
    // A LoRA run's base model is frozen: no gradients, so no all-reduce and no optimizer state.
    for (name, t) in vs.variables() {
        if arch.frozen(&name) {
            let _ = t.set_requires_grad(false);
        }
    }
    let mut params = crate::model::parameters_in_module_order(arch.as_ref(), layers.clone(), &vs);
    params.retain(Tensor::requires_grad);
    let vars = vs.variables();
    let buffers: Vec<_> = arch.buffers(layers.clone()).iter().map(|(name, _)| vars[name].shallow_clone()).collect();
    let replicas = plan.thread_replicas();
    let threads = (replicas > 1)
        .then(|| {
            let (task, precision) = (plan.data.task, c.train.precision);
            ThreadReplicas::new(arch.as_ref(), layers, &params, replicas, plan.threads_per_replica(), task, precision)
        })
        .transpose()?;
    let strategy = Strategy::new(plan, pg, groups, device, &params, &buffers, buckets, &ctx, threads)?;
    let mut trained = crate::model::named_trainable(&vs);
    trained.retain(|(_, t)| t.requires_grad());
    let optimizer = Optimizer::new(&c.train, trained);
    Ok(Wrapped { vs, model, strategy, optimizer })
}

/// A LoRA run's initial adapters from `wrap.lora.init` (a PEFT adapter directory, checked by the
/// plan), over those drawn from run.seed.
fn load_adapters(plan: &Plan, vs: &nn::VarStore) -> anyhow::Result<()> {
    let c = &plan.config;
    let (Some(adapters), Some(init)) =
        (crate::model::transformer::lora::of_wrap(&c.wrap), c.wrap.lora.as_ref().and_then(|l| l.init.as_ref()))
    else {
        return Ok(());
    };
    let crate::config::schema::Model::Transformer(t) = &c.wrap.model else { return Ok(()) };
    let layers = t.layers;
    let dir = plan.pipeline_file.parent().unwrap_or(std::path::Path::new("")).join(init);
    let file = crate::model::hf::peft::AdapterFile::open(&dir, &adapters, layers).map_err(anyhow::Error::msg)?;
    for (name, mut var) in vs.variables() {
        if crate::model::transformer::lora::is_adapter(&name) {
            let values = file.tensor(&name).map_err(anyhow::Error::msg)?;
            tch::no_grad(|| var.copy_(&values));
        }
    }
    Ok(())
}

/// `wrap.init` under tensor parallelism: each rank reads its slice of every split parameter (the
/// rows it holds, or the columns: of a Hugging Face checkpoint those alone) and the rest whole.
fn load_init_slices(
    path: &std::path::Path,
    plan: &Plan,
    arch: &dyn Architecture,
    vs: &nn::VarStore,
    group: &TensorGroup,
) -> anyhow::Result<()> {
    let mut file = InitWeights::open(path, &plan.config.wrap.model)?;
    let shapes: std::collections::HashMap<String, Vec<i64>> =
        crate::model::sorted_parameters(arch).into_iter().collect();
    for (name, mut var) in vs.variables() {
        let values = match arch.tensor_slice(&name, group.rank(), group.size()) {
            None => file.whole(&name, &var)?,
            Some(slice) => {
                let like = Tensor::empty(shapes[&name].as_slice(), (var.kind(), tch::Device::Cpu));
                file.slice(&name, &slice, &like)?
            }
        };
        tch::no_grad(|| var.f_copy_(&values))
            .map_err(|e| anyhow::anyhow!("`{name}`: {}", crate::checked::torch_message(&e)))?;
    }
    Ok(())
}

/// Under FSDP no rank ever holds the whole model: each layer is built (its weights drawn from its
/// own (seed, layer) stream, as a whole model's are), and its unit sharded at once, its
/// parameters' memory freed, before the next layer is built; so building peaks at the shards
/// plus one unit. Each layer is a module of its own, built under the whole model's names (the
/// sharding gathers each layer's parameters around that layer alone). `wrap.init` then gives
/// each rank its rows of every parameter, read from the file (and the buffers whole). Under
/// tensor parallelism (FSDP × TP), each layer holds its tensor rank's slices, which are sharded
/// over `pg`, the mesh's data group.
fn wrap_sharded<'pg>(
    plan: &Plan,
    pg: &'pg ProcessGroup,
    vs: nn::VarStore,
    arch: &dyn Architecture,
    ctx: &BuildContext<'pg>,
) -> anyhow::Result<Wrapped<'pg>> {
    let c = &plan.config;
    let all = 0..arch.layers().len();
    let mut sharding = Sharded::new(pg, &crate::model::shard_units(arch), c.wrap.fsdp.reshard_after_forward)?;
    let mut layers: Vec<Box<dyn ModuleT + 'pg>> = Vec::new();
    // The parameters' shapes as this rank built them (its slices under tensor parallelism).
    let mut shapes = Vec::new();
    for l in all.clone() {
        layers.push(arch.build(&vs.root(), l..l + 1, ctx));
        let vars = vs.variables();
        // A LoRA run's base is frozen: a unit with no gradients and no optimizer state.
        for (name, _) in arch.parameters(l..l + 1) {
            if arch.frozen(&name) {
                let _ = vars[&name].set_requires_grad(false);
            }
        }
        // A layer with sharded parameters is a unit (crate::model::shard_units), in the layers' order.
        let params: Vec<Tensor> = crate::model::sharded_parameters(arch, l..l + 1)
            .iter()
            .map(|(name, _)| vars[name].shallow_clone())
            .collect();
        shapes.extend(params.iter().map(Tensor::size));
        if !params.is_empty() {
            sharding.add_unit(&params)?;
        }
    }
    load_adapters(plan, &vs)?;
    let vars = vs.variables();
    let buffers: Vec<(String, Tensor)> =
        arch.buffers(all.clone()).into_iter().map(|(name, _)| (name.clone(), vars[&name].shallow_clone())).collect();
    let mut init = plan.init_weights.as_deref().map(|p| InitWeights::open(p, &c.wrap.model)).transpose()?;
    if let Some(file) = init.as_mut() {
        // Before the strategy broadcasts rank 0's buffers: every rank reads them, whole.
        for (name, var) in &buffers {
            let saved = file.whole(name, var)?;
            tch::no_grad(|| var.detach().copy_(&saved));
        }
    }
    let names: Vec<String> =
        crate::model::sharded_parameters(arch, all.clone()).into_iter().map(|(name, _)| name).collect();
    // What each rank holds whole: a LoRA run's adapters.
    let replicated: Vec<(String, Tensor)> = arch
        .parameters(all)
        .into_iter()
        .filter(|(name, _)| !names.contains(name))
        .map(|(name, _)| (name.clone(), vars[&name].shallow_clone()))
        .collect();
    let sharded = Arc::new(sharding);
    let model: Box<dyn ModuleT + 'pg> = Box::new(ShardedModel::new(layers, sharded.clone()));
    let held: Vec<Tensor> = buffers.iter().map(|(_, t)| t.shallow_clone()).collect();
    let tensor = ctx.tensor.clone().map(|g| {
        let slices = Slices::new(arch, g.group().clone());
        (g, slices)
    });
    let parameters = crate::strategy::fsdp::Parameters { names, shapes, replicated };
    let strategy = Fsdp::new(plan, pg, sharded, parameters, &held, ctx.batch_norm.clone(), tensor)?;
    if let Some(file) = init.as_mut() {
        let slices = strategy.slices().map(|tp| Slices::new(arch, tp.group().clone()));
        // Under FSDP × TP: this rank's tensor slice read alone, then its rows of it.
        strategy.load_rows(|name, rows, shard| match slices.as_ref().and_then(|tp| Some((tp, tp.mine(name)?))) {
            Some((tp, slice)) => {
                let like = Tensor::empty(tp.whole_shape(name, &[]).as_slice(), (shard.kind(), tch::Device::Cpu));
                Ok(file.slice(name, slice, &like)?.narrow(0, rows.start, rows.end - rows.start))
            }
            None => file.rows(name, rows, shard),
        })?;
    }
    // The optimizer steps on the trained shards and the replicated adapters alone.
    let optimizer = Optimizer::new(&c.train, strategy.trained());
    Ok(Wrapped { vs, model, strategy: Strategy::Fsdp(strategy), optimizer })
}
