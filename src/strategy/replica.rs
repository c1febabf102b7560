//! Every rank holds a whole replica of the model (`wrap.strategy = "ddp"` or `"none"`). With DDP
//! and more than one rank, c10d's Reducer averages the gradients in buckets while the backward
//! pass runs; otherwise each rank trains alone. Under DDP the model's buffers (batch norm's
//! running statistics, a TorchScript module's buffers and frozen parameters) are broadcast from
//! rank 0 before each synchronised forward pass, as torch's `broadcast_buffers=True` does, and
//! before validation, so every rank validates the model rank 0 saves.

use std::sync::Arc;

use tch::nn::ModuleT;
use tch::Tensor;

use super::tensor::Slices;
use super::threads::ThreadReplicas;
use super::{Micro, StepOut};
use crate::config::schema::{Precision, ValidateOn, WrapStrategy};
use crate::data::normalize::Normalizer;
use crate::data::{Dataset, Task};
use crate::device;
use crate::dist::{Ddp, ProcessGroup};
use crate::model::batchnorm::StatsGroup;
use crate::model::optim::Optimizer;
use crate::model::tensor_group::TensorGroup;
use crate::plan::Plan;

pub struct Replica<'pg> {
    pg: &'pg ProcessGroup,
    ddp: Option<Ddp<'pg>>,
    task: Task,
    /// Where the model and batches are (step timings synchronise it).
    device: tch::Device,
    precision: Precision,
    /// Synchronised steps taken so far (the Reducer numbers its iterations the same way).
    iteration: i64,
    /// The group the model's batch norm layers synchronise over (`wrap.sync_batchnorm`), where a
    /// forward pass leaves a failed collective.
    batch_norm: Option<Arc<StatsGroup<'pg>>>,
    /// The model's buffers, broadcast from rank 0 (under DDP with more than one rank; else empty).
    buffers: Vec<Tensor>,
    /// More replicas on this rank's threads (`wrap.threads_per_replica`), and this replica's
    /// parameters in module order, whose gradients theirs are added to.
    threads: Option<(ThreadReplicas, Vec<Tensor>)>,
    /// Average the gradients across ranks after the backward passes, in one all-reduce: under
    /// DDP with thread replicas, whose gradients c10d's Reducer would not wait for.
    average_after: bool,
    /// Under tensor parallelism: the group the layers are split across (whose forward pass can
    /// leave a failed collective), and what each rank holds of each parameter. `pg` is then the
    /// mesh's data group.
    tensor: Option<(Arc<TensorGroup>, Slices)>,
}

