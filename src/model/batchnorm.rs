//! Batch normalisation whose batch statistics cover every rank (`wrap.sync_batchnorm`, torch's
//! `SyncBatchNorm`): each rank sums its rows' values and squares per channel, the sums are
//! all-reduced, and every rank normalises with the global mean and variance. The all-reduce is
//! differentiable ([`ProcessGroup::all_reduce_sum_autograd`]): the backward pass all-reduces the
//! statistics' gradients too, so DDP over W ranks of B rows equals one process over W·B rows.
//! Without a process group (or outside training) it is plain batch norm.
//!
//! A model kind with batch norm holds a [`SyncBatchNorm`] per layer and calls
//! [`SyncBatchNorm::forward_t`] with the [`StatsGroup`] its build context carries
//! ([`crate::model::BuildContext`]): the data-parallel group when `wrap.sync_batchnorm` is set
//! under DDP over more than one rank, none otherwise (libtorch's own `batch_norm` then).
use std::sync::{Arc, Mutex};

use tch::{nn, Kind, Tensor};

use crate::dist::ProcessGroup;

/// The ranks whose batch statistics a model's batch norm layers combine in training, shared by
/// the layers of one model and by the training step that runs it. `ModuleT::forward_t` cannot
/// return an error, so a collective that fails in a forward pass is kept here: the layers after
/// it normalise with their own rank's statistics (no further collective, no further timeout),
/// and the step reports the failure as soon as the forward pass returns ([`StatsGroup::failure`]).
pub struct StatsGroup<'pg> {
    pg: &'pg ProcessGroup,
    failure: Mutex<Option<crate::dist::Error>>,
}

impl<'pg> StatsGroup<'pg> {
    pub fn new(pg: &'pg ProcessGroup) -> Arc<StatsGroup<'pg>> {
        Arc::new(StatsGroup { pg, failure: Mutex::new(None) })
    }

    pub fn size(&self) -> usize {
        self.pg.size()
    }

    /// The failed collective of a forward pass, taken (none when every one succeeded).
    pub fn failure(&self) -> Option<crate::dist::Error> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn failed(&self) -> bool {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn fail(&self, e: crate::dist::Error) {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
    }
}

impl std::fmt::Debug for StatsGroup<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StatsGroup(rank {} of {})", self.pg.rank(), self.pg.size())
    }
}

/// One batch norm layer's parameters and running statistics, as `torch.nn.BatchNorm{1,2}d` holds
/// them (`weight`, `bias`, `running_mean`, `running_var`).
#[derive(Debug)]
pub struct SyncBatchNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    pub running_mean: Tensor,
    pub running_var: Tensor,
    pub momentum: f64,
    pub eps: f64,
}

impl SyncBatchNorm {
    /// `channels` features, under `p` (torch's initial values: weight 1, bias 0, mean 0, var 1).
    pub fn new(p: &nn::Path, channels: i64) -> SyncBatchNorm {
        SyncBatchNorm {
            weight: p.ones("weight", &[channels]),
            bias: p.zeros("bias", &[channels]),
            running_mean: p.zeros_no_train("running_mean", &[channels]),
            running_var: p.ones_no_train("running_var", &[channels]),
            momentum: 0.1,
            eps: 1e-5,
        }
    }

    /// `x`: [N, C] or [N, C, ...]. In training with a `group` of more than one rank, normalised
    /// with the statistics of every rank's batch ([`SyncBatchNorm::forward`]); otherwise
    /// libtorch's `batch_norm` (this rank's batch in training, the running statistics outside
    /// it), to the bit what a model without `wrap.sync_batchnorm` computes.
    pub fn forward_t(&self, x: &Tensor, train: bool, group: Option<&StatsGroup>) -> Tensor {
        if let Some(g) = group.filter(|g| train && g.size() > 1 && !g.failed()) {
            match self.forward(x, true, Some(g.pg)) {
                Ok(y) => return y,
                Err(e) => g.fail(e),
            }
        }
        Tensor::batch_norm(
            x,
            Some(&self.weight),
            Some(&self.bias),
            Some(&self.running_mean),
            Some(&self.running_var),
            train,
            self.momentum,
            self.eps,
            false,
        )
    }

