//! The mesh's tensor group as a model's layers see it (`wrap.mesh.tensor` > 1): Megatron's two
//! operators around each split pair of layers, the input copied into the group before a
//! column-parallel layer ([`TensorGroup::enter`]) and the partial outputs of a row-parallel one
//! summed out of it ([`TensorGroup::leave`]), each an autograd function whose backward pass does
//! the other's collective. `ModuleT::forward_t` cannot return an error, so a collective that fails
//! in a forward pass is kept here, as batch norm's statistics group keeps its own: the layers
//! after it run on what this rank has (no further collective, no further timeout), and the step
//! reports the failure as soon as the forward pass returns ([`TensorGroup::failure`]).
//!
//! Under sequence parallelism (`wrap.mesh.sequence_parallel`, Megatron-SP as torchtitan builds
//! it) the activations between the column/row pairs are split along the sequence over the
//! group: `enter` all-gathers them (its backward pass reduce-scatters), `leave` reduce-scatters
//! the partial outputs (its backward pass all-gathers), and what runs between (the norms, the
//! residual dropout) runs on this rank's part of the sequence.
use std::sync::{Arc, Mutex};

use tch::Tensor;

use crate::dist::ProcessGroup;

pub struct TensorGroup {
    pg: Arc<ProcessGroup>,
    /// Whether the activations outside the split layers are split along the sequence (dim 1).
    sequence: bool,
    failure: Mutex<Option<crate::dist::Error>>,
}

impl TensorGroup {
    /// `sequence`: sequence parallelism (`wrap.mesh.sequence_parallel`).
    pub fn new(pg: Arc<ProcessGroup>, sequence: bool) -> Arc<TensorGroup> {
        Arc::new(TensorGroup { pg, sequence, failure: Mutex::new(None) })
    }

    /// Whether the activations between the split layers are split along the sequence.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    pub fn size(&self) -> usize {
        self.pg.size()
    }

    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// The failed collective of a forward pass, taken (none when every one succeeded).
    pub fn failure(&self) -> Option<crate::dist::Error> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// `x` as the input of a column-parallel layer, its gradient summed over the group in the
    /// backward pass: `x` itself (the same on every rank of the group), or under sequence
    /// parallelism the ranks' parts of the sequence gathered (the gradient reduce-scattered).
    pub fn enter(&self, x: &Tensor) -> Tensor {
        if !self.sequence {
            return self.collective(x, x.size(), |t| self.pg.copy_to_ranks_autograd(t));
        }
        self.collective(x, self.whole_sequence(x), |t| self.pg.gather_autograd(t, 1, true))
    }

    /// The sum of the ranks' partial outputs of a row-parallel layer; under sequence parallelism,
    /// this rank's part of the sequence of it (reduce-scattered).
    pub fn leave(&self, partial: &Tensor) -> Tensor {
        if !self.sequence {
            return self.collective(partial, partial.size(), |t| self.pg.sum_from_ranks_autograd(t));
        }
        let mut part = partial.size();
        part[1] /= self.size() as i64;
        self.collective(partial, part, |t| self.pg.scatter_sum_autograd(t, 1))
    }

    /// This rank's part of the sequence (dim 1) of `x`, the same on every rank of the group (the
    /// embeddings): no collective; the gradient outside the part is zero.
    pub fn shard(&self, x: &Tensor) -> Tensor {
        let part = x.size()[1] / self.size() as i64;
        x.narrow(1, part * self.rank() as i64, part)
    }

    /// Every rank's part of the sequence of `x` gathered (the logits), for a loss every rank
    /// computes whole: each keeps its part of the gradient.
    pub fn unshard(&self, x: &Tensor) -> Tensor {
        self.collective(x, self.whole_sequence(x), |t| self.pg.gather_autograd(t, 1, false))
    }

    /// A parameter every rank holds whole, as the forward pass uses it on this rank's part of the
    /// sequence: its gradient, a partial sum over that part, is summed over the group in the
    /// backward pass (as DTensor does for a replicated parameter of sequence-sharded inputs), so
    /// every rank steps it alike. Without sequence parallelism every rank's gradient is whole.
    pub fn replicated(&self, w: &Tensor) -> Tensor {
        if !self.sequence || !w.requires_grad() {
            return w.shallow_clone();
        }
        self.collective(w, w.size(), |t| self.pg.copy_to_ranks_autograd(t))
    }

    /// The shape of the whole sequence (dim 1) of which `x` is one rank's part.
    fn whole_sequence(&self, x: &Tensor) -> Vec<i64> {
        let mut shape = x.size();
        shape[1] *= self.size() as i64;
        shape
    }

    /// Dropout of this rank's part of an activation split along `dim` (its `rank`-th of `size`
    /// equal parts): the mask is drawn for the whole activation, as one process draws it
    /// (libtorch's CPU dropout: `bernoulli_(1 - p)` of its shape, scaled by 1 / (1 - p)), and
    /// this rank's part kept. The ranks of a group draw from the same generator state, so together
    /// they drop what one process drops, and every later draw lines up with its.
    pub fn dropout(&self, x: &Tensor, p: f64, dim: i64, train: bool) -> Tensor {
        if !train || p == 0.0 {
            return x.shallow_clone();
        }
        let mut shape = x.size();
        let part = shape[dim as usize];
        shape[dim as usize] = part * self.size() as i64;
        let noise = Tensor::empty(shape.as_slice(), (x.kind(), x.device())).bernoulli_float_(1.0 - p);
        let noise = noise.narrow(dim, part * self.rank() as i64, part) / (1.0 - p);
        x * noise
    }

    /// `op(t)`, whose result has `shape`; after a failed collective (this one or an earlier one
    /// of the pass), zeros of that shape, so the layers after it run on to the end of the pass.
    fn collective(
        &self,
        t: &Tensor,
        shape: Vec<i64>,
        op: impl FnOnce(&Tensor) -> crate::dist::Result<Tensor>,
    ) -> Tensor {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        let stand_in = || match shape == t.size() {
            true => t.shallow_clone(),
            false => Tensor::zeros(shape.as_slice(), (t.kind(), t.device())),
        };
        if failure.is_some() {
            return stand_in();
        }
        match op(t) {
            Ok(out) => out,
            Err(e) => {
                *failure = Some(self.pg.explain(e));
                stand_in()
            }
        }
    }
}

impl std::fmt::Debug for TensorGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorGroup(rank {} of {})", self.pg.rank(), self.pg.size())
    }
}
