//! The mesh's tensor group as a model's layers see it (`wrap.mesh.tensor` > 1): Megatron's two
//! operators around each split pair of layers, the input copied into the group before a
//! column-parallel layer ([`TensorGroup::enter`]) and the partial outputs of a row-parallel one
//! summed out of it ([`TensorGroup::leave`]), each an autograd function whose backward pass does
//! the other's collective. `ModuleT::forward_t` cannot return an error, so a collective that fails
//! in a forward pass is kept here, as batch norm's statistics group keeps its own: the layers
//! after it run on what this rank has (no further collective, no further timeout), and the step
//! reports the failure as soon as the forward pass returns ([`TensorGroup::failure`]).
use std::sync::{Arc, Mutex};

use tch::Tensor;

use crate::dist::ProcessGroup;

pub struct TensorGroup<'pg> {
    pg: &'pg ProcessGroup,
    failure: Mutex<Option<crate::dist::Error>>,
}

impl<'pg> TensorGroup<'pg> {
    pub fn new(pg: &'pg ProcessGroup) -> Arc<TensorGroup<'pg>> {
        Arc::new(TensorGroup { pg, failure: Mutex::new(None) })
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    pub fn size(&self) -> usize {
        self.pg.size()
    }

    pub fn group(&self) -> &'pg ProcessGroup {
        self.pg
    }

    /// The failed collective of a forward pass, taken (none when every one succeeded).
    pub fn failure(&self) -> Option<crate::dist::Error> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// `x` (the same on every rank of the group) as the input of a column-parallel layer: its
    /// gradient is summed over the group in the backward pass.
    pub fn enter(&self, x: &Tensor) -> Tensor {
        self.collective(x, |t| self.pg.copy_to_ranks_autograd(t))
    }

    /// The sum of the ranks' partial outputs of a row-parallel layer.
    pub fn leave(&self, partial: &Tensor) -> Tensor {
        self.collective(partial, |t| self.pg.sum_from_ranks_autograd(t))
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

    fn collective(&self, t: &Tensor, op: impl FnOnce(&Tensor) -> crate::dist::Result<Tensor>) -> Tensor {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if failure.is_some() {
            return t.shallow_clone();
        }
        match op(t) {
            Ok(out) => out,
            Err(e) => {
                *failure = Some(self.pg.explain(e));
                t.shallow_clone()
            }
        }
    }
}

impl std::fmt::Debug for TensorGroup<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorGroup(rank {} of {})", self.pg.rank(), self.pg.size())
    }
}
