//! Pipeline parallelism (`wrap.strategy = "pipeline"`), GPipe schedule: each batch is cut into
//! micro-batches; every micro-batch flows forward rank to rank (activations sent with c10d's
//! send/recv), the last rank computes the loss, then every micro-batch's gradient flows back.
//! Parameter gradients accumulate over the micro-batches and each rank then updates its own
//! layers once per batch, so a step equals one process's step on the whole batch.
//!
//! Every rank knows every shape from the plan (the batch's rows, the widths at its boundaries), so
//! nothing but the tensors themselves is sent. Sends and receives are blocking; the time a rank
//! spends in them is its wait, the pipeline's bubble.
use std::time::{Duration, Instant};

use tch::nn::ModuleT;
use tch::{Kind, Reduction, Tensor};

use crate::config::Plan;
use crate::dist::ProcessGroup;
use crate::model::Mlp;

/// Tags keep the three kinds of traffic apart: a schedule mismatch fails instead of mixing data.
const GRAD_TAG: i32 = 1 << 20;
const EVAL_TAG: i32 = 2 << 20;

/// This rank's place in the pipeline.
pub struct Stage<'pg> {
    pg: &'pg ProcessGroup,
    rank: usize,
    last: usize,
    /// Widths of the activations coming in and going out.
    in_width: i64,
    out_width: i64,
    micro_batches: usize,
}

/// What one step measured on this rank; `per_sample` and `logits` only on the last rank.
pub struct StepOut {
    pub per_sample: Option<Tensor>,
    pub logits: Option<Tensor>,
    pub forward: Duration,
    pub loss: Duration,
    pub backward: Duration,
    /// Inside send and recv (waiting for a neighbour, and the transfer itself).
    pub wait: Duration,
}

/// The micro-batch sizes of a batch of `n` rows: `min(micro, n)` parts differing by at most one
/// row, larger first (so every rank derives the same sizes).
pub fn micro_sizes(n: i64, micro: usize) -> Vec<i64> {
    let m = (micro as i64).min(n).max(1);
    (0..m).map(|i| n / m + i64::from(i < n % m)).collect()
}

