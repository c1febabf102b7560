//! How the ranks share the work on one model, one module per `wrap.strategy`: [`replica`] (every
//! rank a whole replica, gradients averaged by DDP, or not at all), [`fsdp`] (every rank a shard
//! of each parameter, gathered layer by layer) and [`pipeline`] (the layers split across ranks).
//! Each owns its training step, its validation, which part of the training state it hands to a
//! checkpoint and loads from one (as pieces with global offsets: any strategy's checkpoint loads
//! under any other), and how the final model reaches rank 0. Batch split (seed 002) is DDP over
//! another shard layout (`data::shard`).
pub mod fsdp;
mod mesh;
pub mod pipeline;
pub mod replica;
mod state;
pub mod tensor;
pub mod threads;
mod whole;

use std::time::Duration;

use tch::nn::ModuleT;
use tch::{Kind, Tensor};

use crate::config::schema::WrapStrategy;
use crate::data::normalize::Normalizer;
use crate::data::{Dataset, Metrics};
use crate::dist::ProcessGroup;
use crate::model::optim::Optimizer;
use crate::plan::Plan;
use mesh::mesh_group;
pub use mesh::MeshGroups;
pub(super) use whole::broadcast_from_rank0;
pub use whole::ModelTensor;
use whole::{buffers, load_whole, whole_state};

/// Runs `f` (a forward pass) in the run's precision: bf16 autocasts it to bfloat16 (on CPU or CUDA).
pub fn in_precision<T>(precision: crate::config::schema::Precision, f: impl FnOnce() -> T) -> anyhow::Result<T> {
    match precision {
        crate::config::schema::Precision::Fp32 => Ok(f()),
        crate::config::schema::Precision::Bf16 => {
            let _guard = crate::dist::AutocastBf16::enter()?;
            Ok(f())
        }
        // Refused on the plan.
        crate::config::schema::Precision::Fp16 => anyhow::bail!("train.precision = \"fp16\" is not built"),
    }
}

/// A training batch's forward pass in `precision`, its output as float32 (what the loss and the
/// metrics read): the first part of every data-parallel strategy's step.
pub fn forward_float(
    precision: crate::config::schema::Precision,
    model: &dyn ModuleT,
    x: &Tensor,
) -> anyhow::Result<Tensor> {
    let out = in_precision(precision, || model.forward_t(x, true))?;
    Ok(if out.kind() == Kind::Float { out } else { out.to_kind(Kind::Float) })
}

/// The per-sample losses of `out` and their mean times `scale` (the batch's share of an
/// accumulated step's mean loss), the tensor the backward pass starts from.
pub fn scaled_loss(task: crate::data::Task, out: &Tensor, y: &Tensor, scale: f64) -> (Tensor, Tensor) {
    let per_sample = task.per_sample_loss(out, y);
    let loss = per_sample.mean(Kind::Float);
    let loss = if scale == 1.0 { loss } else { loss * scale };
    (per_sample, loss)
}

/// Averages `params`' gradients over `group`: one all-reduce of them all, flattened in the
/// parameters' fixed order.
fn average_gradients(group: &ProcessGroup, params: &[Tensor]) -> anyhow::Result<()> {
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).collect();
    let mut flat = Tensor::cat(&grads.iter().map(|g| g.view([-1])).collect::<Vec<_>>(), 0);
    group.all_reduce(&mut flat, crate::dist::ReduceOp::Avg)?;
    let mut offset = 0;
    for mut g in grads {
        let n = g.numel() as i64;
        tch::no_grad(|| g.copy_(&flat.narrow(0, offset, n).view_as(&g)));
        offset += n;
    }
    Ok(())
}

/// The ranks over which a gradient norm is summed ([`Strategy::norm_group`]).
pub struct NormGroup<'a> {
    pub pg: &'a ProcessGroup,
    /// Copies of the model the ranks hold together: the sum of squares is divided by it.
    pub copies: usize,
    /// Per parameter, the share of its square that counts: 1 / tensor for the parameters every
    /// rank of a tensor group holds whole (its replicated norms and embeddings), counted once,
    /// not once per tensor rank. Empty: 1 for every one.
    pub weights: Vec<f64>,
}

/// What one training step measured on this rank.
#[derive(Default)]
pub struct StepOut {
    /// Each sample's loss, and 1.0 where its prediction was right: on the ranks that compute the
    /// loss (every rank of a replica, the last rank of a pipeline).
    pub per_sample: Option<Tensor>,
    pub correct: Option<Tensor>,
    /// The phases' times, as the device ran them ([`crate::device::clock`]).
    pub forward: crate::device::Span,
    pub loss: crate::device::Span,
    pub backward: crate::device::Span,
    /// Gradient communication, where it was measured: DDP's all-reduce as the Reducer timed it
    /// (on the steps it samples), or the averaging of a pipeline stage's gradients over its copies.
    pub comm: Option<Duration>,
    /// The part of `comm` that overlapped with the backward pass (DDP).
    pub overlap: Duration,
    /// A pipeline rank's time inside send and recv: waiting for a neighbour, and the transfers.
    pub wait: Duration,
}

