//! Tensor parallelism's share of the training state (`wrap.mesh.tensor` > 1): each rank of a
//! tensor group holds its slices of the split parameters ([`crate::model::TensorSlice`], cut by
//! the model kind) and their optimizer state, and the replicated ones whole. A checkpoint and
//! `model.safetensors` hold whole tensors, gathered over the group ([`Slices::whole`]), so one
//! checkpoint loads under any mesh: every rank cuts its slice of what it reads
//! ([`Slices::local`]).
use std::collections::HashMap;

use tch::Tensor;

use std::sync::Arc;

use crate::dist::ProcessGroup;
use crate::model::{Architecture, TensorSlice};

pub struct Slices {
    group: Arc<ProcessGroup>,
    /// Each split parameter's slice on every rank of the group, by name.
    slices: HashMap<String, Vec<TensorSlice>>,
    /// The whole shapes of the split parameters.
    shapes: HashMap<String, Vec<i64>>,
}

impl Slices {
    pub fn new(arch: &dyn Architecture, group: Arc<ProcessGroup>) -> Slices {
        let n = group.size();
        let (mut slices, mut shapes) = (HashMap::new(), HashMap::new());
        for (name, shape) in arch.parameters(0..arch.layers().len()) {
            if let Some(first) = arch.tensor_slice(&name, 0, n) {
                let rest = (1..n).map(|k| arch.tensor_slice(&name, k, n).expect("every rank holds a slice"));
                slices.insert(name.clone(), std::iter::once(first).chain(rest).collect());
                shapes.insert(name, shape);
            }
        }
        Slices { group, slices, shapes }
    }

    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// The whole shape of `name` (parameter `param`'s tensor, or its optimizer state), given
    /// this rank's `local` one.
    pub fn whole_shape(&self, param: &str, local: &[i64]) -> Vec<i64> {
        self.shapes.get(param).cloned().unwrap_or_else(|| local.to_vec())
    }

    /// The whole of parameter `param`'s tensor (itself, or its optimizer state) from this rank's
    /// `local` slice: all-gathered over the group (every rank of it calls this for the same
    /// tensors in the same order). A replicated parameter is `local` itself.
    pub fn whole(&self, param: &str, local: &Tensor) -> crate::dist::Result<Tensor> {
        let Some(slices) = self.slices.get(param) else { return Ok(local.shallow_clone()) };
        let parts = self.group.all_gather(&local.detach().contiguous())?;
        let whole = Tensor::zeros(self.shapes[param].as_slice(), (local.kind(), local.device()));
        tch::no_grad(|| slices.iter().zip(&parts).for_each(|(s, part)| s.put(&whole, part)));
        Ok(whole)
    }

    /// This rank's slice of parameter `param`'s `whole` tensor (a replicated one: all of it).
    pub fn local(&self, param: &str, whole: &Tensor) -> Tensor {
        match self.slices.get(param) {
            Some(slices) => slices[self.group.rank()].cut(whole),
            None => whole.shallow_clone(),
        }
    }

    /// This rank's slice of parameter `param` (`None`: replicated, whole).
    pub fn mine(&self, param: &str) -> Option<&TensorSlice> {
        self.slices.get(param).map(|s| &s[self.group.rank()])
    }

    /// Whether `param` is split (its gradient's square counts once per slice in a global norm).
    pub fn is_split(&self, param: &str) -> bool {
        self.slices.contains_key(param)
    }
}
