//! Optimizers with state we own (torch's formulas for SGD with momentum, Adam and AdamW), so a
//! checkpoint can save and restore it exactly: tch's optimizers do not expose their state.
use tch::{Kind, Tensor};

use crate::config::schema::{Optimizer as Kind_, Train};

pub struct Optimizer {
    kind: Kind_,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    params: Vec<Tensor>,
    /// Per parameter: SGD's momentum buffer, or Adam's first and second moments.
    state: Vec<Vec<Tensor>>,
    steps: i64,
}

const BETA1: f64 = 0.9;
const BETA2: f64 = 0.999;
const EPS: f64 = 1e-8;

impl Optimizer {
    pub fn new(t: &Train, params: Vec<Tensor>) -> Optimizer {
        let state = params
            .iter()
            .map(|p| match t.optimizer {
                Kind_::Sgd if t.momentum == 0.0 => vec![],
                Kind_::Sgd => vec![p.zeros_like()],
                Kind_::Adam | Kind_::Adamw => vec![p.zeros_like(), p.zeros_like()],
            })
            .collect();
        Optimizer {
            kind: t.optimizer,
            lr: t.lr,
            momentum: t.momentum,
            weight_decay: t.weight_decay,
            params,
            state,
            steps: 0,
        }
    }

    pub fn zero_grad(&mut self) {
        for p in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    pub fn step(&mut self) {
        self.steps += 1;
        let t = self.steps as f64;
        tch::no_grad(|| {
            for (p, state) in self.params.iter_mut().zip(&mut self.state) {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                match self.kind {
                    Kind_::Sgd => {
                        let mut d = if self.weight_decay != 0.0 { &grad + &*p * self.weight_decay } else { grad };
                        if let Some(buf) = state.first_mut() {
                            // torch: the first step's buffer is the gradient itself.
                            if t == 1.0 {
                                buf.copy_(&d);
                            } else {
                                let _ = buf.g_mul_scalar_(self.momentum).g_add_(&d);
                            }
                            d = buf.shallow_clone();
                        }
                        let _ = p.g_sub_(&(d * self.lr));
                    }
                    Kind_::Adam | Kind_::Adamw => {
                        let grad = if self.kind == Kind_::Adam && self.weight_decay != 0.0 {
                            &grad + &*p * self.weight_decay
                        } else {
                            grad
                        };
                        if self.kind == Kind_::Adamw {
                            let _ = p.g_mul_scalar_(1.0 - self.lr * self.weight_decay);
                        }
                        let (m, v) = state.split_at_mut(1);
                        let _ = m[0].lerp_(&grad, 1.0 - BETA1);
                        let _ = v[0].g_mul_scalar_(BETA2).addcmul_(&grad, &grad.g_mul_scalar(1.0 - BETA2));
                        let bc1 = 1.0 - BETA1.powf(t);
                        let bc2 = 1.0 - BETA2.powf(t);
                        let denom = v[0].sqrt() / bc2.sqrt() + EPS;
                        let _ = p.addcdiv_(&(&m[0] * (-self.lr / bc1)), &denom);
                    }
                }
            }
        });
    }

    /// The state as named tensors (for a checkpoint).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("optim.steps".to_string(), Tensor::from(self.steps))];
        for (i, s) in self.state.iter().enumerate() {
            for (k, t) in s.iter().enumerate() {
                out.push((format!("optim.{i}.{k}"), t.shallow_clone()));
            }
        }
        out
    }

    /// Restores what [`Optimizer::state`] produced; `get` looks a tensor up by name.
    pub fn load_state(&mut self, get: impl Fn(&str) -> Option<Tensor>) -> Result<(), String> {
        let steps = get("optim.steps").ok_or("no optimizer state")?;
        self.steps = steps.int64_value(&[]);
        for (i, s) in self.state.iter_mut().enumerate() {
            for (k, t) in s.iter_mut().enumerate() {
                let saved =
                    get(&format!("optim.{i}.{k}")).ok_or_else(|| format!("no optimizer state optim.{i}.{k}"))?;
                if saved.size() != t.size() {
                    return Err(format!(
                        "optimizer state optim.{i}.{k} has shape {:?}, expected {:?}",
                        saved.size(),
                        t.size()
                    ));
                }
                tch::no_grad(|| t.copy_(&saved.to_kind(Kind::Float)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::Train;
    use tch::nn::{self, OptimizerConfig};

    /// Same trajectory as tch's (libtorch's) own optimizers, step for step.
    fn matches_libtorch(train: Train, reference: impl OptimizerConfig + Copy) {
        // Both runs start from the same tensors, drawn once: tests in other threads draw from
        // (and reseed) the same global generator.
        tch::manual_seed(1);
        let x = Tensor::randn([8, 3], (Kind::Float, tch::Device::Cpu));
        let w0 = Tensor::randn([3, 2], (Kind::Float, tch::Device::Cpu));
        let run = |mine: bool| {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let w = vs.root().var_copy("w", &w0);
            let mut ours = Optimizer::new(&train, vs.trainable_variables());
            let mut theirs = reference.build(&vs, train.lr).unwrap();
            for _ in 0..5 {
                let loss = x.matmul(&w).pow_tensor_scalar(2).mean(Kind::Float);
                if mine {
                    ours.zero_grad();
                    loss.backward();
                    ours.step();
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
        assert!(diff < 1e-6, "{:?}: differs from libtorch by {diff}", train.optimizer);
    }

    #[test]
    fn sgd_with_momentum_and_weight_decay_matches_libtorch() {
        let t = Train { momentum: 0.9, weight_decay: 0.01, lr: 0.1, ..Train::default() };
        matches_libtorch(t, nn::Sgd { momentum: 0.9, wd: 0.01, ..Default::default() });
    }

    #[test]
    fn adam_matches_libtorch() {
        let t = Train { optimizer: Kind_::Adam, lr: 0.01, weight_decay: 0.01, ..Train::default() };
        matches_libtorch(t, nn::Adam { wd: 0.01, ..Default::default() });
    }

    #[test]
    fn adamw_matches_libtorch() {
        let t = Train { optimizer: Kind_::Adamw, lr: 0.01, weight_decay: 0.01, ..Train::default() };
        matches_libtorch(t, nn::AdamW { wd: 0.01, ..Default::default() });
    }
}
