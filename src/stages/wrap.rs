//! Stage 4, wrap: the model from `[wrap.model]` (each layer seeded from (seed, layer) alone, so
//! every rank and every strategy starts from the same weights), wrapped in DDP (c10d's Reducer),
//! left alone, or cut to the layers this rank holds in a pipeline; and its optimizer, over the
//! parameters this rank holds.
use tch::nn;

use crate::config::schema::WrapStrategy;
use crate::config::Plan;
use crate::dist::{Ddp, ProcessGroup};
use crate::model::optim::Optimizer;
use crate::model::Mlp;

pub struct Wrapped<'pg> {
    pub vs: nn::VarStore,
    pub model: Mlp,
    pub ddp: Option<Ddp<'pg>>,
    pub optimizer: Optimizer,
}

/// `resumed`: training continues from a checkpoint (DDP's buckets then start out rebuilt).
pub fn wrap<'pg>(
    plan: &Plan,
    pg: &'pg ProcessGroup,
    device: tch::Device,
    resumed: bool,
) -> anyhow::Result<Wrapped<'pg>> {
    let c = &plan.config;
    let vs = nn::VarStore::new(device);
    let (d, m) = (&plan.data, &c.wrap.model);
    let layers = plan.stages[pg.rank()].clone();
    let model = Mlp::stage(&vs.root(), d.features, m, d.classes, c.run.seed, layers.clone());
    if let Some(path) = &plan.init_weights {
        // The file holds the whole model; a pipeline stage takes its own layers from it.
        let all = crate::model::layer_shapes(d.features, &m.hidden, d.classes, 0..m.hidden.len() + 1);
        let weights = crate::model::read_weights(path, &all).map_err(anyhow::Error::msg)?;
        for (name, mut var) in vs.variables() {
            tch::no_grad(|| var.copy_(&weights[&name]));
        }
    }
    let ddp = match c.wrap.strategy {
        // One rank has no gradients to average: the Reducer would only copy them into its
        // buckets and back. The weights are already equal; DDP's broadcast from rank 0 makes sure
        // of it anyway.
        WrapStrategy::Ddp if pg.size() > 1 => {
            let params = crate::model::parameters_in_module_order(&vs);
            Some(Ddp::new(pg, &params, c.wrap.bucket_cap_mb, 1, resumed)?)
        }
        WrapStrategy::Ddp | WrapStrategy::None | WrapStrategy::Pipeline => None,
    };
    let optimizer = Optimizer::new(&c.train, vs.trainable_variables());
    Ok(Wrapped { vs, model, ddp, optimizer })
}
