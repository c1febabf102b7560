//! The collectives tensor parallelism is built from (`ProcessGroup::copy_to_ranks_autograd`
//! before a column-parallel layer, `sum_from_ranks_autograd` after a row-parallel one), across
//! real processes: a Megatron-split two-layer MLP equals the whole MLP in one process, forward
//! and backward. dist.rs's worker runs [`column_then_row`] as its scenario "tensor_parallel".
use runner::dist::ProcessGroup;
use tch::{Device, Kind, Tensor};

/// x (4 × 6) → linear 6 → 8 → tanh → linear 8 → 3 → sum of squares. Each rank holds rows
/// [r·8/w, (r+1)·8/w) of the first weight and bias, and the same columns of the second weight; the
/// second bias is added once, after the sum. The outputs, the input's gradient and each rank's
/// slices of the weights' gradients equal the whole model's.
pub fn column_then_row(pg: &ProcessGroup) {
    let (r, w) = (pg.rank() as i64, pg.size() as i64);
    let seeded = |shape: &[i64], salt: f64| {
        let n: i64 = shape.iter().product();
        (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + salt).sin().view(shape)
    };
    let x = seeded(&[4, 6], 0.1);
    let (w1, b1, w2, b2) = (seeded(&[8, 6], 0.2), seeded(&[8], 0.3), seeded(&[3, 8], 0.4), seeded(&[3], 0.5));
    let forward =
        |x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor| x.linear(w1, Some(b1)).tanh().linear(w2, None::<Tensor>);

    let leaf = |t: &Tensor| t.detach().set_requires_grad(true);
    let (x_all, w1_all, w2_all) = (leaf(&x), leaf(&w1), leaf(&w2));
    let whole = forward(&x_all, &w1_all, &b1, &w2_all) + &b2;
    whole.square().sum(Kind::Float).backward();

    let part = 8 / w;
    let (x_tp, w1_tp, w2_tp) = (leaf(&x), leaf(&w1.narrow(0, r * part, part)), leaf(&w2.narrow(1, r * part, part)));
    let entered = pg.copy_to_ranks_autograd(&x_tp).unwrap();
    let partial = forward(&entered, &w1_tp, &b1.narrow(0, r * part, part), &w2_tp);
    let split = pg.sum_from_ranks_autograd(&partial).unwrap() + &b2;
    split.square().sum(Kind::Float).backward();

    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    assert!(diff(&split, &whole) < 1e-5, "outputs differ by {}", diff(&split, &whole));
    assert!(diff(&x_tp.grad(), &x_all.grad()) < 1e-5, "the input's gradient differs");
    let w1_grad = w1_all.grad().narrow(0, r * part, part);
    assert!(diff(&w1_tp.grad(), &w1_grad) < 1e-5, "the column-parallel weight's gradient differs");
    let w2_grad = w2_all.grad().narrow(1, r * part, part);
    assert!(diff(&w2_tp.grad(), &w2_grad) < 1e-5, "the row-parallel weight's gradient differs");
}
