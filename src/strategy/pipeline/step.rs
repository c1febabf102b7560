//! One training step of a pipeline stage in progress: the micro-batches' receives, forwards,
//! sends and backwards, in the order the schedule calls them.
use std::time::Duration;

use tch::nn::ModuleT;
use tch::{Kind, Tensor};

use super::{Stage, GRAD_TAG};
use crate::device;
use crate::strategy::StepOut;

pub(super) fn timed<T>(
    dev: tch::Device,
    total: &mut Duration,
    f: impl FnOnce() -> crate::dist::Result<T>,
) -> crate::dist::Result<T> {
    let t = device::now(dev);
    let r = f();
    *total += device::elapsed(dev, t);
    r
}

/// One training step in progress on one rank: the micro-batches' inputs (whose gradients go
/// back) and outputs (activations, or the loss on the last rank) until their backward.
pub(super) struct Step<'a, 'pg> {
    stage: &'a Stage<'pg>,
    model: &'a dyn ModuleT,
    x: &'a Tensor,
    y: &'a Tensor,
    n: i64,
    /// The batch's share of its optimizer step's loss (gradient accumulation).
    pub(super) scale: f64,
    sizes: Vec<i64>,
    offsets: Vec<i64>,
    inputs: Vec<Option<Tensor>>,
    outputs: Vec<Option<Tensor>>,
    per_sample: Vec<Tensor>,
    correct: Vec<Tensor>,
    out: StepOut,
}

impl<'a, 'pg> Step<'a, 'pg> {
    pub(super) fn new(
        stage: &'a Stage<'pg>,
        model: &'a dyn ModuleT,
        x: &'a Tensor,
        y: &'a Tensor,
        n: i64,
        sizes: Vec<i64>,
    ) -> Self {
        let offsets = sizes.iter().scan(0, |o, s| Some(std::mem::replace(o, *o + s))).collect();
        let m = sizes.len();
        let out = StepOut::default();
        Step {
            stage,
            model,
            x,
            y,
            n,
            scale: 1.0,
            sizes,
            offsets,
            inputs: (0..m).map(|_| None).collect(),
            outputs: (0..m).map(|_| None).collect(),
            per_sample: Vec::with_capacity(m),
            correct: Vec::with_capacity(m),
            out,
        }
    }

    /// Micro-batch `i`'s input, as a leaf whose gradient is the one to send back.
    pub(super) fn recv_forward(&mut self, i: usize) -> anyhow::Result<Tensor> {
        let input = self.stage.receive_input(self.x, self.offsets[i], self.sizes[i], i as i32, &mut self.out.wait)?;
        Ok(if self.stage.stage > 0 { input.set_requires_grad(true) } else { input })
    }

    pub(super) fn forward(&mut self, i: usize, input: Tensor) -> anyhow::Result<()> {
        let t = device::clock::mark(self.stage.device);
        let h = crate::strategy::in_precision(self.stage.precision, || self.model.forward_t(&input, true))?;
        // Activations travel, and losses are taken, in float32.
        let h = if h.kind() == Kind::Float { h } else { h.to_kind(Kind::Float) };
        if let Some(e) = self.stage.tensor_failure() {
            return Err(e.into());
        }
        let t1 = device::clock::mark(self.stage.device);
        self.out.forward += device::Span::between(&t, &t1);
        self.inputs[i] = Some(input);
        if self.stage.is_last() {
            let y = self.y.narrow(0, self.offsets[i], self.sizes[i]);
            let ps = self.stage.task.per_sample_loss(&h, &y);
            // Each micro-batch's share of the batch mean, so the gradients add up to it.
            let share = ps.sum(Kind::Float) / self.n as f64;
            self.outputs[i] = Some(if self.scale == 1.0 { share } else { share * self.scale });
            self.per_sample.push(ps.detach());
            self.correct.push(tch::no_grad(|| self.stage.task.correct(&h, &y)));
            self.out.loss += device::Span::between(&t1, &device::clock::mark(self.stage.device));
        } else {
            self.outputs[i] = Some(h);
        }
        Ok(())
    }

