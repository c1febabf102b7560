//! The runner's Adam and AdamW beside PyTorch's `torch.optim.AdamW(fused=True)` and
//! `torch.optim.Adam(fused=True)` (the reference environment's torch), from the same weights and
//! the same gradients at every step: parameters and both moments agree within 1e-6 after 8 steps,
//! whether the runner runs the fused kernel (`train.fused = true`, the default) or PyTorch's
//! multi-tensor `_foreach_` passes (`train.fused = false`). Two parameter groups, as
//! `weight_decay_on = "matrices"` makes (a matrix decayed, a vector not), and a learning rate that
//! changes between steps, as a schedule sets it.
use crate::common;

use std::collections::BTreeMap;
use std::process::Command;

use runner::config::schema::{Optimizer as Kind, Train, WeightDecayOn};
use runner::model::optim::Optimizer;
use tch::Tensor;

const STEPS: usize = 8;

const TORCH: &str = r#"
import sys, torch
from safetensors.torch import load_file, save_file
kind, steps, given, out = sys.argv[1], int(sys.argv[2]), load_file(sys.argv[3]), sys.argv[4]
w = given["init.w"].clone().requires_grad_(True)
b = given["init.b"].clone().requires_grad_(True)
make = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
groups = [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}]
opt = make(groups, lr=0.01, betas=(0.9, 0.95), eps=1e-8, fused=True)
for k in range(steps):
    for g in opt.param_groups:
        g["lr"] = float(given["lr"][k])
    w.grad, b.grad = given[f"grad{k}.w"].clone(), given[f"grad{k}.b"].clone()
    opt.step()
result = {"w": w.detach(), "b": b.detach()}
for name, p in (("w", w), ("b", b)):
    for s in ("exp_avg", "exp_avg_sq"):
        result[f"{s}.{name}"] = opt.state[p][s]
save_file(result, out)
"#;

/// Fixed values, not a generator: the same bits on both sides.
fn values(n: i64, phase: f64) -> Tensor {
    (Tensor::arange(n, (tch::Kind::Float, tch::Device::Cpu)) * 0.37 + phase).sin()
}

/// The runner's optimizer over `given`'s weights and gradients: each step's gradient is set by a
/// backward pass of `sum(p * g)`, whose gradient is `g` exactly.
fn ours(kind: Kind, fused: bool, given: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    let t = Train {
        optimizer: kind,
        lr: 0.01,
        betas: [0.9, 0.95],
        eps: 1e-8,
        weight_decay: 0.1,
        weight_decay_on: WeightDecayOn::Matrices,
        fused: Some(fused),
        ..Train::default()
    };
    let w = given["init.w"].copy().set_requires_grad(true);
    let b = given["init.b"].copy().set_requires_grad(true);
    let mut opt = Optimizer::new(&t, vec![("w".into(), w.shallow_clone()), ("b".into(), b.shallow_clone())]);
    for k in 0..STEPS {
        opt.zero_grad().unwrap();
        opt.set_lr(given["lr"].double_value(&[k as i64]));
        let loss = (&w * &given[&format!("grad{k}.w")]).sum(tch::Kind::Float)
            + (&b * &given[&format!("grad{k}.b")]).sum(tch::Kind::Float);
        loss.backward();
        opt.step().unwrap();
    }
    let mut out = BTreeMap::from([("w".to_owned(), w.detach()), ("b".to_owned(), b.detach())]);
    for s in opt.state() {
        out.insert(s.name.trim_start_matches("optim.").to_owned(), s.tensor);
    }
    out
}

#[test]
fn adam_and_adamw_fused_and_foreach_equal_pytorchs_fused_optimizers() {
    let dir = tempfile::tempdir().unwrap();
    let mut given = vec![("init.w".to_owned(), values(48, 0.0).view([8, 6])), ("init.b".to_owned(), values(6, 1.0))];
    given.push(("lr".to_owned(), Tensor::from_slice(&[0.01f64, 0.02, 0.03, 0.03, 0.025, 0.02, 0.01, 0.005])));
    for k in 0..STEPS {
        // Gradients of several magnitudes, so that both moments' bias corrections matter.
        let scale = 10f64.powi(k as i32 % 3 - 1);
        given.push((format!("grad{k}.w"), values(48, k as f64 * 0.7).view([8, 6]) * scale));
        given.push((format!("grad{k}.b"), values(6, k as f64 * 1.3) * scale));
    }
    let path = dir.path().join("given.safetensors");
    Tensor::write_safetensors(&given, &path).unwrap();
    let given: BTreeMap<String, Tensor> = given.into_iter().collect();
    for (kind, name) in [(Kind::Adamw, "adamw"), (Kind::Adam, "adam")] {
        let out = dir.path().join(format!("{name}.safetensors"));
        let o = Command::new(common::reference_python())
            .args(["-c", TORCH, name, &STEPS.to_string()])
            .arg(&path)
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let theirs: BTreeMap<String, Tensor> = Tensor::read_safetensors(&out).unwrap().into_iter().collect();
        for fused in [true, false] {
            let mine = ours(kind, fused, &given);
            assert_eq!(mine.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>());
            for (key, t) in &theirs {
                let diff = (&mine[key] - t).abs().max().double_value(&[]);
                assert!(diff <= 1e-6, "{name} (fused = {fused}): `{key}` differs from PyTorch's by {diff}");
            }
            let moved = (&mine["w"] - &given["init.w"]).abs().max().double_value(&[]);
            assert!(moved > 0.01, "{name}: the weights moved ({moved})");
        }
    }
}