impl<'pg> Stage<'pg> {
    pub fn new(plan: &Plan, pg: &'pg ProcessGroup) -> Stage<'pg> {
        let rank = pg.rank();
        let c = &plan.config;
        let widths = crate::model::widths(plan.data.features, &c.wrap.model.hidden, plan.data.classes);
        let layers = &plan.stages[rank];
        Stage {
            pg,
            rank,
            last: plan.world_size() - 1,
            in_width: widths[layers.start] as i64,
            out_width: widths[layers.end] as i64,
            micro_batches: c.wrap.pipeline.micro_batches,
        }
    }

    pub fn is_last(&self) -> bool {
        self.rank == self.last
    }

    /// Forward and backward of one batch of `n` rows: `x` on rank 0, `y` on the last rank.
    /// Leaves this rank's parameter gradients summed over the micro-batches, for a loss that is
    /// the mean over the whole batch.
    pub fn train_step(&self, model: &Mlp, x: &Tensor, y: &Tensor, n: i64) -> anyhow::Result<StepOut> {
        let sizes = micro_sizes(n, self.micro_batches);
        let mut out = StepOut {
            per_sample: None,
            logits: None,
            forward: Duration::ZERO,
            loss: Duration::ZERO,
            backward: Duration::ZERO,
            wait: Duration::ZERO,
        };
        // Per micro-batch: the input (whose gradient goes back) and the output (or the loss).
        let mut inputs = Vec::with_capacity(sizes.len());
        let mut outputs = Vec::with_capacity(sizes.len());
        let (mut per_sample, mut logits) = (Vec::new(), Vec::new());
        let mut offset = 0;
        for (m, &len) in sizes.iter().enumerate() {
            let input = self.receive_input(x, offset, len, m as i32, &mut out.wait)?;
            let t = Instant::now();
            let h = model.forward_t(&input, true);
            out.forward += t.elapsed();
            if self.is_last() {
                let t = Instant::now();
                let ps = h.cross_entropy_loss::<Tensor>(&y.narrow(0, offset, len), None, Reduction::None, -100, 0.0);
                // Each micro-batch's share of the batch mean, so the gradients add up to it.
                outputs.push(ps.sum(Kind::Float) / n as f64);
                per_sample.push(ps.detach());
                logits.push(h.detach());
                out.loss += t.elapsed();
            } else {
                self.timed(&mut out.wait, || self.pg.send(&h, self.rank + 1, m as i32))?;
                outputs.push(h);
            }
            inputs.push(input);
            offset += len;
        }
        for m in (0..sizes.len()).rev() {
            let target = if self.is_last() {
                outputs[m].shallow_clone()
            } else {
                let mut grad = Tensor::zeros([sizes[m], self.out_width], (Kind::Float, tch::Device::Cpu));
                self.timed(&mut out.wait, || self.pg.recv(&mut grad, self.rank + 1, GRAD_TAG + m as i32))?;
                // d(sum(out · grad))/d(out) = grad: tch has no backward with a given gradient.
                (&outputs[m] * grad).sum(Kind::Float)
            };
            let t = Instant::now();
            target.f_backward()?;
            out.backward += t.elapsed();
            if self.rank > 0 {
                let grad = inputs[m].grad();
                self.timed(&mut out.wait, || self.pg.send(&grad, self.rank - 1, GRAD_TAG + m as i32))?;
            }
        }
        if self.is_last() {
            out.per_sample = Some(Tensor::cat(&per_sample, 0));
            out.logits = Some(Tensor::cat(&logits, 0));
        }
        Ok(out)
    }

    /// The logits of `x` (`n` rows, given on rank 0) through every stage, in chunks of `chunk`
    /// rows, without gradients; `Some` on the last rank.
    pub fn evaluate(&self, model: &Mlp, x: &Tensor, n: i64, chunk: i64) -> anyhow::Result<Option<Tensor>> {
        let mut wait = Duration::ZERO;
        let mut logits = Vec::new();
        let mut offset = 0;
        let mut i = 0;
        while offset < n {
            let len = chunk.min(n - offset);
            let input = self.receive_input(x, offset, len, EVAL_TAG + i, &mut wait)?;
            let h = tch::no_grad(|| model.forward_t(&input, false));
            if self.is_last() {
                logits.push(h);
            } else {
                self.pg.send(&h, self.rank + 1, EVAL_TAG + i)?;
            }
            offset += len;
            i += 1;
        }
        Ok(self.is_last().then(|| Tensor::cat(&logits, 0)))
    }

    /// Rank 0 slices its micro-batch; the others receive it from the rank before, as a leaf whose
    /// gradient is the one to send back.
    fn receive_input(
        &self,
        x: &Tensor,
        offset: i64,
        len: i64,
        tag: i32,
        wait: &mut Duration,
    ) -> anyhow::Result<Tensor> {
        if self.rank == 0 {
            return Ok(x.narrow(0, offset, len));
        }
        let mut h = Tensor::zeros([len, self.in_width], (Kind::Float, tch::Device::Cpu));
        self.timed(wait, || self.pg.recv(&mut h, self.rank - 1, tag))?;
        Ok(h.set_requires_grad(true))
    }

    fn timed<T>(&self, total: &mut Duration, f: impl FnOnce() -> crate::dist::Result<T>) -> crate::dist::Result<T> {
        let t = Instant::now();
        let r = f();
        *total += t.elapsed();
        r
    }
}

#[cfg(test)]
mod tests {
    use super::micro_sizes;

    #[test]
    fn micro_batches_cover_the_batch_and_differ_by_at_most_one_row() {
        assert_eq!(micro_sizes(64, 4), [16, 16, 16, 16]);
        assert_eq!(micro_sizes(18, 4), [5, 5, 4, 4]);
        assert_eq!(micro_sizes(3, 4), [1, 1, 1]);
        assert_eq!(micro_sizes(7, 1), [7]);
        for n in 1..40 {
            for m in 1..9 {
                let s = micro_sizes(n, m);
                assert_eq!(s.iter().sum::<i64>(), n);
                assert!(s.iter().all(|&k| k >= 1) && s.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1));
            }
        }
    }
}
