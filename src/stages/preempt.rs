//! Preemption, on a rank: `run.preempt_signal` (SIGUSR1 by default, what Slurm's
//! `--signal=USR1@90` sends before a time limit or a preemption) only raises a flag. The ranks
//! agree on it in an all-reduce that runs beside the training ([`Agreement`]); once any rank was
//! signalled, every rank stops after the same step, a checkpoint is written there (with
//! the data position and the unfinished interval's buffers) and the rank ends with
//! [`Preempted`]. Whoever owns the run directory then marks it `preempted`, and under Slurm
//! requeues the job ([`crate::launch::slurm::requeue`]); the requeued job's `runner run` resumes
//! from that checkpoint.
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tch::Tensor;

use crate::dist::{Pending, ProcessGroup, ReduceOp};

/// Set on ranks by an elastic launcher (`crate::launch::elastic`): the prefix of the attempt's
/// keys in the store, which outlives attempts; its presence makes the run elastic.
pub const STORE_PREFIX: &str = "RUNNER_STORE_PREFIX";

/// How a preempted rank ends: the step of the checkpoint it took part in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("preempted at step {step} by {signal}")]
pub struct Preempted {
    pub step: usize,
    pub signal: &'static str,
}

/// The name of `run.preempt_signal`, once this rank watches it.
static WATCH: OnceLock<&'static str> = OnceLock::new();

/// From now on `signal` is this rank's preemption signal (it raises a flag since the process's
/// first instruction: [`crate::signals`]). Every rank calls it before it joins the others (the
/// ranks of one run must all watch, or none: [`Agreement`] is collective).
pub fn watch(signal: crate::config::schema::PreemptSignal) {
    crate::signals::set_preempt(signal.number());
    if crate::signals::watching() {
        let _ = WATCH.set(signal.name());
    }
}

/// The key an elastic launcher sets in the attempt's store when a node waits to join
/// ([`crate::launch::elastic`]): the ranks stop at their next checkpoint, as if preempted.
pub const REJOIN: &str = "runner/elastic/rejoin";
/// What a rank stopped for a joining node says, where a preempted one names its signal.
pub const REJOINING: &str = "a node joining";

/// At a checkpoint: whether every rank stops after it because a node waits to join. Rank 0 reads
/// the store and the ranks agree in one small all-reduce; nothing at all outside an elastic
/// launcher's ranks.
pub fn rejoin_wanted(pg: &ProcessGroup, device: tch::Device) -> anyhow::Result<bool> {
    static ELASTIC: OnceLock<bool> = OnceLock::new();
    if !*ELASTIC.get_or_init(|| std::env::var(STORE_PREFIX).is_ok()) {
        return Ok(false);
    }
    let mine = pg.rank() == 0 && pg.store().contains(REJOIN)?;
    let flag = Tensor::from_slice(&[mine as u8 as f64]).to_device(device);
    Ok(pg.all_reduce_start(flag, ReduceOp::Max)?.wait()?.double_value(&[0]) > 0.0)
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
        let Some(&signal) = WATCH.get() else { return Ok(None) };
        let mine = crate::signals::preempted();
        if self.pg.size() == 1 {
            return Ok(mine.then_some(signal));
        }
        if done < self.next {
            return Ok(None);
        }
        let mut steps = 1;
        if let Some(pending) = self.pending.take() {
            let agreed = Vec::<f64>::try_from(pending.wait()?.to_device(tch::Device::Cpu))?;
            if agreed[0] > 0.0 {
                return Ok(Some(signal));
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