/// One batch's place in its optimizer step (gradient accumulation).
#[derive(Debug, Clone, Copy)]
pub struct Micro {
    /// The batch's share of the step's mean loss (1 without accumulation).
    pub scale: f64,
    /// The step's last batch: average the gradients across ranks now.
    pub sync: bool,
}

impl Default for Micro {
    fn default() -> Self {
        Micro { scale: 1.0, sync: true }
    }
}

pub enum Strategy<'pg> {
    Replica(replica::Replica<'pg>),
    Fsdp(fsdp::Fsdp<'pg>),
    Pipeline(pipeline::Stage<'pg>),
}

/// Bytes one rank has sent in its group of each mesh dimension ([`Strategy::sent`]): the data
/// and tensor groups' collectives, and the pipeline's sends between stages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeshBytes {
    pub data: u64,
    pub tensor: u64,
    pub pipeline: u64,
}

impl MeshBytes {
    fn of(data: Option<&ProcessGroup>, tensor: Option<&ProcessGroup>, pipeline: Option<&ProcessGroup>) -> MeshBytes {
        MeshBytes {
            data: data.map_or(0, |g| g.sent().collective),
            tensor: tensor.map_or(0, |g| g.sent().collective),
            pipeline: pipeline.map_or(0, |g| g.sent().point_to_point),
        }
    }
}

impl std::ops::Add for MeshBytes {
    type Output = MeshBytes;
    fn add(self, other: MeshBytes) -> MeshBytes {
        MeshBytes {
            data: self.data + other.data,
            tensor: self.tensor + other.tensor,
            pipeline: self.pipeline + other.pipeline,
        }
    }
}

impl std::ops::Sub for MeshBytes {
    type Output = MeshBytes;
    fn sub(self, before: MeshBytes) -> MeshBytes {
        MeshBytes {
            data: self.data - before.data,
            tensor: self.tensor - before.tensor,
            pipeline: self.pipeline - before.pipeline,
        }
    }
}

/// Bytes of the training state one rank holds: its parameters, their gradients and the
/// optimizer's state (the trace's memory columns). Under FSDP, the parameters count its shards
/// and the most gathered at once, the gradients the most held at once (its shards', the
/// reduce-scatter buffers, a whole gradient being copied in), since the counters were last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StateBytes {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
}

fn bytes_of(ts: impl IntoIterator<Item = Tensor>) -> u64 {
    ts.into_iter().filter(Tensor::defined).map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum()
}

