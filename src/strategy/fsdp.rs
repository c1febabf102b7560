//! Sharded data parallelism (`wrap.strategy = "fsdp"`), FSDP2's design: every rank trains on its
//! own shard of the data, as under DDP, but holds only 1/world_size of each parameter (dim 0,
//! padded), of its gradient and of the optimizer's state. The model is its layers one after
//! another ([`ShardedModel`]); each layer's parameters are gathered just before its forward and
//! again before its backward, and freed after (`wrap.fsdp.reshard_after_forward`, ZeRO-3) or
//! kept from forward to backward (ZeRO-2). Each layer's gradients are reduce-scattered, averaged
//! as DDP averages them, as soon as its backward is done, while the layers before it compute
//! theirs; the optimizer then steps on the shards alone. The model's buffers (batch norm's
//! running statistics) are whole on every rank and broadcast from rank 0 before each
//! synchronised forward pass and before validation, as under DDP.
//!
//! The collectives live in [`crate::dist::Sharded`]; this module only runs the layers in order
//! around them, so every model kind (a TorchScript module too, as one layer) is sharded unchanged.
use std::sync::Arc;
use std::time::Duration;

use tch::nn::ModuleT;
use tch::{Kind, Tensor};

use super::{Micro, StepOut};
use crate::config::schema::{Precision, ValidateOn};
use crate::data::normalize::Normalizer;
use crate::data::{Dataset, Task};
use crate::device;
use crate::dist::{ProcessGroup, ShardStats, Sharded, Units};
use crate::model::batchnorm::StatsGroup;
use crate::model::Architecture;
use crate::plan::Plan;

/// How the plan's model shards: one unit per layer that has parameters, each layer reading its
/// own unit and those of the layers it shares parameters with ([`Architecture::reads`]).
pub fn units(arch: &dyn Architecture) -> Units {
    let layers = arch.layers().len();
    let counts: Vec<usize> = (0..layers).map(|l| arch.parameters(l..l + 1).len()).collect();
    // The unit of each layer with parameters.
    let mut unit_of = vec![None; layers];
    let mut sizes = Vec::new();
    for (l, &n) in counts.iter().enumerate() {
        if n > 0 {
            unit_of[l] = Some(sizes.len());
            sizes.push(n);
        }
    }
    let layers = (0..layers).map(|l| arch.reads(l).into_iter().filter_map(|r| unit_of[r]).collect()).collect();
    Units { sizes, layers }
}

/// The model under FSDP: its layers, each built on its own, run in order around the sharding's
/// gathers and frees. What the rank's loop, validation and `predict` call as the model.
pub struct ShardedModel<'pg> {
    layers: Vec<Box<dyn ModuleT + 'pg>>,
    sharded: Arc<Sharded<'pg>>,
}

impl<'pg> ShardedModel<'pg> {
    pub fn new(layers: Vec<Box<dyn ModuleT + 'pg>>, sharded: Arc<Sharded<'pg>>) -> ShardedModel<'pg> {
        ShardedModel { layers, sharded }
    }
}

impl std::fmt::Debug for ShardedModel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShardedModel({} layers)", self.layers.len())
    }
}

impl ModuleT for ShardedModel<'_> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let mut h = x.shallow_clone();
        for (l, layer) in self.layers.iter().enumerate() {
            // A failed gather (a peer left) ends the rank with the collective's error: a forward
            // pass returns no Result, and nothing computed without the layer's weights counts.
            let failed = |e: crate::dist::Error| -> ! { crate::checked::fail(e.to_string()) };
            self.sharded.pre_forward(l).unwrap_or_else(|e| failed(e));
            h = layer.forward_t(&h, train);
            self.sharded.post_forward(l, &h).unwrap_or_else(|e| failed(e));
        }
        h
    }
}

pub struct Fsdp<'pg> {
    pg: &'pg ProcessGroup,
    sharded: Arc<Sharded<'pg>>,
    /// The parameters' names in module order, and this rank's shard of each (what the optimizer
    /// updates).
    names: Vec<String>,
    shards: Vec<Tensor>,
    task: Task,
    device: tch::Device,
    precision: Precision,
    /// The model's buffers, broadcast from rank 0 (with more than one rank).
    buffers: Vec<Tensor>,
    batch_norm: Option<Arc<StatsGroup<'pg>>>,
    /// The counters at the end of the last step, for each step's time in collectives.
    last: ShardStats,
}

