//! Stage 4, wrap: the model from `[wrap.model]`, seeded identically on every rank, wrapped in
//! DDP (c10d's Reducer) or left alone; and its optimizer.
use tch::nn::{self, OptimizerConfig};

use crate::config::schema::{Optimizer, WrapStrategy};
use crate::config::Plan;
use crate::dist::{Ddp, ProcessGroup};
use crate::model::Mlp;

pub struct Wrapped<'pg> {
    pub vs: nn::VarStore,
    pub model: Mlp,
    pub ddp: Option<Ddp<'pg>>,
    pub optimizer: nn::Optimizer,
}

pub fn wrap<'pg>(plan: &Plan, pg: &'pg ProcessGroup) -> anyhow::Result<Wrapped<'pg>> {
    let c = &plan.config;
    // The same initial weights at every world size; DDP's broadcast makes sure of it anyway.
    tch::manual_seed(c.run.seed as i64);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = Mlp::new(&vs.root(), plan.data.features, &c.wrap.model, plan.data.classes);
    // Dropout masks differ across ranks, as in torch where each rank draws its own.
    tch::manual_seed(c.run.seed as i64 ^ (0x5EED_0000 + pg.rank() as i64));
    let ddp = match c.wrap.strategy {
        WrapStrategy::Ddp => Some(Ddp::new(pg, &vs.trainable_variables(), c.wrap.bucket_cap_mb, 1)?),
        WrapStrategy::None => None,
    };
    let t = &c.train;
    let optimizer = match t.optimizer {
        Optimizer::Sgd => nn::Sgd { momentum: t.momentum, wd: t.weight_decay, ..Default::default() }.build(&vs, t.lr),
        Optimizer::Adam => nn::Adam { wd: t.weight_decay, ..Default::default() }.build(&vs, t.lr),
        Optimizer::Adamw => nn::AdamW { wd: t.weight_decay, ..Default::default() }.build(&vs, t.lr),
    }?;
    Ok(Wrapped { vs, model, ddp, optimizer })
}
