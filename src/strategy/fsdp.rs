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
//! A LoRA run's frozen base is sharded and gathered the same way, but has no gradients, no
//! reduce-scatter and no optimizer state; its adapters are held whole by every rank (they are a
//! fraction of a percent of the base) and their gradients averaged by an all-reduce on the step's
//! last batch, as DDP averages them ([`crate::model::sharded_parameters`]).
//!
//! The collectives live in [`crate::dist::Sharded`]; this module only runs the layers in order
//! around them, so every model kind (a TorchScript module too, as one layer) is sharded unchanged.
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use tch::nn::ModuleT;
use tch::Tensor;

use super::tensor::Slices;
use super::{Micro, StepOut};
use crate::checkpoint::{Piece, Reader};
use crate::config::schema::{Precision, ValidateOn};
use crate::data::normalize::Normalizer;
use crate::data::{Dataset, Task};
use crate::device;
use crate::dist::{ProcessGroup, Sharded};
use crate::model::batchnorm::StatsGroup;
use crate::model::optim::{self, Optimizer};
use crate::model::tensor_group::TensorGroup;
use crate::plan::Plan;

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

/// The parameters as a sharding holds them: the sharded ones' names in module order and their
/// whole shapes (under tensor parallelism, this rank's slices'), and those every rank holds whole,
/// with their names (a LoRA run's adapters).
pub struct Parameters {
    pub names: Vec<String>,
    pub shapes: Vec<Vec<i64>>,
    pub replicated: Vec<(String, Tensor)>,
}

pub struct Fsdp<'pg> {
    pg: &'pg ProcessGroup,
    sharded: Arc<Sharded<'pg>>,
    /// The parameters' names in module order, their whole shapes, and this rank's shard of each
    /// (what the optimizer updates).
    names: Vec<String>,
    shapes: Vec<Vec<i64>>,
    shards: Vec<Tensor>,
    replicated: Vec<(String, Tensor)>,
    task: Task,
    precision: Precision,
    /// The model's buffers, broadcast from rank 0 (with more than one rank).
    buffers: Vec<Tensor>,
    batch_norm: Option<Arc<StatsGroup<'pg>>>,
    /// Under tensor parallelism (FSDP × TP, torchtitan's 2-D): the tensor group, and what each
    /// of its ranks holds of each parameter. `pg` is then the mesh's data group, over which this
    /// rank's slices are sharded.
    tensor: Option<(Arc<TensorGroup>, Slices)>,
}

