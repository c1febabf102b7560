//! Optimizers with state we own (torch's formulas for SGD with momentum, Adam and AdamW), so a
//! checkpoint can save and restore it exactly: tch's optimizers do not expose their state. The
//! state is named by parameter, not by position (`optim.momentum.<param>`, `optim.exp_avg.<param>`,
//! `optim.exp_avg_sq.<param>`, and the step count `optim.steps`), so any strategy holding any
//! part of any parameter finds its own: a checkpoint resumes under another strategy.
use tch::{Kind, Tensor};

use crate::config::schema::{Optimizer as Kind_, Train, WeightDecayOn};
use crate::dist;

pub struct Optimizer {
    kind: Kind_,
    lr: f64,
    momentum: f64,
    betas: [f64; 2],
    eps: f64,
    weight_decay: f64,
    /// Adam / AdamW in one fused kernel, or in multi-tensor `_foreach_` passes (`train.fused`).
    fused: bool,
    params: Vec<Tensor>,
    /// The parameters' names (PyTorch's), in the order of `params`.
    names: Vec<String>,
    /// Per parameter, whether weight decay applies to it (`train.weight_decay_on`).
    decays: Vec<bool>,
    /// Per kind of state (named in `kinds`), one tensor per parameter: SGD's momentum buffers, or
    /// Adam's first and second moments.
    kinds: &'static [&'static str],
    state: Vec<Vec<Tensor>>,
    steps: i64,
}

/// The name of the step count in a checkpoint.
pub const STEPS: &str = "optim.steps";

/// The kinds of state the optimizer of `t` keeps per parameter (`optim.<kind>.<param>`).
pub fn state_kinds(t: &Train) -> &'static [&'static str] {
    match t.optimizer {
        Kind_::Sgd if t.momentum == 0.0 => &[],
        Kind_::Sgd => &["momentum"],
        Kind_::Adam | Kind_::Adamw => &["exp_avg", "exp_avg_sq"],
    }
}

/// One tensor of an optimizer's state: its name in a checkpoint, its parameter's name, and the
/// tensor (shaped as the parameter it updates, whole or a shard).
pub struct StateTensor {
    pub name: String,
    pub param: String,
    pub tensor: Tensor,
}

impl Optimizer {
    /// Over `params`, each with its name (PyTorch's: `layer0.weight`).
    pub fn new(t: &Train, params: Vec<(String, Tensor)>) -> Optimizer {
        let (names, params): (Vec<String>, Vec<Tensor>) = params.into_iter().unzip();
        let kinds = state_kinds(t);
        let state = kinds.iter().map(|_| params.iter().map(Tensor::zeros_like).collect()).collect();
        let decays = params
            .iter()
            .map(|p| match t.weight_decay_on {
                WeightDecayOn::All => true,
                WeightDecayOn::Matrices => p.dim() >= 2,
            })
            .collect();
        Optimizer {
            kind: t.optimizer,
            lr: t.lr,
            momentum: t.momentum,
            betas: t.betas,
            eps: t.eps,
            weight_decay: t.weight_decay,
            fused: t.fused.unwrap_or(true),
            params,
            names,
            decays,
            kinds,
            state,
            steps: 0,
        }
    }

    /// Steps taken so far (restored from a checkpoint): the learning-rate schedule's clock.
    pub fn steps(&self) -> usize {
        self.steps as usize
    }

    /// The learning rate of the next steps (the schedule sets it before each).
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// The parameters it updates, in its order.
    /// The parameters' names, in [`Optimizer::params`]' order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// Drops the gradients, as torch's `zero_grad()` does by default (set to none).
    pub fn zero_grad(&mut self) -> dist::Result<()> {
        dist::clear_grads(&self.params)
    }

    pub fn step(&mut self) -> dist::Result<()> {
        self.steps += 1;
        if self.decays.iter().all(|&d| d) || self.weight_decay == 0.0 {
            let all: Vec<usize> = (0..self.params.len()).collect();
            return self.step_group(&all, self.weight_decay);
        }
        // Two groups, as torch's param_groups: with and without weight decay.
        let (decayed, plain): (Vec<usize>, Vec<usize>) = (0..self.params.len()).partition(|&i| self.decays[i]);
        self.step_group(&decayed, self.weight_decay)?;
        self.step_group(&plain, 0.0)
    }

