//! What a strategy hands to a checkpoint and loads from one, and how the final model reaches
//! rank 0: the training state as pieces with global offsets (any strategy's checkpoint loads
//! under any other), and its size per rank.
use tch::{nn, Kind, Tensor};

use super::{buffers, bytes_of, load_whole, whole_state, ModelTensor, StateBytes, Strategy};
use crate::checkpoint::{Piece, Reader};
use crate::dist::ProcessGroup;
use crate::model::optim::Optimizer;
use crate::plan::Plan;

impl Strategy<'_> {
    /// This rank's share of the training state, as checkpoint pieces under PyTorch's names (every
    /// rank calls it): DDP's whole tensors from rank 0 alone (every rank holds the same); each
    /// stage of a pipeline its own layers (from its first copy); the optimizer's step count
    /// from rank 0.
    pub fn state_pieces(
        &self,
        plan: &Plan,
        pg: &ProcessGroup,
        vs: &nn::VarStore,
        optimizer: &Optimizer,
    ) -> anyhow::Result<Vec<Piece>> {
        let hands = match self {
            // Every tensor rank gathers its group's slices; rank 0 hands them.
            Strategy::Replica(r) if r.slices().is_some() => {
                let pieces = whole_state(plan, vs, optimizer, pg.rank() == 0, r.slices())?;
                return Ok(if pg.rank() == 0 { pieces } else { Vec::new() });
            }
            Strategy::Replica(_) => pg.rank() == 0,
            Strategy::Fsdp(f) => return f.state_pieces(&buffers(plan, vs), optimizer),
            // Each stage of the first copy (its first tensor rank, its slices gathered).
            Strategy::Pipeline(stage) if stage.slices().is_some() => {
                let pieces = whole_state(plan, vs, optimizer, pg.rank() == 0, stage.slices())?;
                let first = pg.rank() < plan.pipeline_ranks() && plan.mesh().coords(pg.rank()).tensor == 0;
                return Ok(if first { pieces } else { Vec::new() });
            }
            Strategy::Pipeline(_) => pg.rank() < plan.pipeline_ranks(),
        };
        Ok(if hands { whole_state(plan, vs, optimizer, pg.rank() == 0, None)? } else { Vec::new() })
    }

    /// Loads what this rank holds of the training state from a checkpoint written by any
    /// strategy at any world size: every rank of a replica the whole model, a pipeline's stage
    /// its layers, each with its optimizer state.
    pub fn load_state(
        &mut self,
        plan: &Plan,
        reader: &Reader,
        vs: &nn::VarStore,
        optimizer: &mut Optimizer,
    ) -> anyhow::Result<()> {
        match self {
            Strategy::Replica(r) => load_whole(plan, reader, vs, optimizer, r.slices()),
            Strategy::Pipeline(stage) => load_whole(plan, reader, vs, optimizer, stage.slices()),
            Strategy::Fsdp(f) => f.load_state(reader, &buffers(plan, vs), optimizer),
        }
    }

    /// The whole model's tensors as `model.safetensors` holds them (the same list on every rank).
    pub fn model_tensors(&self, plan: &Plan, vs: &nn::VarStore) -> Vec<ModelTensor> {
        match self {
            // Every rank knows them all (an FSDP rank's parameters keep their shapes, a tensor
            // rank knows the whole shapes of its slices).
            Strategy::Replica(_) | Strategy::Fsdp(_) => vs
                .variables()
                .into_iter()
                .map(|(name, t)| {
                    let shape = self.slices().map_or_else(|| t.size(), |tp| tp.whole_shape(&name, &t.size()));
                    ModelTensor { name, kind: t.kind(), shape }
                })
                .collect(),
            // The built-in models' variables are float32 (a TorchScript module is one layer, never cut).
            Strategy::Pipeline(_) => crate::model::sorted_parameters(plan.model().as_ref())
                .into_iter()
                .map(|(name, shape)| ModelTensor { name, kind: Kind::Float, shape })
                .collect(),
        }
    }

    /// `t` of the whole model on rank 0 (on the CPU; `None` on the other ranks). Every rank calls
    /// it for the same tensors in the same order: a pipeline's stage holding it sends it.
    pub fn gather_tensor(
        &self,
        pg: &ProcessGroup,
        vs: &nn::VarStore,
        t: &ModelTensor,
    ) -> anyhow::Result<Option<Tensor>> {
        let cpu = |name: &str| -> anyhow::Result<Tensor> {
            let v = vs.variables().remove(name).ok_or_else(|| anyhow::anyhow!("this rank holds no `{name}`"))?;
            Ok(v.detach().to_device(tch::Device::Cpu))
        };
        match self {
            Strategy::Replica(r) if r.slices().is_some() => {
                let whole = r.slices().expect("tensor parallel").whole(&t.name, &cpu(&t.name)?)?;
                Ok((pg.rank() == 0).then_some(whole))
            }
            Strategy::Replica(_) => (pg.rank() == 0).then(|| cpu(&t.name)).transpose(),
            Strategy::Fsdp(f) => f.gather_tensor(pg, t, cpu),
            Strategy::Pipeline(stage) => stage.gather_tensor(t, cpu),
        }
    }

    /// The tensors this rank holds whose values must stay finite, by name: the model's
    /// variables, or under FSDP the shards of its parameters and its buffers (the parameters
    /// themselves hold no memory between steps).
    pub fn held(&self, plan: &Plan, vs: &nn::VarStore) -> Vec<(String, Tensor)> {
        let mut held: Vec<(String, Tensor)> = match self {
            Strategy::Fsdp(f) => {
                let whole = f.replicated().iter().map(|(n, t)| (n.clone(), t.shallow_clone()));
                f.shards().into_iter().chain(whole).chain(buffers(plan, vs)).collect()
            }
            _ => vs.variables().into_iter().collect(),
        };
        held.sort_by(|a, b| a.0.cmp(&b.0));
        held
    }

    /// The model's variables and the optimizer's state as the ranks hold them together (every
    /// rank calls it): a replica's or a stage's own, whole; under FSDP all-gathered from the
    /// shards. The test hook that checks what a resumed run loaded reads it.
    pub fn loaded(
        &self,
        plan: &Plan,
        vs: &nn::VarStore,
        optimizer: &Optimizer,
    ) -> anyhow::Result<Vec<(String, Tensor)>> {
        if let Strategy::Fsdp(f) = self {
            return f.whole_state(&buffers(plan, vs), optimizer);
        }
        Ok(whole_state(plan, vs, optimizer, false, self.slices())?.into_iter().map(|p| (p.name, p.tensor)).collect())
    }

    /// What this rank holds of the training state now (see [`StateBytes`]); `reset` restarts
    /// FSDP's peaks from what is held now.
    pub fn state_bytes(&self, vs: &nn::VarStore, optimizer: &Optimizer, reset: bool) -> anyhow::Result<StateBytes> {
        let optimizer = bytes_of(optimizer.state().into_iter().map(|s| s.tensor));
        Ok(match self {
            Strategy::Fsdp(f) => {
                let s = f.sharded().stats(reset)?;
                let whole = || f.replicated().iter().map(|(_, t)| t.shallow_clone());
                StateBytes {
                    parameters: s.shard_bytes + s.peak_gathered_bytes + bytes_of(whole()),
                    gradients: s.shard_grad_bytes.max(s.peak_grad_bytes) + bytes_of(whole().map(|t| t.grad())),
                    optimizer,
                }
            }
            _ => {
                let params = vs.trainable_variables();
                StateBytes {
                    parameters: bytes_of(params.iter().map(Tensor::shallow_clone)),
                    gradients: bytes_of(params.iter().map(Tensor::grad)),
                    optimizer,
                }
            }
        })
    }
}