impl<'pg> Replica<'pg> {
    /// `pg`: the ranks holding copies of this rank's model (the mesh's data group); `ctx`: the
    /// groups the model's layers were built with.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        plan: &Plan,
        pg: &'pg ProcessGroup,
        device: tch::Device,
        params: &[Tensor],
        buffers: &[Tensor],
        buckets: Option<&[Vec<usize>]>,
        ctx: &crate::model::BuildContext<'pg>,
        threads: Option<ThreadReplicas>,
    ) -> anyhow::Result<Replica<'pg>> {
        let c = &plan.config;
        let batch_norm = ctx.batch_norm.clone();
        let tensor = ctx.tensor.clone().map(|g| {
            let slices = Slices::new(plan.model().as_ref(), g.group().clone());
            (g, slices)
        });
        let average_after = threads.is_some() && c.wrap.strategy == WrapStrategy::Ddp && pg.size() > 1;
        if average_after {
            // What the Reducer does when it is built: every rank starts from rank 0's weights.
            super::broadcast_from_rank0(pg, params)?;
        }
        let ddp = match c.wrap.strategy {
            // One rank has no gradients to average: the Reducer would only copy them into its
            // buckets and back.
            WrapStrategy::Ddp if pg.size() > 1 && !average_after => {
                // The Reducer samples its timers on its first ten iterations and on the ones the
                // step trace records (none after the tenth with step_every = 0).
                let every = if c.trace.step_every > 0 { c.trace.step_every } else { usize::MAX / 2 };
                Some(Ddp::new(pg, params, c.wrap.bucket_cap_mb, every, buckets)?)
            }
            _ => None,
        };
        let buffers = if ddp.is_some() { buffers.iter().map(Tensor::shallow_clone).collect() } else { Vec::new() };
        let precision = c.train.precision;
        let threads = threads.map(|t| (t, params.iter().map(Tensor::shallow_clone).collect()));
        Ok(Replica {
            pg,
            ddp,
            task: plan.data.task,
            device,
            precision,
            iteration: 0,
            batch_norm,
            buffers,
            threads,
            average_after,
            tensor,
        })
    }

    /// What each tensor rank holds of each parameter, under tensor parallelism.
    /// The ranks holding copies of this rank's model (the mesh's data group).
    pub fn group(&self) -> &'pg ProcessGroup {
        self.pg
    }

    pub fn slices(&self) -> Option<&Slices> {
        self.tensor.as_ref().map(|(_, s)| s)
    }

    /// [`Replica::step`] with thread replicas: this thread computes the batch's first part while
    /// they compute theirs; the gradients are summed, then averaged across ranks under DDP.
    fn step_threads(&mut self, model: &dyn ModuleT, x: &Tensor, y: &Tensor, micro: Micro) -> anyhow::Result<StepOut> {
        let (task, precision, dev) = (self.task, self.precision, self.device);
        let (threads, params) = self.threads.as_mut().expect("thread replicas");
        let t0 = device::now(dev);
        let mut forward = Default::default();
        let part = threads.step(params, x, y, micro.scale, |x, y, scale| {
            let (per_sample, correct) =
                super::threads::forward_backward(model, task, precision, x, y, scale, &mut forward)?;
            Ok(super::threads::Part { per_sample, correct })
        })?;
        let t1 = device::now(dev);
        let comm = if self.average_after && micro.sync {
            super::average_gradients(self.pg, params)?;
            Some(device::elapsed(dev, t1))
        } else {
            None
        };
        Ok(StepOut {
            correct: Some(part.correct),
            per_sample: Some(part.per_sample),
            forward: device::Span::host(forward),
            loss: Default::default(),
            // With the other replicas' backward passes, and the sum of their gradients.
            backward: device::Span::host((t1 - t0).saturating_sub(forward)),
            comm,
            overlap: Default::default(),
            wait: Default::default(),
        })
    }

    /// `timer`: the step's (traced: the step trace records it, and the Reducer has timed it). The
    /// gradients add to those of the batches before it in the optimizer step; DDP averages them on
    /// the last (`micro.sync`), as torch's `no_sync` does.
    pub fn step(
        &mut self,
        model: &dyn ModuleT,
        _optimizer: &mut Optimizer,
        x: &Tensor,
        y: &Tensor,
        timer: device::StepClock,
        micro: Micro,
    ) -> anyhow::Result<StepOut> {
        if micro.sync || self.ddp.is_none() {
            self.iteration += 1;
        }
        if self.threads.is_some() {
            return self.step_threads(model, x, y, micro);
        }
        let t0 = timer.mark();
        if let Some(ddp) = self.ddp.as_mut() {
            ddp.set_sync(micro.sync);
            ddp.prepare_forward()?;
        }
        if micro.sync {
            super::broadcast_from_rank0(self.pg, &self.buffers)?;
        }
        let out = super::forward_float(self.precision, model, x)?;
        // SyncBatchNorm's statistics all-reduce failed (a peer left): nothing of this step counts.
        if let Some(e) = self.batch_norm.as_ref().and_then(|g| g.failure()) {
            return Err(e.into());
        }
        if let Some(e) = self.tensor.as_ref().and_then(|(g, _)| g.failure()) {
            return Err(e.into());
        }
        let t1 = timer.mark();
        let (per_sample, loss) = super::scaled_loss(self.task, &out, y, micro.scale);
        let t2 = timer.mark();
        if let Some(ddp) = self.ddp.as_mut() {
            ddp.prepare_backward()?;
        }
        loss.f_backward()
            .map_err(|e| self.pg.explain(crate::dist::Error::new("backward (gradient all-reduce)", e.to_string())))?;
        // A checkpointed block's recomputation ran its tensor collectives again.
        if let Some(e) = self.tensor.as_ref().and_then(|(g, _)| g.failure()) {
            return Err(e.into());
        }
        let backward = timer.since(&t2);
        let times = match self.ddp.as_mut() {
            Some(ddp) if micro.sync && (timer.traced() || self.iteration <= 10) => ddp.reducer_times(self.iteration)?,
            _ => None,
        };
        Ok(StepOut {
            correct: Some(tch::no_grad(|| self.task.correct(&out, y))),
            per_sample: Some(per_sample.detach()),
            forward: device::Span::between(&t0, &t1),
            loss: device::Span::between(&t1, &t2),
            backward,
            comm: times.map(|t| t.backward_comm),
            overlap: times.map(|t| t.overlap).unwrap_or_default(),
            wait: Default::default(),
        })
    }

    /// On rank 0 (every rank with `validate.on = "all"`), normalised with this rank's statistics
    /// (rank 0's with `"split"`).
    pub fn validate(
        &self,
        plan: &Plan,
        model: &dyn ModuleT,
        data: &Dataset,
        normalizer: &Normalizer,
    ) -> anyhow::Result<Option<crate::data::Metrics>> {
        super::broadcast_from_rank0(self.pg, &self.buffers)?;
        let on = plan.config.validate.on;
        let rank = self.pg.rank();
        if rank != 0 && on == ValidateOn::Rank0 {
            return Ok(None);
        }
        // Split, each rank scales its share as rank 0 would scale it: the metrics are rank 0's.
        let x = match on {
            ValidateOn::Split if self.pg.size() > 1 => normalizer.of_rank(self.pg, 0)?.apply(&data.val_x),
            _ => normalizer.apply(&data.val_x),
        };
        let forward = |x: &Tensor| -> anyhow::Result<Tensor> {
            let forward = |x: &Tensor| tch::no_grad(|| model.forward_t(x, false));
            match &self.threads {
                Some((threads, _)) => threads.forward(x, forward),
                None => Ok(forward(x)),
            }
        };
        let out = match on {
            ValidateOn::Split if self.pg.size() > 1 => split_forward(self.pg, &x, forward)?,
            _ => forward(&x)?,
        };
        if rank != 0 && on == ValidateOn::Split {
            return Ok(None);
        }
        Ok(Some(data.metrics(&out, &data.val_y)))
    }

    pub fn bucket_layout(&self) -> anyhow::Result<Option<Vec<Vec<usize>>>> {
        Ok(self.ddp.as_ref().map(Ddp::bucket_layout).transpose()?)
    }
}

