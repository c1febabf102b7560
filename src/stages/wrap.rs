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

pub fn wrap<'pg>(plan: &Plan, pg: &'pg ProcessGroup) -> anyhow::Result<Wrapped<'pg>> {
    let c = &plan.config;
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let (d, m) = (&plan.data, &c.wrap.model);
    let model = Mlp::stage(&vs.root(), d.features, m, d.classes, c.run.seed, plan.stages[pg.rank()].clone());
    let ddp = match c.wrap.strategy {
        // The weights are already equal; DDP's broadcast from rank 0 makes sure of it anyway.
        WrapStrategy::Ddp => Some(Ddp::new(pg, &vs.trainable_variables(), c.wrap.bucket_cap_mb, 1)?),
        WrapStrategy::None | WrapStrategy::Pipeline => None,
    };
    let optimizer = Optimizer::new(&c.train, vs.trainable_variables());
    Ok(Wrapped { vs, model, ddp, optimizer })
}