    pub(super) fn send_forward(&mut self, i: usize) -> anyhow::Result<()> {
        if !self.stage.is_last() {
            let (pg, next, h) = (self.stage.pg, self.stage.next(), self.outputs[i].as_ref().expect("forward ran"));
            timed(self.stage.device, &mut self.out.wait, || pg.send(h, next, i as i32))?;
        }
        Ok(())
    }

    /// The gradient of micro-batch `i`'s output, from the rank after (none on the last rank).
    pub(super) fn recv_backward(&mut self, i: usize) -> anyhow::Result<Option<Tensor>> {
        if self.stage.is_last() {
            return Ok(None);
        }
        let mut grad = self.stage.buffer(self.sizes[i], &self.stage.out_shape);
        let (pg, next) = (self.stage.pg, self.stage.next());
        timed(self.stage.device, &mut self.out.wait, || pg.recv(&mut grad, next, GRAD_TAG + i as i32))?;
        Ok(Some(grad))
    }

    /// Sends micro-batch `i`'s output on while receiving micro-batch `j`'s gradient.
    pub(super) fn send_forward_recv_backward(&mut self, i: usize, j: usize) -> anyhow::Result<Option<Tensor>> {
        if self.stage.is_last() {
            return Ok(None);
        }
        let mut grad = self.stage.buffer(self.sizes[j], &self.stage.out_shape);
        let (pg, next, h) = (self.stage.pg, self.stage.next(), self.outputs[i].as_ref().expect("forward ran"));
        timed(self.stage.device, &mut self.out.wait, || {
            pg.send_recv(h, next, i as i32, &mut grad, next, GRAD_TAG + j as i32)
        })?;
        Ok(Some(grad))
    }

    /// Backpropagates micro-batch `i` through this rank's layers, accumulating the parameters'
    /// gradients, and frees its activations.
    pub(super) fn backward(&mut self, i: usize, grad: Option<Tensor>) -> anyhow::Result<()> {
        let output = self.outputs[i].take().expect("forward ran");
        // d(sum(out · grad))/d(out) = grad: tch has no backward with a given gradient.
        let target = match grad {
            Some(g) => (output * g).sum(Kind::Float),
            None => output,
        };
        let t = device::clock::mark(self.stage.device);
        target.f_backward()?;
        // A checkpointed block's recomputation ran its tensor collectives again.
        if let Some(e) = self.stage.tensor_failure() {
            return Err(e.into());
        }
        self.out.backward += device::Span::between(&t, &device::clock::mark(self.stage.device));
        Ok(())
    }

    pub(super) fn send_backward(&mut self, i: usize) -> anyhow::Result<()> {
        let input = self.inputs[i].take().expect("forward ran");
        if self.stage.stage > 0 {
            let (pg, prev, grad) = (self.stage.pg, self.stage.prev(), input.grad());
            timed(self.stage.device, &mut self.out.wait, || pg.send(&grad, prev, GRAD_TAG + i as i32))?;
        }
        Ok(())
    }

    /// Sends micro-batch `j`'s input gradient back while receiving micro-batch `i`'s input.
    pub(super) fn send_backward_recv_forward(&mut self, j: usize, i: usize) -> anyhow::Result<Tensor> {
        if self.stage.stage == 0 {
            self.inputs[j] = None;
            return self.recv_forward(i);
        }
        let grad = self.inputs[j].take().expect("forward ran").grad();
        let mut h = self.stage.buffer(self.sizes[i], &self.stage.in_shape);
        let (pg, prev) = (self.stage.pg, self.stage.prev());
        timed(self.stage.device, &mut self.out.wait, || {
            pg.send_recv(&grad, prev, GRAD_TAG + j as i32, &mut h, prev, i as i32)
        })?;
        Ok(h.set_requires_grad(true))
    }

    pub(super) fn finish(mut self) -> StepOut {
        if self.stage.is_last() {
            self.out.per_sample = Some(Tensor::cat(&self.per_sample, 0));
            self.out.correct = Some(Tensor::cat(&self.correct, 0));
        }
        self.out
    }
}
