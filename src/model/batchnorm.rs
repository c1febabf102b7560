//! Batch normalisation whose batch statistics cover every rank (`wrap.sync_batchnorm`, torch's
//! `SyncBatchNorm`): each rank sums its rows' values and squares per channel, the sums are
//! all-reduced, and every rank normalises with the global mean and variance. The all-reduce is
//! differentiable ([`ProcessGroup::all_reduce_sum_autograd`]): the backward pass all-reduces the
//! statistics' gradients too, so DDP over W ranks of B rows equals one process over W·B rows.
//! Without a process group (or outside training) it is plain batch norm.
//!
//! A model kind with batch norm holds a [`SyncBatchNorm`] per layer and calls
//! [`SyncBatchNorm::forward`] with the group when `wrap.sync_batchnorm` is set.
use tch::{nn, Kind, Tensor};

use crate::dist::ProcessGroup;

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
        Ok((xf - mean) * invstd * w + b)
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
}
