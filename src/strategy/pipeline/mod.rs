//! Pipeline parallelism (`wrap.strategy = "pipeline"`): each batch is cut into micro-batches;
//! every micro-batch flows forward rank to rank (activations sent with c10d's send/recv), the
//! last rank computes the loss, and every micro-batch's gradient flows back: all forwards then
//! all backwards (GPipe), or one forward one backward once the pipeline is full (1F1B).
//! Parameter gradients accumulate over the micro-batches and each rank then updates its own
//! layers once per batch, so a step equals one process's step on the whole batch.
//!
//! With several copies of the pipeline (`wrap.mesh.data`: consecutive ranks each, own shard of
//! the data), each stage's gradients are then averaged over its copies in the mesh's data group.
//!
//! Every rank knows every shape from the plan (the batch's rows, the widths at its boundaries), so
//! nothing but the tensors themselves is sent. Sends and receives are blocking; the time a rank
//! spends in them is its wait, the pipeline's bubble.
use std::time::Duration;

use tch::nn::ModuleT;
use tch::{Kind, Tensor};

use super::StepOut;
use crate::config::schema::{Precision, Schedule};
use crate::data::normalize::Normalizer;
use crate::data::{Dataset, Task};
use crate::device;
use std::sync::Arc;

mod step;
use step::{timed, Step};

use super::tensor::Slices;
use crate::dist::ProcessGroup;
use crate::model::tensor_group::TensorGroup;
use crate::plan::Plan;

/// Tags keep the three kinds of traffic apart: a schedule mismatch fails instead of mixing data.
const GRAD_TAG: i32 = 1 << 20;
const EVAL_TAG: i32 = 2 << 20;
/// The whole model's tensors, sent to rank 0 one at a time in the same order on every rank.
const MODEL_TAG: i32 = 3 << 20;

/// This rank's place in its copy of the pipeline.
pub struct Stage<'pg> {
    pg: &'pg ProcessGroup,
    /// This rank in the job; its copy's ranks are contiguous, so its neighbours are rank ± 1.
    rank: usize,
    /// Its stage (0 first), and the last stage.
    stage: usize,
    last: usize,
    /// With several copies of the pipeline: the ranks holding this stage in every copy.
    replicas: Option<ProcessGroup>,
    /// The shapes of one sample's activations coming in and going out.
    in_shape: Vec<i64>,
    out_shape: Vec<i64>,
    task: Task,
    micro_batches: usize,
    schedule: Schedule,
    /// Where this rank's activations and gradients are.
    device: tch::Device,
    precision: Precision,
    copies: usize,
    /// The rank of the first copy holding each of the model's variables (by name; its first
    /// tensor rank under tensor parallelism).
    owners: std::collections::HashMap<String, usize>,
    /// Under tensor parallelism (pipeline × TP): the stage's tensor group, and what each of its
    /// ranks holds of each parameter. A stage's neighbours are then `tensor` ranks away.
    tensor: Option<(Arc<TensorGroup>, Slices)>,
}

/// The micro-batch sizes of a batch of `n` rows: `min(micro, n)` parts differing by at most one
/// row, larger first (so every rank derives the same sizes).
pub fn micro_sizes(n: i64, micro: usize) -> Vec<i64> {
    let m = (micro as i64).min(n).max(1);
    (0..m).map(|i| n / m + i64::from(i < n % m)).collect()
}