    /// One step over the parameters at `indices`, with their own weight decay.
    fn step_group(&self, indices: &[usize], weight_decay: f64) -> dist::Result<()> {
        let pick = |ts: &[Tensor]| -> Vec<Tensor> { indices.iter().map(|&i| ts[i].shallow_clone()).collect() };
        let params = pick(&self.params);
        match self.kind {
            Kind_::Adam | Kind_::Adamw => {
                let config = dist::AdamConfig {
                    lr: self.lr,
                    beta1: self.betas[0],
                    beta2: self.betas[1],
                    eps: self.eps,
                    weight_decay,
                    decoupled: self.kind == Kind_::Adamw,
                    fused: self.fused,
                };
                dist::adam(&params, &pick(&self.state[0]), &pick(&self.state[1]), self.steps, config)
            }
            Kind_::Sgd => {
                let config = dist::SgdConfig { lr: self.lr, momentum: self.momentum, weight_decay };
                let bufs = self.state.first().map_or(Vec::new(), |b| pick(b));
                dist::sgd(&params, &bufs, self.steps == 1, config)
            }
        }
    }

    /// Its state tensors (not the step count), named by parameter.
    pub fn state(&self) -> Vec<StateTensor> {
        let mut out = Vec::new();
        for (kind, tensors) in self.kinds.iter().zip(&self.state) {
            for (param, t) in self.names.iter().zip(tensors) {
                out.push(StateTensor {
                    name: format!("optim.{kind}.{param}"),
                    param: param.clone(),
                    tensor: t.shallow_clone(),
                });
            }
        }
        out
    }

    /// Sets the step count (the schedule's clock and Adam's bias correction), from a checkpoint.
    pub fn set_steps(&mut self, steps: usize) {
        self.steps = steps as i64;
    }