    /// `x`: [N, C] or [N, C, ...]. In training, normalised with the batch statistics of every
    /// rank of `group` (this rank's alone without one), and the running statistics updated with
    /// them; otherwise with the running statistics.
    pub fn forward(&self, x: &Tensor, train: bool, group: Option<&ProcessGroup>) -> crate::dist::Result<Tensor> {
        let c = x.size()[1];
        let mut shape = vec![1i64; x.dim()];
        shape[1] = c;
        let (w, b) = (self.weight.view(shape.as_slice()), self.bias.view(shape.as_slice()));
        if !train {
            let mean = self.running_mean.view(shape.as_slice());
            let var = self.running_var.view(shape.as_slice());
            return Ok((x - mean) / (var + self.eps).sqrt() * w + b);
        }
        // Per channel: the sum of the values, of their squares, and the count, over the rows and
        // any spatial positions.
        let dims: Vec<i64> = (0..x.dim() as i64).filter(|&d| d != 1).collect();
        let n_local = (x.numel() as i64 / c) as f64;
        let xf = x.to_kind(Kind::Float);
        let sum = xf.sum_dim_intlist(dims.as_slice(), false, Kind::Float);
        let sq = (&xf * &xf).sum_dim_intlist(dims.as_slice(), false, Kind::Float);
        let count = Tensor::full([c], n_local, (Kind::Float, x.device()));
        let local = Tensor::stack(&[sum, sq, count], 0);
        let total = match group {
            Some(pg) if pg.size() > 1 => pg.all_reduce_sum_autograd(&local)?,
            _ => local,
        };
        let n = total.get(2);
        let mean = total.get(0) / &n;
        // Biased variance normalises; the running variance takes the unbiased one, as torch's.
        let var = total.get(1) / &n - &mean * &mean;
        tch::no_grad(|| {
            let m = self.momentum;
            let unbiased = &var * &n / (&n - 1.0).clamp_min(1.0);
            let _ = self.running_mean.shallow_clone().g_mul_scalar_(1.0 - m).g_add_(&(mean.detach() * m));
            let _ = self.running_var.shallow_clone().g_mul_scalar_(1.0 - m).g_add_(&(unbiased.detach() * m));
        });
        let mean = mean.view(shape.as_slice());
        let invstd = (var.view(shape.as_slice()) + self.eps).rsqrt();
        // In the input's precision, as torch's (a bf16 activation under autocast stays bf16).
        Ok(((xf - mean) * invstd * w + b).to_kind(x.kind()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a group, it is torch's batch norm: same output, same running statistics.
    #[test]
    fn matches_torch_batch_norm_on_one_rank() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let ours = SyncBatchNorm::new(&vs.root().sub("ours"), 3);
        let config =
            nn::BatchNormConfig { ws_init: nn::Init::Const(1.0), bs_init: nn::Init::Const(0.0), ..Default::default() };
        let theirs = nn::batch_norm1d(vs.root().sub("theirs"), 3, config);
        let x = Tensor::arange(24, (Kind::Float, tch::Device::Cpu)).view([8, 3]).sin() * 3.0;
        let a = ours.forward(&x, true, None).unwrap();
        let b = nn::ModuleT::forward_t(&theirs, &x, true);
        assert!((&a - &b).abs().max().double_value(&[]) < 1e-5);
        let rv = (&ours.running_var - &theirs.running_var).abs().max().double_value(&[]);
        let rm = (&ours.running_mean - &theirs.running_mean).abs().max().double_value(&[]);
        assert!(rv < 1e-5 && rm < 1e-6, "running statistics differ: {rm} {rv}");
        let e = ours.forward(&x, false, None).unwrap();
        let f = nn::ModuleT::forward_t(&theirs, &x, false);
        assert!((&e - &f).abs().max().double_value(&[]) < 1e-5);
    }

    /// Without a group of several ranks, `forward_t` is libtorch's batch_norm itself: the same
    /// bits, in training and out, and the same running statistics.
    #[test]
    fn forward_t_without_a_group_is_libtorch_batch_norm_to_the_bit() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let ours = SyncBatchNorm::new(&vs.root().sub("ours"), 3);
        let theirs = SyncBatchNorm::new(&vs.root().sub("theirs"), 3);
        let x = Tensor::arange(48, (Kind::Float, tch::Device::Cpu)).view([4, 3, 2, 2]).sin() * 3.0;
        for train in [true, false] {
            let a = ours.forward_t(&x, train, None);
            let b = Tensor::batch_norm(
                &x,
                Some(&theirs.weight),
                Some(&theirs.bias),
                Some(&theirs.running_mean),
                Some(&theirs.running_var),
                train,
                0.1,
                1e-5,
                false,
            );
            assert!(a.equal(&b), "train = {train}");
        }
        assert!(ours.running_mean.equal(&theirs.running_mean) && ours.running_var.equal(&theirs.running_var));
    }
}