/// `validate.on = "split"`: `forward` over this rank's share of `x`'s rows (contiguous and
/// balanced, rank 0's first), then every rank's outputs all-gathered in row order. The plan
/// gives every rank at least one row.
pub(super) fn split_forward(
    pg: &ProcessGroup,
    x: &Tensor,
    forward: impl FnOnce(&Tensor) -> anyhow::Result<Tensor>,
) -> anyhow::Result<Tensor> {
    let (rank, n) = (pg.rank(), x.size()[0]);
    let sizes = super::pipeline::micro_sizes(n, pg.size());
    anyhow::ensure!(sizes.len() == pg.size(), "{n} validation rows cannot be split among {} ranks", pg.size());
    let at: i64 = sizes[..rank].iter().sum();
    let out = forward(&x.narrow(0, at, sizes[rank]))?;
    // An all-gather takes the same shape from every rank: the shorter shares are padded to the
    // first (the longest), and the padding dropped after.
    let mut shape = out.size();
    shape[0] = sizes[0] - sizes[rank];
    let out = Tensor::cat(&[&out, &Tensor::zeros(shape.as_slice(), (out.kind(), out.device()))], 0);
    let parts = pg.all_gather(&out)?;
    Ok(Tensor::cat(&parts.iter().zip(&sizes).map(|(p, &k)| p.narrow(0, 0, k)).collect::<Vec<_>>(), 0))
}