    /// Restores the state [`Optimizer::state`] names: `get(name, param, held)` gives the saved
    /// values of the tensor `held` (what this optimizer holds of parameter `param`).
    pub fn load_state(
        &mut self,
        mut get: impl FnMut(&str, &str, &Tensor) -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<()> {
        for s in self.state() {
            let saved = get(&s.name, &s.param, &s.tensor)?;
            anyhow::ensure!(
                saved.size() == s.tensor.size(),
                "optimizer state `{}` has shape {:?}, this run holds {:?}",
                s.name,
                saved.size(),
                s.tensor.size()
            );
            let mut held = s.tensor;
            tch::no_grad(|| held.copy_(&saved.to_kind(Kind::Float)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::Train;
    use tch::nn::{self, OptimizerConfig};

    /// Same trajectory as tch's (libtorch's) own optimizers, step for step, within `tolerance`.
    fn matches_libtorch(train: Train, reference: impl OptimizerConfig + Copy, tolerance: f64) {
        // Fixed values, not the global generator, which tests running in parallel also draw from.
        let opts = (Kind::Float, tch::Device::Cpu);
        let x = Tensor::arange(24, opts).view([8, 3]).sin();
        let run = |mine: bool| {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let w = vs.root().var_copy("w", &Tensor::arange(6, opts).view([3, 2]).cos());
            let mut ours = Optimizer::new(&train, vec![("w".to_owned(), w.shallow_clone())]);
            let mut theirs = reference.build(&vs, train.lr).unwrap();
            for _ in 0..5 {
                let loss = x.matmul(&w).pow_tensor_scalar(2).mean(Kind::Float);
                if mine {
                    ours.zero_grad().unwrap();
                    loss.backward();
                    ours.step().unwrap();
                } else {
                    theirs.zero_grad();
                    loss.backward();
                    theirs.step();
                }
            }
            w.copy()
        };
        let (a, b) = (run(true), run(false));
        let diff = (&a - &b).abs().max().double_value(&[]);
        assert!(diff <= tolerance, "{:?}: differs from libtorch by {diff}", train.optimizer);
    }

    /// To the bit: libtorch's SGD (as torch.optim.SGD) adds with alpha, one rounding per update.
    #[test]
    fn sgd_with_momentum_and_weight_decay_matches_libtorch_exactly() {
        let t = Train { momentum: 0.9, weight_decay: 0.01, lr: 0.1, ..Train::default() };
        matches_libtorch(t, nn::Sgd { momentum: 0.9, wd: 0.01, ..Default::default() }, 0.0);
        matches_libtorch(Train { lr: 0.1, ..Train::default() }, nn::Sgd::default(), 0.0);
    }

    #[test]
    fn adam_matches_libtorch() {
        let t = Train { optimizer: Kind_::Adam, lr: 0.01, weight_decay: 0.01, ..Train::default() };
        matches_libtorch(t, nn::Adam { wd: 0.01, ..Default::default() }, 1e-6);
    }

    #[test]
    fn adamw_with_betas_and_eps_matches_libtorch() {
        let t = Train {
            optimizer: Kind_::Adamw,
            lr: 0.01,
            weight_decay: 0.1,
            betas: [0.8, 0.99],
            eps: 1e-6,
            ..Train::default()
        };
        let reference = nn::AdamW { beta1: 0.8, beta2: 0.99, eps: 1e-6, wd: 0.1, ..Default::default() };
        matches_libtorch(t, reference, 1e-6);
    }

    /// "matrices": a vector (a bias) keeps its value when its gradient is zero; a matrix decays.
    #[test]
    fn weight_decay_on_matrices_leaves_vectors_alone() {
        for (on, bias_decays) in [(WeightDecayOn::All, true), (WeightDecayOn::Matrices, false)] {
            let t =
                Train { optimizer: Kind_::Adamw, lr: 0.1, weight_decay: 0.5, weight_decay_on: on, ..Train::default() };
            let w = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
            let b = Tensor::ones([2], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
            let mut opt = Optimizer::new(&t, vec![("w".into(), w.shallow_clone()), ("b".into(), b.shallow_clone())]);
            (&w * 0.0 + &b * 0.0).sum(Kind::Float).backward();
            opt.step().unwrap();
            assert!(w.double_value(&[0, 0]) < 1.0, "{on:?}: the matrix decays");
            assert_eq!(b.double_value(&[0]) < 1.0, bias_decays, "{on:?}: the vector");
        }
    }

    #[test]
    fn adamw_matches_libtorch() {
        let t = Train { optimizer: Kind_::Adamw, lr: 0.01, weight_decay: 0.01, ..Train::default() };
        matches_libtorch(t, nn::AdamW { wd: 0.01, ..Default::default() }, 1e-6);
    }

    /// `train.fused = false` (torch's `_foreach_` passes) follows the fused kernel's trajectory
    /// within 1e-6, parameters and moments, for Adam's L2 and AdamW's decoupled decay, over a
    /// matrix, a vector without decay and a parameter without a gradient (which neither updates).
    #[test]
    fn foreach_adam_matches_the_fused_kernel() {
        let opts = (Kind::Float, tch::Device::Cpu);
        let x = Tensor::arange(40, opts).view([10, 4]).sin();
        for optimizer in [Kind_::Adam, Kind_::Adamw] {
            let run = |fused: bool| {
                let t = Train {
                    optimizer,
                    lr: 0.02,
                    weight_decay: 0.1,
                    weight_decay_on: WeightDecayOn::Matrices,
                    fused: Some(fused),
                    ..Train::default()
                };
                let w = Tensor::arange(12, opts).view([4, 3]).cos().set_requires_grad(true);
                let b = Tensor::arange(3, opts).sin().set_requires_grad(true);
                let frozen = Tensor::ones([2], opts).set_requires_grad(true);
                let named = [("w", &w), ("b", &b), ("frozen", &frozen)];
                let mut opt =
                    Optimizer::new(&t, named.iter().map(|(n, p)| (n.to_string(), p.shallow_clone())).collect());
                for _ in 0..6 {
                    opt.zero_grad().unwrap();
                    (x.matmul(&w) + &b).tanh().pow_tensor_scalar(2).mean(Kind::Float).backward();
                    opt.step().unwrap();
                }
                let mut out = vec![w.detach(), b.detach(), frozen.detach()];
                out.extend(opt.state().into_iter().map(|s| s.tensor));
                out
            };
            let (fused, foreach) = (run(true), run(false));
            for (a, b) in fused.iter().zip(&foreach) {
                let diff = (a - b).abs().max().double_value(&[]);
                assert!(diff <= 1e-6, "{optimizer:?}: foreach differs from fused by {diff}");
            }
            assert_eq!(fused[2], Tensor::ones([2], opts), "a parameter without a gradient stays as it was");
            assert!((&fused[0] - Tensor::arange(12, opts).view([4, 3]).cos()).abs().max().double_value(&[]) > 0.01);
        }
    }
}
