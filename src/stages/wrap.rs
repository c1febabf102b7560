//! Stage 4, wrap: the model from `[wrap.model]` (the layers this rank holds, each seeded from
//! (seed, layer) alone, so every rank and every strategy starts from the same weights, or read
//! from `wrap.init`, which holds every parameter and buffer under the names `model.safetensors`
//! uses, or is a Hugging Face checkpoint), its strategy (DDP, FSDP, a pipeline stage, or none; DDP and FSDP broadcast the
//! buffers) and its optimizer, over the parameters this rank holds (under FSDP, its shards).
use std::sync::Arc;

use tch::nn::{self, ModuleT};

use crate::config::schema::WrapStrategy;
use crate::dist::{ProcessGroup, Sharded};
use crate::model::batchnorm::StatsGroup;
use crate::model::optim::Optimizer;
use crate::model::BuildContext;
use crate::plan::Plan;
use crate::strategy::fsdp::{Fsdp, ShardedModel};
use crate::strategy::threads::ThreadReplicas;
use crate::strategy::Strategy;

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
    let ctx = BuildContext { seed: c.run.seed, batch_norm: batch_norm.clone() };
    let sharded = c.wrap.strategy == WrapStrategy::Fsdp;
    // Sharding gathers each layer's parameters around that layer alone: the layers are built one
    // by one (into the same variables, under the whole model's names).
    let modules: Vec<Box<dyn ModuleT + 'pg>> = if sharded {
        layers.clone().map(|l| arch.build(&vs.root(), l..l + 1, &ctx)).collect()
    } else {
        vec![arch.build(&vs.root(), layers.clone(), &ctx)]
    };
    if let Some(path) = &plan.init_weights {
        // The file holds the whole model; a pipeline stage takes its own layers from it.
        crate::model::load_init(path, &c.wrap.model, arch.as_ref(), &vs).map_err(anyhow::Error::msg)?;
    }
    let params = crate::model::parameters_in_module_order(arch.as_ref(), layers.clone(), &vs);
    let vars = vs.variables();
    let buffers: Vec<_> = arch.buffers(layers.clone()).iter().map(|(name, _)| vars[name].shallow_clone()).collect();
    if sharded {
        let (names, shapes): (Vec<String>, Vec<Vec<i64>>) = arch.parameters(layers).into_iter().unzip();
        let units = crate::model::shard_units(arch.as_ref());
        let zero3 = c.wrap.fsdp.reshard_after_forward;
        let sharded = Arc::new(Sharded::new(pg, &params, &units, zero3)?);
        let model: Box<dyn ModuleT + 'pg> = Box::new(ShardedModel::new(modules, sharded.clone()));
        let strategy = Fsdp::new(plan, pg, device, sharded, names, shapes, &buffers, batch_norm)?;
        // The optimizer steps on the shards alone.
        let optimizer = Optimizer::new(&c.train, strategy.shards());
        return Ok(Wrapped { vs, model, strategy: Strategy::Fsdp(strategy), optimizer });
    }
    let model = modules.into_iter().next().expect("one module");
    let replicas = plan.thread_replicas();
    let threads = (replicas > 1)
        .then(|| {
            let (task, precision) = (plan.data.task, c.train.precision);
            ThreadReplicas::new(arch.as_ref(), layers, &params, replicas, plan.threads_per_replica(), task, precision)
        })
        .transpose()?;
    let strategy = Strategy::new(plan, pg, device, &params, &buffers, buckets, batch_norm, threads)?;
    let optimizer = Optimizer::new(&c.train, crate::model::named_trainable(&vs));
    Ok(Wrapped { vs, model, strategy, optimizer })
}