impl<'pg> Fsdp<'pg> {
    /// `names`: the parameters' names in module order, as `sharded` holds them.
    pub fn new(
        plan: &Plan,
        pg: &'pg ProcessGroup,
        device: tch::Device,
        sharded: Arc<Sharded<'pg>>,
        names: Vec<String>,
        buffers: &[Tensor],
        batch_norm: Option<Arc<StatsGroup<'pg>>>,
    ) -> anyhow::Result<Fsdp<'pg>> {
        let buffers = if pg.size() > 1 { buffers.iter().map(Tensor::shallow_clone).collect() } else { Vec::new() };
        // Every rank starts from rank 0's buffers, as DDP's construction makes them.
        super::broadcast_from_rank0(pg, &buffers)?;
        let last = sharded.stats(false)?;
        let shards = sharded.shards()?;
        Ok(Fsdp {
            pg,
            sharded,
            names,
            shards,
            task: plan.data.task,
            device,
            precision: plan.config.train.precision,
            buffers,
            batch_norm,
            last,
        })
    }

    pub fn sharded(&self) -> &Sharded<'pg> {
        &self.sharded
    }

    /// This rank's shard of each parameter, under the parameter's name.
    pub fn shards(&self) -> Vec<(String, Tensor)> {
        self.names.iter().cloned().zip(self.shards.iter().map(Tensor::shallow_clone)).collect()
    }

    /// Forward, loss and backward of one batch; the gradients, averaged over the ranks, are added
    /// to the shards' (every batch is reduce-scattered, accumulation sums the shards).
    pub fn step(&mut self, model: &dyn ModuleT, x: &Tensor, y: &Tensor, micro: Micro) -> anyhow::Result<StepOut> {
        let dev = self.device;
        let t0 = device::now(dev);
        if micro.sync {
            super::broadcast_from_rank0(self.pg, &self.buffers)?;
        }
        let out = super::in_precision(self.precision, || model.forward_t(x, true))?;
        if let Some(e) = self.batch_norm.as_ref().and_then(|g| g.failure()) {
            return Err(e.into());
        }
        let out = if out.kind() == Kind::Float { out } else { out.to_kind(Kind::Float) };
        let t1 = device::now(dev);
        let per_sample = self.task.per_sample_loss(&out, y);
        let loss = per_sample.mean(Kind::Float);
        let loss = if micro.scale == 1.0 { loss } else { loss * micro.scale };
        let t2 = device::now(dev);
        loss.f_backward().map_err(|e| {
            self.pg.explain(crate::dist::Error::new("backward (gather and reduce-scatter)", e.to_string()))
        })?;
        self.sharded.finish_backward()?;
        let backward = device::elapsed(dev, t2);
        let now = self.sharded.stats(false)?;
        let comm = (now.gather_wait + now.reduce_wait).saturating_sub(self.last.gather_wait + self.last.reduce_wait);
        self.last = now;
        Ok(StepOut {
            correct: Some(tch::no_grad(|| self.task.correct(&out, y))),
            per_sample: Some(per_sample.detach()),
            forward: t1 - t0,
            loss: t2 - t1,
            backward,
            comm: Some(comm),
            overlap: Duration::ZERO,
            wait: Duration::ZERO,
        })
    }

    /// Every rank runs the layers (their gathers are collectives): over its share of the rows
    /// with `validate.on = "split"`, else over all of them; rank 0 (every rank with "all")
    /// measures.
    pub fn validate(
        &self,
        plan: &Plan,
        model: &dyn ModuleT,
        data: &Dataset,
        normalizer: &Normalizer,
    ) -> anyhow::Result<Option<crate::data::Metrics>> {
        super::broadcast_from_rank0(self.pg, &self.buffers)?;
        let on = plan.config.validate.on;
        let x = normalizer.apply(&data.val_x);
        let forward = |x: &Tensor| Ok(tch::no_grad(|| model.forward_t(x, false)));
        let out = match on {
            ValidateOn::Split if self.pg.size() > 1 => super::replica::split_forward(self.pg, &x, forward)?,
            _ => forward(&x)?,
        };
        if self.pg.rank() != 0 && on != ValidateOn::All {
            return Ok(None);
        }
        Ok(Some(data.metrics(&out, &data.val_y)))
    }

    /// The whole model's parameters on rank 0, one all-gather per parameter (no rank holds more
    /// than its shards and one whole parameter at a time besides what it returns), with rank 0's
    /// buffers; `None` on the other ranks.
    pub fn gather_model(&self, buffers: Vec<(String, Tensor)>) -> anyhow::Result<Option<Vec<(String, Tensor)>>> {
        let mut named = Vec::new();
        for (i, name) in self.names.iter().enumerate() {
            let whole = self.sharded.full(i)?;
            if self.pg.rank() == 0 {
                named.push((name.clone(), whole.to_device(tch::Device::Cpu)));
            }
        }
        if self.pg.rank() != 0 {
            return Ok(None);
        }
        named.extend(buffers.into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu))));
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Some(named))
    }
}