impl<'pg> Fsdp<'pg> {
    /// `parameters`: as `sharded` holds them, and those held whole.
    pub fn new(
        plan: &Plan,
        pg: &'pg ProcessGroup,
        sharded: Arc<Sharded<'pg>>,
        parameters: Parameters,
        buffers: &[Tensor],
        batch_norm: Option<Arc<StatsGroup<'pg>>>,
        tensor: Option<(Arc<TensorGroup>, Slices)>,
    ) -> anyhow::Result<Fsdp<'pg>> {
        let buffers = if pg.size() > 1 { buffers.iter().map(Tensor::shallow_clone).collect() } else { Vec::new() };
        // Every rank starts from rank 0's buffers, as DDP's construction makes them.
        super::broadcast_from_rank0(pg, &buffers)?;
        let Parameters { names, shapes, replicated } = parameters;
        // Every rank starts from rank 0's whole parameters, as DDP's construction makes them.
        let whole: Vec<Tensor> = replicated.iter().map(|(_, t)| t.shallow_clone()).collect();
        super::broadcast_from_rank0(pg, &whole)?;
        let shards = sharded.shards()?;
        Ok(Fsdp {
            pg,
            sharded,
            names,
            shapes,
            shards,
            replicated,
            task: plan.data.task,
            precision: plan.config.train.precision,
            buffers,
            batch_norm,
            tensor,
        })
    }

    /// The ranks this rank's parameters are sharded over (the mesh's data group).
    pub fn group(&self) -> &'pg ProcessGroup {
        self.pg
    }

    /// What each tensor rank holds of each parameter, under FSDP × TP.
    pub fn slices(&self) -> Option<&Slices> {
        self.tensor.as_ref().map(|(_, s)| s)
    }

    /// Whether this rank writes the pieces that are whole: the first rank of the data group (and
    /// of its tensor group).
    fn first(&self) -> bool {
        self.pg.rank() == 0 && self.tensor.as_ref().is_none_or(|(g, _)| g.rank() == 0)
    }

    pub fn sharded(&self) -> &Sharded<'pg> {
        &self.sharded
    }

    /// This rank's shard of each sharded parameter, under the parameter's name.
    pub fn shards(&self) -> Vec<(String, Tensor)> {
        self.names.iter().cloned().zip(self.shards.iter().map(Tensor::shallow_clone)).collect()
    }

    /// What the optimizer updates: the shards of the trained parameters (not a frozen base's),
    /// and the parameters held whole.
    pub fn trained(&self) -> Vec<(String, Tensor)> {
        let mut trained = self.shards();
        trained.retain(|(_, t)| t.requires_grad());
        trained.extend(self.replicated.iter().map(|(n, t)| (n.clone(), t.shallow_clone())));
        trained
    }

    /// The parameters every rank holds whole (a LoRA run's adapters), by name.
    pub fn replicated(&self) -> &[(String, Tensor)] {
        &self.replicated
    }

    fn is_replicated(&self, param: &str) -> bool {
        self.replicated.iter().any(|(n, _)| n == param)
    }

    /// Forward, loss and backward of one batch; the gradients, averaged over the ranks, are added
    /// to the shards' (every batch is reduce-scattered, accumulation sums the shards).
    pub fn step(
        &mut self,
        model: &dyn ModuleT,
        x: &Tensor,
        y: &Tensor,
        timer: device::StepClock,
        micro: Micro,
    ) -> anyhow::Result<StepOut> {
        let t0 = timer.mark();
        let before = self.sharded.stats(false)?;
        if micro.sync {
            super::broadcast_from_rank0(self.pg, &self.buffers)?;
        }
        let out = super::forward_float(self.precision, model, x)?;
        if let Some(e) = self.batch_norm.as_ref().and_then(|g| g.failure()) {
            return Err(e.into());
        }
        if let Some(e) = self.tensor.as_ref().and_then(|(g, _)| g.failure()) {
            return Err(e.into());
        }
        let t1 = timer.mark();
        let (per_sample, loss) = super::scaled_loss(self.task, &out, y, micro.scale);
        let t2 = timer.mark();
        loss.f_backward().map_err(|e| {
            self.pg.explain(crate::dist::Error::new("backward (gather and reduce-scatter)", e.to_string()))
        })?;
        // A checkpointed block's recomputation ran its tensor collectives again.
        if let Some(e) = self.tensor.as_ref().and_then(|(g, _)| g.failure()) {
            return Err(e.into());
        }
        self.sharded.finish_backward()?;
        if micro.sync && !self.replicated.is_empty() && self.pg.size() > 1 {
            let whole: Vec<Tensor> = self.replicated.iter().map(|(_, t)| t.shallow_clone()).collect();
            super::average_gradients(self.pg, &whole)?;
        }
        let backward = timer.since(&t2);
        let after = self.sharded.stats(false)?;
        // The time this step spent waiting for all-gathers and reduce-scatters.
        let comm = (after.gather_wait + after.reduce_wait).saturating_sub(before.gather_wait + before.reduce_wait);
        Ok(StepOut {
            correct: Some(tch::no_grad(|| self.task.correct(&out, y))),
            per_sample: Some(per_sample.detach()),
            forward: device::Span::between(&t0, &t1),
            loss: device::Span::between(&t1, &t2),
            backward,
            comm: Some(comm),
            overlap: Duration::ZERO,
            wait: Duration::ZERO,
        })
    }

    /// Every rank runs the layers (their gathers are collectives), so every rank validates its
    /// share of the rows, scaled as rank 0 scales them, and rank 0 measures them all: rank 0's
    /// metrics, whether `validate.on` is "rank0" or "split". With "all", every rank validates
    /// every row with its own scaling, and measures.
    pub fn validate(
        &self,
        plan: &Plan,
        model: &dyn ModuleT,
        data: &Dataset,
        normalizer: &Normalizer,
    ) -> anyhow::Result<Option<crate::data::Metrics>> {
        super::broadcast_from_rank0(self.pg, &self.buffers)?;
        let forward = |x: &Tensor| Ok(tch::no_grad(|| model.forward_t(x, false)));
        let shared = plan.config.validate.on != ValidateOn::All && self.pg.size() > 1;
        let out = if shared {
            let x = normalizer.of_rank(self.pg, 0)?.apply(&data.val_x);
            super::replica::split_forward(self.pg, &x, forward)?
        } else {
            forward(&normalizer.apply(&data.val_x))?
        };
        if shared && self.pg.rank() != 0 {
            return Ok(None);
        }
        Ok(Some(data.metrics(&out, &data.val_y)))
    }

    /// The rows of parameter `i` this rank's shard holds, of its whole (unpadded) rows: rank r's
    /// `r·k .. min(d0, (r+1)·k)`, possibly none on the last ranks.
    fn rows(&self, i: usize) -> Range<i64> {
        let (k, d0, r) = (self.shards[i].size()[0], self.shapes[i][0], self.pg.rank() as i64);
        (r * k).min(d0)..((r + 1) * k).min(d0)
    }

    /// This rank's share of the training state as checkpoint pieces: its rows of every parameter
    /// and of the optimizer's state of each (the padding left out); rank 0 adds the buffers and
    /// the step count, whole. Every rank writes its own at once.
    /// Under tensor parallelism the rows of a slice are not rows of the whole: every tensor is
    /// gathered whole and the first rank hands it (so the checkpoint loads under any mesh).
    pub fn state_pieces(&self, buffers: &[(String, Tensor)], optimizer: &Optimizer) -> anyhow::Result<Vec<Piece>> {
        if self.tensor.is_some() {
            let whole = self.whole_state(buffers, optimizer)?;
            let mut pieces: Vec<Piece> = whole.iter().map(|(name, t)| Piece::whole(name.clone(), t)).collect();
            pieces.push(Piece::whole(optim::STEPS.to_owned(), &Tensor::from(optimizer.steps() as i64)));
            return Ok(if self.first() { pieces } else { Vec::new() });
        }
        let piece = |name: String, i: usize, held: &Tensor| {
            let rows = self.rows(i);
            let tensor = held.detach().narrow(0, 0, rows.end - rows.start).to_device(tch::Device::Cpu).copy();
            Piece { name, shape: self.shapes[i].clone(), offset: rows.start, tensor }
        };
        // A frozen base is not saved: it is read from wrap.init again on resume.
        let mut pieces: Vec<Piece> = (0..self.names.len())
            .filter(|&i| self.shards[i].requires_grad())
            .map(|i| piece(self.names[i].clone(), i, &self.shards[i]))
            .collect();
        let first = self.pg.rank() == 0;
        for s in optimizer.state() {
            if !self.is_replicated(&s.param) {
                pieces.push(piece(s.name, self.index(&s.param)?, &s.tensor));
            } else if first {
                pieces.push(Piece::whole(s.name, &s.tensor.detach().to_device(tch::Device::Cpu)));
            }
        }
        if first {
            let whole =
                |(name, t): &(String, Tensor)| Piece::whole(name.clone(), &t.detach().to_device(tch::Device::Cpu));
            pieces.extend(self.replicated.iter().map(whole));
            pieces.extend(buffers.iter().map(|(name, t)| Piece::whole(name.clone(), t)));
            pieces.push(Piece::whole(optim::STEPS.to_owned(), &Tensor::from(optimizer.steps() as i64)));
        }
        Ok(pieces)
    }

    /// Sets this rank's rows of every parameter from `read(name, rows, shard)`, which gives rows
    /// `rows` of the parameter `name` (of which `shard` holds this rank's, padded): `wrap.init`'s
    /// and a checkpoint's, read without the rest of the tensor.
    pub fn load_rows(
        &self,
        read: impl FnMut(&str, Range<i64>, &Tensor) -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<()> {
        self.load_rows_of(|_| true, read)
    }

    /// [`Fsdp::load_rows`] for the parameters `which` picks (by index).
    fn load_rows_of(
        &self,
        which: impl Fn(usize) -> bool,
        mut read: impl FnMut(&str, Range<i64>, &Tensor) -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<()> {
        for i in (0..self.names.len()).filter(|&i| which(i)) {
            let (name, rows) = (&self.names[i], self.rows(i));
            let loaded = padded(name, read(name, rows.clone(), &self.shards[i])?, rows, &self.shards[i])?;
            let mut shard = self.shards[i].shallow_clone();
            tch::no_grad(|| shard.f_copy_(&loaded)).map_err(|e| anyhow::anyhow!("`{name}`: {e}"))?;
        }
        Ok(())
    }

    /// Loads this rank's rows of every parameter and of its optimizer state from a checkpoint
    /// written under any strategy and world size (the reader reads only the pieces holding them),
    /// the buffers and the step count whole.
    pub fn load_state(
        &mut self,
        reader: &Reader,
        buffers: &[(String, Tensor)],
        optimizer: &mut Optimizer,
    ) -> anyhow::Result<()> {
        // Rows `rows` of this rank's part of `name` (of parameter `param`): under tensor
        // parallelism, of its slice of the whole.
        let read = |name: &str, param: &str, rows: Range<i64>| match self.slices() {
            Some(tp) if tp.is_split(param) => {
                Ok(tp.local(param, &reader.whole(name)?).narrow(0, rows.start, rows.end - rows.start))
            }
            _ => reader.rows(name, rows),
        };
        // A frozen base is not in the checkpoint: it was read from wrap.init.
        self.load_rows_of(|i| self.shards[i].requires_grad(), |name, rows, _| read(name, name, rows))?;
        optimizer.load_state(|name, param, held| {
            if self.is_replicated(param) {
                return reader.whole(name);
            }
            let rows = self.rows(self.index(param)?);
            padded(name, read(name, param, rows.clone())?, rows, held)
        })?;
        for (name, t) in self.replicated.iter().chain(buffers) {
            let saved = reader.whole(name)?;
            anyhow::ensure!(
                saved.size() == t.size(),
                "the checkpoint's `{name}` is {:?}, the model's {:?}",
                saved.size(),
                t.size()
            );
            let mut t = t.shallow_clone();
            tch::no_grad(|| t.f_copy_(&saved)).map_err(|e| anyhow::anyhow!("`{name}`: {e}"))?;
        }
        let steps = reader.whole(optim::STEPS)?;
        anyhow::ensure!(
            steps.numel() == 1 && !steps.is_floating_point(),
            "the checkpoint's `{}` is not one integer",
            optim::STEPS
        );
        optimizer.set_steps(steps.int64_value(&[]).max(0) as usize);
        Ok(())
    }

    /// `t` of the whole model on rank 0 (`None` elsewhere): a parameter all-gathered from every
    /// rank's shard (a collective: every rank calls it for the same tensors in the same order),
    /// a buffer from rank 0's own (`cpu`).
    pub fn gather_tensor(
        &self,
        pg: &ProcessGroup,
        t: &super::ModelTensor,
        cpu: impl Fn(&str) -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<Option<Tensor>> {
        match self.names.iter().position(|n| *n == t.name) {
            Some(i) => {
                let mut whole = self.sharded.full(i)?;
                if let Some(tp) = self.slices() {
                    whole = tp.whole(&t.name, &whole)?;
                }
                Ok((pg.rank() == 0).then(|| whole.to_device(tch::Device::Cpu)))
            }
            None => (pg.rank() == 0).then(|| cpu(&t.name)).transpose(),
        }
    }

    /// Every parameter and every optimizer state tensor whole (all-gathered from the shards, on
    /// every rank: a collective), with the buffers: what the ranks hold together.
    pub fn whole_state(
        &self,
        buffers: &[(String, Tensor)],
        optimizer: &Optimizer,
    ) -> anyhow::Result<Vec<(String, Tensor)>> {
        // Under tensor parallelism, each rank's slice gathered whole over the tensor group.
        let whole = |param: &str, t: Tensor| match self.slices() {
            Some(tp) => tp.whole(param, &t),
            None => Ok(t),
        };
        let mut out = Vec::new();
        for (i, name) in self.names.iter().enumerate() {
            // Every rank gathers every parameter (a collective); a frozen base is not state.
            let full = whole(name, self.sharded.full(i)?)?;
            if self.shards[i].requires_grad() {
                out.push((name.clone(), full));
            }
        }
        out.extend(self.replicated.iter().map(|(n, t)| (n.clone(), t.detach())));
        for s in optimizer.state() {
            if self.is_replicated(&s.param) {
                out.push((s.name, s.tensor.detach()));
                continue;
            }
            let d0 = self.shapes[self.index(&s.param)?][0];
            let parts = self.pg.all_gather(&s.tensor.detach().contiguous())?;
            out.push((s.name, whole(&s.param, Tensor::cat(&parts, 0).narrow(0, 0, d0))?));
        }
        out.extend(buffers.iter().map(|(n, t)| (n.clone(), t.shallow_clone())));
        Ok(out)
    }

    fn index(&self, param: &str) -> anyhow::Result<usize> {
        self.names.iter().position(|n| n == param).ok_or_else(|| anyhow::anyhow!("no parameter `{param}` is sharded"))
    }
}

/// `saved`, rows `rows` of `name`, as `held` holds them: the padding rows after them zero.
fn padded(name: &str, saved: Tensor, rows: Range<i64>, held: &Tensor) -> anyhow::Result<Tensor> {
    let mut shape = held.size();
    anyhow::ensure!(
        saved.size()[1..] == shape[1..],
        "the checkpoint's `{name}` is {:?} per row, this model's {:?}",
        &saved.size()[1..],
        &shape[1..]
    );
    shape[0] -= rows.end - rows.start;
    let pad = Tensor::zeros(shape.as_slice(), (saved.kind(), saved.device()));
    Ok(Tensor::cat(&[saved, pad], 0))
}
