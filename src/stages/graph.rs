//! `run.cuda_graphs`: a training step's forward and backward passes replayed as one CUDA graph.
//! The first steps run eagerly (they warm up what the capture records: cuBLAS's workspace on the
//! rank's stream, the autograd engine's device thread, the gradients' first allocation); the
//! next is captured on static input tensors and replayed, and every later step copies its batch
//! into those tensors and replays the graph. The gradients the graph writes are the parameters'
//! own (set to none before the capture, so its backward pass assigns them, never adds), and the
//! optimizer step runs after the replay as without a graph, so the same kernels run with the
//! same values: the same results. The plan refuses what a replay cannot hold (`plan::graphs`).
use std::panic::AssertUnwindSafe;

use tch::Tensor;

use crate::device::{self, Span, StepClock};
use crate::dist::CudaGraph;
use crate::strategy::StepOut;

use crate::plan::graphs::WARMUP_STEPS;

/// The graph of one rank's step, once captured.
pub struct StepGraph {
    device: tch::Device,
    eager_left: usize,
    captured: Option<Captured>,
}

struct Captured {
    graph: CudaGraph,
    /// The batch the graph reads, and the per-sample losses and hits it writes.
    x: Tensor,
    y: Tensor,
    per_sample: Option<Tensor>,
    correct: Option<Tensor>,
}

impl StepGraph {
    /// The rank's step graph where `run.cuda_graphs` is on (the rank then runs on a side stream:
    /// [`crate::dist::use_side_stream`]).
    pub fn of(on: bool, device: tch::Device) -> Option<StepGraph> {
        on.then_some(StepGraph { device, eager_left: WARMUP_STEPS, captured: None })
    }

    /// Whether the graph is captured: its gradients are then the parameters' and stay set.
    pub fn captured(&self) -> bool {
        self.captured.is_some()
    }

    /// One step: eager while warming up, captured then replayed at the first step after, replayed
    /// from then on. `run` is the strategy's step on the given batch.
    pub fn step(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        clock: StepClock,
        run: impl FnOnce(&Tensor, &Tensor, StepClock) -> anyhow::Result<StepOut>,
    ) -> anyhow::Result<StepOut> {
        if self.captured.is_none() {
            if self.eager_left > 0 {
                self.eager_left -= 1;
                return run(x, y, clock);
            }
            self.captured = Some(capture(self.device, x, y, run)?);
        }
        self.captured.as_ref().expect("captured above").replay(x, y, clock)
    }
}

/// Records `run` on copies of the batch (the graph's static inputs); nothing runs yet.
fn capture(
    device: tch::Device,
    x: &Tensor,
    y: &Tensor,
    run: impl FnOnce(&Tensor, &Tensor, StepClock) -> anyhow::Result<StepOut>,
) -> anyhow::Result<Captured> {
    let (x, y) = (x.copy(), y.copy());
    device::synchronize(device);
    let graph = CudaGraph::begin()?;
    // The host's clock only: an event recorded during a capture would become part of the graph.
    let host = StepClock::new(tch::Device::Cpu, false);
    let out = std::panic::catch_unwind(AssertUnwindSafe(|| run(&x, &y, host)));
    let ended = graph.end();
    let failed = |why: String| {
        anyhow::anyhow!(
            "run.cuda_graphs: capturing the training step failed: {why}; an operation of this model cannot be \
             recorded in a CUDA graph: set run.cuda_graphs = false"
        )
    };
    let out = match out {
        Ok(out) => out.map_err(|e| failed(format!("{e:#}")))?,
        Err(panic) => return Err(failed(crate::checked::panic_report(&panic))),
    };
    ended.map_err(|e| failed(e.to_string()))?;
    Ok(Captured { graph, x, y, per_sample: out.per_sample, correct: out.correct })
}

impl Captured {
    fn replay(&self, x: &Tensor, y: &Tensor, clock: StepClock) -> anyhow::Result<StepOut> {
        if x.size() != self.x.size() || y.size() != self.y.size() {
            anyhow::bail!(
                "run.cuda_graphs: a batch of shape {:?} came where the graph was captured on {:?}; the plan refuses \
                 batch sizes that vary, so this is a defect of the runner: please report it, and set \
                 run.cuda_graphs = false meanwhile",
                x.size(),
                self.x.size()
            );
        }
        tch::no_grad(|| {
            self.x.shallow_clone().copy_(x);
            self.y.shallow_clone().copy_(y);
        });
        let t0 = clock.mark();
        self.graph.replay()?;
        let t1 = clock.mark();
        let copy = |t: &Option<Tensor>| t.as_ref().map(Tensor::shallow_clone);
        // One replay: its phases are not told apart, its time is the forward pass's.
        Ok(StepOut {
            per_sample: copy(&self.per_sample),
            correct: copy(&self.correct),
            forward: Span::between(&t0, &t1),
            ..StepOut::default()
        })
    }
}
