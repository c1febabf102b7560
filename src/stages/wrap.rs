//! Stage 4, wrap: the model from `[wrap.model]`, seeded identically on every rank, wrapped in
//! DDP (c10d's Reducer) or left alone; and its optimizer.
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
pub fn wrap<'pg>(plan: &Plan, pg: &'pg ProcessGroup, resumed: bool) -> anyhow::Result<Wrapped<'pg>> {
    let c = &plan.config;
    // The same initial weights at every world size; DDP's broadcast makes sure of it anyway.
    tch::manual_seed(c.run.seed as i64);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = Mlp::new(&vs.root(), plan.data.features, &c.wrap.model, plan.data.classes);
    if let Some(path) = &plan.init_weights {
        let shapes = crate::model::parameter_shapes(plan.data.features, &c.wrap.model.hidden, plan.data.classes);
        let weights = crate::model::read_weights(path, &shapes).map_err(anyhow::Error::msg)?;
        for (name, mut var) in vs.variables() {
            tch::no_grad(|| var.copy_(&weights[&name]));
        }
    }
    // One rank has no gradients to average: the Reducer would only copy them into its buckets
    // and back.
    let ddp = match c.wrap.strategy {
        WrapStrategy::Ddp if pg.size() > 1 => {
            let params = crate::model::parameters_in_module_order(&vs);
            Some(Ddp::new(pg, &params, c.wrap.bucket_cap_mb, 1, resumed)?)
        }
        WrapStrategy::Ddp | WrapStrategy::None => None,
    };
    let optimizer = Optimizer::new(&c.train, vs.trainable_variables());
    Ok(Wrapped { vs, model, ddp, optimizer })
}