impl<'pg> Strategy<'pg> {
    /// This rank's part of the strategy, over `params` (this rank's, in module order). `buckets`:
    /// the DDP bucket layout a checkpoint recorded. `groups`: the mesh's. `ctx`: what the model was
    /// built with (the group its batch norm layers synchronise over, its tensor group). `threads`: more
    /// replicas on this rank's threads (`wrap.threads_per_replica`). Every rank must call this at
    /// the same point.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        plan: &Plan,
        pg: &'pg ProcessGroup,
        groups: &'pg MeshGroups,
        device: tch::Device,
        params: &[Tensor],
        buffers: &[Tensor],
        buckets: Option<&[Vec<usize>]>,
        ctx: &crate::model::BuildContext<'pg>,
        threads: Option<threads::ThreadReplicas>,
    ) -> anyhow::Result<Strategy<'pg>> {
        Ok(match plan.config.wrap.strategy {
            WrapStrategy::Ddp | WrapStrategy::None => Strategy::Replica(replica::Replica::new(
                plan,
                groups.data(pg),
                device,
                params,
                buffers,
                buckets,
                ctx,
                threads,
            )?),
            WrapStrategy::Pipeline => Strategy::Pipeline(pipeline::Stage::new(plan, pg, device, ctx.tensor.clone())?),
            // The wrap stage builds a sharded model layer by layer (stages::wrap), and the plan
            // resolves "auto" to a strategy before any rank starts.
            WrapStrategy::Fsdp | WrapStrategy::Auto => {
                anyhow::bail!("wrap.strategy = {:?} is not a replica or pipeline strategy", plan.config.wrap.strategy)
            }
        })
    }

    /// Forward, loss and backward of one batch, adding its gradients (its loss scaled by
    /// `micro.scale`) to this rank's; on the optimizer step's last batch (`micro.sync`) they are
    /// averaged where the strategy averages them, ready for the optimizer.
    pub fn step(
        &mut self,
        model: &dyn ModuleT,
        optimizer: &mut Optimizer,
        x: &Tensor,
        y: &Tensor,
        timer: crate::device::StepClock,
        micro: Micro,
    ) -> anyhow::Result<StepOut> {
        match self {
            Strategy::Replica(r) => r.step(model, optimizer, x, y, timer, micro),
            Strategy::Fsdp(f) => f.step(model, x, y, timer, micro),
            Strategy::Pipeline(stage) => {
                let mut out = stage.train_step(model, x, y, y.size()[0], micro.scale)?;
                if micro.sync {
                    out.comm = Some(stage.average_gradients(optimizer.params())?);
                }
                Ok(out)
            }
        }
    }

    /// The ranks whose gradients make up the model's global norm with this rank's (`world`'s
    /// ranks, or a tensor group), and how many copies of it they hold: a pipeline's stages, an
    /// FSDP rank's shards, a tensor rank's slices (`None` for a replica, which holds them all).
    /// `names`: the optimizer's parameters.
    pub fn norm_group<'a>(&'a self, world: &'a ProcessGroup, names: &[String]) -> Option<NormGroup<'a>> {
        let weights = |tp: &tensor::Slices| {
            let share = 1.0 / tp.group().size() as f64;
            names.iter().map(|n| if tp.is_split(n) { 1.0 } else { share }).collect()
        };
        match self {
            Strategy::Replica(r) => r.slices().map(|tp| NormGroup { pg: tp.group(), copies: 1, weights: weights(tp) }),
            // Each rank holds other rows of every gradient: their squares add up, once each; every
            // rank holds the whole gradient of a replicated parameter (a LoRA run's adapters,
            // never under tensor parallelism): counted once, not once per rank.
            Strategy::Fsdp(f) if !f.replicated().is_empty() => {
                let share = 1.0 / world.size() as f64;
                let replicated = |n: &String| f.replicated().iter().any(|(r, _)| r == n);
                let weights = names.iter().map(|n| if replicated(n) { share } else { 1.0 }).collect();
                Some(NormGroup { pg: world, copies: 1, weights })
            }
            Strategy::Fsdp(f) => {
                Some(NormGroup { pg: world, copies: 1, weights: f.slices().map(weights).unwrap_or_default() })
            }
            Strategy::Pipeline(stage) => Some(NormGroup {
                pg: world,
                copies: stage.copies(),
                weights: stage.slices().map(weights).unwrap_or_default(),
            }),
        }
    }

    /// What this rank has sent so far along each mesh dimension (every call the strategy's
    /// groups carried, whoever made it): read around a training step, the difference is what
    /// the step sent. A pipeline's stages exchange activations over the job's group, point to
    /// point; its collectives there (the metrics, clipping's norm) belong to no one dimension.
    pub fn sent(&self) -> MeshBytes {
        let tensor = self.slices().map(|s| s.group().as_ref());
        match self {
            Strategy::Replica(r) => MeshBytes::of(Some(r.group()), tensor, None),
            Strategy::Fsdp(f) => MeshBytes::of(Some(f.group()), tensor, None),
            Strategy::Pipeline(stage) => MeshBytes::of(stage.copies_group(), tensor, Some(stage.group())),
        }
    }

    /// Under tensor parallelism, what each rank of the tensor group holds of each parameter.
    fn slices(&self) -> Option<&tensor::Slices> {
        match self {
            Strategy::Replica(r) => r.slices(),
            Strategy::Fsdp(f) => f.slices(),
            Strategy::Pipeline(stage) => stage.slices(),
        }
    }

    /// Validation loss and accuracy where this rank measures them (`None` elsewhere).
    pub fn validate(
        &self,
        plan: &Plan,
        model: &dyn ModuleT,
        data: &Dataset,
        normalizer: &Normalizer,
    ) -> anyhow::Result<Option<Metrics>> {
        if data.val_x.size()[0] == 0 {
            return Ok(None);
        }
        match self {
            Strategy::Replica(r) => r.validate(plan, model, data, normalizer),
            Strategy::Fsdp(f) => f.validate(plan, model, data, normalizer),
            Strategy::Pipeline(stage) => stage.validate(plan, model, data, normalizer),
        }
    }

    /// Ranks per copy of a pipeline (their losses are measured on each copy's last rank).
    pub fn pipeline_ranks(&self, plan: &Plan) -> Option<usize> {
        matches!(self, Strategy::Pipeline(_)).then(|| plan.pipeline_ranks())
    }

    /// DDP's bucket layout now, for a checkpoint.
    pub fn bucket_layout(&self) -> anyhow::Result<Option<Vec<Vec<usize>>>> {
        match self {
            Strategy::Replica(r) => r.bucket_layout(),
            Strategy::Fsdp(_) | Strategy::Pipeline(_) => Ok(None),
        }
    }
}