impl<'pg> Stage<'pg> {
    /// This rank's stage; with several copies of the pipeline, also its group with the same
    /// stage of the other copies (every rank must call this at the same point).
    pub fn new(
        plan: &Plan,
        pg: &'pg ProcessGroup,
        device: tch::Device,
        tensor: Option<Arc<TensorGroup>>,
    ) -> crate::dist::Result<Stage<'pg>> {
        let rank = pg.rank();
        let c = &plan.config;
        let layers = &plan.stages[rank];
        let (in_shape, out_shape) = plan.stage_shapes(layers);
        let mesh = plan.mesh();
        let stages = mesh.pipeline;
        let stage = mesh.coords(rank).pipeline;
        let arch = plan.model();
        let owners = (0..stages)
            .map(|s| s * mesh.tensor)
            .flat_map(|r| {
                let layers = plan.stages[r].clone();
                let mut names = arch.parameters(layers.clone());
                names.extend(arch.buffers(layers));
                names.into_iter().map(move |(name, _)| (name, r))
            })
            .collect();
        let replicas = super::mesh_group(pg, &mesh, crate::plan::mesh::Dim::Data)?;
        Ok(Stage {
            pg,
            rank,
            stage,
            last: stages - 1,
            replicas,
            in_shape,
            out_shape,
            task: plan.data.task,
            micro_batches: c.wrap.pipeline.micro_batches,
            schedule: c.wrap.pipeline.schedule,
            device,
            precision: c.train.precision,
            copies: plan.layout.world_size,
            owners,
            tensor: tensor.map(|g| {
                let slices = Slices::new(arch.as_ref(), g.group().clone());
                (g, slices)
            }),
        })
    }

    /// The rank of the next stage in this copy (the same tensor index).
    fn next(&self) -> usize {
        self.rank + self.tensor.as_ref().map_or(1, |(g, _)| g.size())
    }

    /// The rank of the stage before.
    fn prev(&self) -> usize {
        self.rank - self.tensor.as_ref().map_or(1, |(g, _)| g.size())
    }

    /// What each tensor rank holds of each parameter, under pipeline × TP.
    /// The job's group, over which the stages send to each other.
    pub fn group(&self) -> &'pg ProcessGroup {
        self.pg
    }

    /// The group of the ranks holding this stage in every copy (none with one copy).
    pub fn copies_group(&self) -> Option<&ProcessGroup> {
        self.replicas.as_ref()
    }

    pub fn slices(&self) -> Option<&Slices> {
        self.tensor.as_ref().map(|(_, s)| s)
    }

    /// A collective of the tensor group that failed in the last forward pass (or a checkpointed
    /// block's recomputation).
    pub fn tensor_failure(&self) -> Option<crate::dist::Error> {
        self.tensor.as_ref().and_then(|(g, _)| g.failure())
    }

    /// Copies of the pipeline.
    pub fn copies(&self) -> usize {
        self.copies
    }

    pub fn is_last(&self) -> bool {
        self.stage == self.last
    }

    /// Averages this stage's gradients over the copies of the pipeline (one all-reduce of them
    /// all, flattened in the parameters' fixed order); returns the time it took.
    pub fn average_gradients(&self, params: &[Tensor]) -> anyhow::Result<Duration> {
        let Some(group) = &self.replicas else { return Ok(Duration::ZERO) };
        let t = device::now(self.device);
        super::average_gradients(group, params)?;
        Ok(device::elapsed(self.device, t))
    }

    /// Forward and backward of one batch of `n` rows: `x` on rank 0, `y` on the last rank.
    /// Adds to this rank's parameter gradients those of the batch's mean loss times `scale`,
    /// summed over the micro-batches.
    pub fn train_step(
        &self,
        model: &dyn ModuleT,
        x: &Tensor,
        y: &Tensor,
        n: i64,
        scale: f64,
    ) -> anyhow::Result<StepOut> {
        let sizes = micro_sizes(n, self.micro_batches);
        let m = sizes.len();
        let mut step = Step::new(self, model, x, y, n, sizes);
        step.scale = scale;
        match self.schedule {
            Schedule::Gpipe => {
                for i in 0..m {
                    let input = step.recv_forward(i)?;
                    step.forward(i, input)?;
                    step.send_forward(i)?;
                }
                for i in (0..m).rev() {
                    let grad = step.recv_backward(i)?;
                    step.backward(i, grad)?;
                    step.send_backward(i)?;
                }
            }
            // PipeDream-flush / Megatron order: after `warmup` forwards, one forward then one
            // backward, then the remaining backwards; a rank holds at most `warmup + 1`
            // micro-batches' activations instead of all of them. Where two neighbours send to each
            // other at the same point, both directions are in flight at once.
            Schedule::OneFOneB => {
                let warmup = (self.last - self.stage).min(m);
                for i in 0..warmup {
                    let input = step.recv_forward(i)?;
                    step.forward(i, input)?;
                    step.send_forward(i)?;
                }
                let mut input = if warmup < m { Some(step.recv_forward(warmup)?) } else { None };
                for j in 0..m - warmup {
                    let i = warmup + j;
                    step.forward(i, input.take().expect("received above"))?;
                    let grad = step.send_forward_recv_backward(i, j)?;
                    step.backward(j, grad)?;
                    if i + 1 < m {
                        input = Some(step.send_backward_recv_forward(j, i + 1)?);
                    } else {
                        step.send_backward(j)?;
                    }
                }
                for j in m - warmup..m {
                    let grad = step.recv_backward(j)?;
                    step.backward(j, grad)?;
                    step.send_backward(j)?;
                }
            }
        }
        Ok(step.finish())
    }

    /// The validation rows through every stage of the first copy (the copies hold the same
    /// weights); loss and accuracy measured on its last rank, `None` elsewhere.
    pub fn validate(
        &self,
        plan: &Plan,
        model: &dyn ModuleT,
        data: &Dataset,
        normalizer: &Normalizer,
    ) -> anyhow::Result<Option<crate::data::Metrics>> {
        if plan.replica(self.rank) != 0 {
            return Ok(None);
        }
        let n = data.val_x.size()[0];
        let x = if self.stage == 0 { normalizer.apply(&data.val_x) } else { Tensor::new() };
        let out = self.evaluate(model, &x, n, plan.batch_per_rank as i64)?;
        Ok(out.map(|o| data.metrics(&o, &data.val_y)))
    }

    /// `t` of the whole model on rank 0 (`None` elsewhere): the stage of the first copy holding
    /// it sends it (`cpu` reads it from this rank's variables), unless that is rank 0.
    pub fn gather_tensor(
        &self,
        t: &super::ModelTensor,
        cpu: impl Fn(&str) -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<Option<Tensor>> {
        let owner = *self.owners.get(&t.name).ok_or_else(|| anyhow::anyhow!("no stage holds `{}`", t.name))?;
        let mine = |name: &str| -> anyhow::Result<Tensor> {
            match self.slices() {
                Some(tp) => Ok(tp.whole(name, &cpu(name)?)?),
                None => cpu(name),
            }
        };
        // Under tensor parallelism the owner's tensor group gathers the slices first.
        let tensor = self.tensor.as_ref().map_or(1, |(g, _)| g.size());
        if tensor > 1 && self.rank != owner && self.rank / tensor == owner / tensor {
            let _gathered_by_the_owner = mine(&t.name)?;
            return Ok(None);
        }
        match (self.rank, owner) {
            (0, 0) => Ok(Some(mine(&t.name)?)),
            (0, _) => {
                let mut received = Tensor::zeros(t.shape.as_slice(), (t.kind, tch::Device::Cpu));
                self.pg.recv(&mut received, owner, MODEL_TAG)?;
                Ok(Some(received))
            }
            (r, o) if r == o => {
                self.pg.send(&mine(&t.name)?, 0, MODEL_TAG)?;
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    /// The logits of `x` (`n` rows, given on rank 0) through every stage, in chunks of `chunk`
    /// rows, without gradients; `Some` on the last rank.
    pub fn evaluate(&self, model: &dyn ModuleT, x: &Tensor, n: i64, chunk: i64) -> anyhow::Result<Option<Tensor>> {
        let mut wait = Duration::ZERO;
        let mut logits = Vec::new();
        let mut offset = 0;
        let mut i = 0;
        while offset < n {
            let len = chunk.min(n - offset);
            let input = self.receive_input(x, offset, len, EVAL_TAG + i, &mut wait)?;
            let h = tch::no_grad(|| model.forward_t(&input, false));
            if self.is_last() {
                logits.push(h);
            } else {
                self.pg.send(&h, self.next(), EVAL_TAG + i)?;
            }
            offset += len;
            i += 1;
        }
        Ok(self.is_last().then(|| Tensor::cat(&logits, 0)))
    }

    /// The input of a micro-batch of `len` rows at `offset`: rank 0 slices it from `x`, the others
    /// receive it from the rank before (the receive's wait added to `wait`).
    fn receive_input(
        &self,
        x: &Tensor,
        offset: i64,
        len: i64,
        tag: i32,
        wait: &mut Duration,
    ) -> anyhow::Result<Tensor> {
        if self.stage == 0 {
            return Ok(x.narrow(0, offset, len));
        }
        let mut h = self.buffer(len, &self.in_shape);
        timed(self.device, wait, || self.pg.recv(&mut h, self.prev(), tag))?;
        Ok(h)
    }

    fn buffer(&self, rows: i64, shape: &[i64]) -> Tensor {
        let shape: Vec<i64> = std::iter::once(rows).chain(shape.iter().copied()).collect();
        Tensor::zeros(shape.as_slice(), (Kind::Float, self.device))
    }
}

#[cfg(test)]
mod tests {
    use super::micro_sizes;

    #[test]
    fn micro_batches_cover_the_batch_and_differ_by_at_most_one_row() {
        assert_eq!(micro_sizes(64, 4), [16, 16, 16, 16]);
        assert_eq!(micro_sizes(18, 4), [5, 5, 4, 4]);
        assert_eq!(micro_sizes(3, 4), [1, 1, 1]);
        assert_eq!(micro_sizes(7, 1), [7]);
        for n in 1..40 {
            for m in 1..9 {
                let s = micro_sizes(n, m);
                assert_eq!(s.iter().sum::<i64>(), n);
                assert!(s.iter().all(|&k| k >= 1) && s.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1));
            }
        }
    }
}
