//! Preemption, on a rank: `run.preempt_signal` (SIGUSR1 by default, what Slurm's
//! `--signal=USR1@90` sends before a time limit or a preemption) only raises a flag. The ranks
//! agree on it in an all-reduce that runs beside the training ([`Agreement`]); once any rank was
//! signalled, every rank stops after the same step, a checkpoint is written there (with
//! the data position and the unfinished interval's buffers) and the rank ends with
//! [`Preempted`]. Whoever owns the run directory then marks it `preempted`, and under Slurm
//! requeues the job ([`crate::launch::slurm::requeue`]); the requeued job's `runner run` resumes
//! from that checkpoint.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tch::Tensor;

use crate::dist::{Pending, ProcessGroup, ReduceOp};

/// How a preempted rank ends: the step of the checkpoint it took part in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("preempted at step {step} by {signal}")]
pub struct Preempted {
    pub step: usize,
    pub signal: &'static str,
}

struct Watch {
    flag: Arc<AtomicBool>,
    signal: &'static str,
}

static WATCH: OnceLock<Watch> = OnceLock::new();

/// From now on, `signal` raises this process's preemption flag instead of ending it. Every rank
/// calls it first thing (the ranks of one run must all watch, or none: [`agreed`] is collective).
pub fn watch(signal: crate::config::schema::PreemptSignal) -> anyhow::Result<()> {
    let flag = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal.number(), Arc::clone(&flag))?;
    let _ = WATCH.set(Watch { flag, signal: signal.name() });
    Ok(())
}

/// Training time between two rounds of the ranks' agreement.
const ROUND: Duration = Duration::from_millis(50);

/// The ranks' running agreement on whether to stop. Every so many steps (a round of about
/// [`ROUND`] of training) each rank starts an all-reduce of its flag and goes on training; at the
/// next round it reads the result. No rank waits on it (the reduction runs beside the steps), it
/// costs one small all-reduce per round rather than per step, and every rank reads the same
/// answer after the same step: a signal is acted on within about two rounds. The rounds' length
/// in steps is agreed in the same all-reduce (the shortest any rank proposes), so every rank
/// checks after the same steps.
pub struct Agreement<'pg> {
    pg: &'pg ProcessGroup,
    device: tch::Device,
    pending: Option<Pending<'pg>>,
    /// The step count at which the next round reads and starts an all-reduce.
    next: usize,
    /// When the last round started, and after how many steps.
    last: (Instant, usize),
}

impl<'pg> Agreement<'pg> {
    pub fn new(pg: &'pg ProcessGroup, device: tch::Device) -> Agreement<'pg> {
        Agreement { pg, device, pending: None, next: 0, last: (Instant::now(), 0) }
    }

    /// After a step (`done` steps so far in this process): the preemption signal, when every
    /// rank stops after this step. Free when this process watches nothing (ranks run by the
    /// tests' own harness) and between rounds.
    pub fn after_step(&mut self, done: usize) -> anyhow::Result<Option<&'static str>> {
        let Some(watch) = WATCH.get() else { return Ok(None) };
        let mine = watch.flag.load(Ordering::SeqCst);
        if self.pg.size() == 1 {
            return Ok(mine.then_some(watch.signal));
        }
        if done < self.next {
            return Ok(None);
        }
        let mut steps = 1;
        if let Some(pending) = self.pending.take() {
            let agreed = Vec::<f64>::try_from(pending.wait()?.to_device(tch::Device::Cpu))?;
            if agreed[0] > 0.0 {
                return Ok(Some(watch.signal));
            }
            steps = (-agreed[1]).max(1.0) as usize;
        }
        // This rank's proposal for the next round: ROUND's worth of steps at its recent pace.
        let (since, at) = self.last;
        let per_step = since.elapsed().as_secs_f64() / (done - at).max(1) as f64;
        let proposal = (ROUND.as_secs_f64() / per_step.max(1e-6)).clamp(1.0, 10_000.0).floor();
        // One maximum carries both: the flag, and the shortest proposal (negated).
        let round = Tensor::from_slice(&[mine as u8 as f64, -proposal]).to_device(self.device);
        self.pending = Some(self.pg.all_reduce_start(round, ReduceOp::Max)?);
        self.last = (Instant::now(), done);
        self.next = done + steps;
        Ok(None)
    }
}
