//! Stage 4, wrap: the model from `[wrap.model]` (the layers this rank holds, each seeded from
//! (seed, layer) alone, so every rank and every strategy starts from the same weights, or read
//! from `wrap.init`, which holds every parameter and buffer under the names `model.safetensors`
//! uses), its strategy (DDP, a pipeline stage, or none; DDP broadcasts the buffers) and its
//! optimizer, over the parameters this rank holds.
use tch::nn::{self, ModuleT};

use crate::dist::ProcessGroup;
use crate::model::batchnorm::StatsGroup;
use crate::model::optim::Optimizer;
use crate::model::BuildContext;
use crate::plan::Plan;
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
    // With wrap.sync_batchnorm under DDP, batch norm's statistics cover the data-parallel group:
    // every rank of the job, each a whole replica. The replica's step reports a failed collective.
    let batch_norm = plan.syncs_batch_norm().then(|| StatsGroup::new(pg));
    let ctx = BuildContext { seed: c.run.seed, batch_norm: batch_norm.clone() };
    let model = arch.build(&vs.root(), layers.clone(), &ctx);
    if let Some(path) = &plan.init_weights {
        // The file holds the whole model; a pipeline stage takes its own layers from it.
        let weights = crate::model::read_weights(path, &crate::model::sorted_parameters(arch.as_ref()))
            .map_err(anyhow::Error::msg)?;
        for (name, mut var) in vs.variables() {
            tch::no_grad(|| var.copy_(&weights[&name]));
        }
    }
    let params = crate::model::parameters_in_module_order(arch.as_ref(), layers.clone(), &vs);
    let vars = vs.variables();
    let buffers: Vec<_> = arch.buffers(layers.clone()).iter().map(|(name, _)| vars[name].shallow_clone()).collect();
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
