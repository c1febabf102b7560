//! The launcher's watch over its node's ranks, one turn every 20 ms until every rank has ended:
//! signals forwarded (a stop as SIGTERM, `run.preempt_signal` as itself), a resume's files
//! committed once every rank accepted its plan, exits reaped (the first failure is the run's
//! cause), a stopped rank (SIGSTOP, a debugger) or a step that never ends blamed and killed, and
//! the ranks still running `run.abort_after_s` after the failure or the stop killed.
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

use super::spawn::{describe, is_stopped, Commit, Failure, Meeting, Outcome, Rank};
use crate::dist::{record_exit, Store};
use crate::plan::Plan;
use crate::rundir::position;

/// The first failure: its rank, how, when it was noticed and when it began (a stall: its start).
type FirstFailure = (usize, String, Instant, Instant);

pub(super) struct Supervisor<'a, 'c> {
    store: &'a Store,
    run_dir: &'a Path,
    first_rank: usize,
    per_node: usize,
    ranks: Vec<Rank>,
    commit: Option<Commit<'c>>,
    committed: bool,
    preempt_signal: i32,
    timeout: Duration,
    abort_after: Duration,
    launched: Instant,
    training_after: Option<Duration>,
    first_failure: Option<FirstFailure>,
    interrupted: Option<(i32, Instant)>,
    preempting: bool,
    /// The ranks killed because another failed, with where each was.
    killed: Vec<(usize, Option<String>)>,
    stopped_since: Vec<Option<Instant>>,
    stall_blamed: bool,
    watchdog: super::watchdog::Watchdog,
}

impl<'a, 'c> Supervisor<'a, 'c> {
    pub(super) fn new(
        plan: &Plan,
        meeting: &Meeting<'a>,
        run_dir: &'a Path,
        ranks: Vec<Rank>,
        commit: Option<Commit<'c>>,
    ) -> Supervisor<'a, 'c> {
        let run = &plan.config.run;
        Supervisor {
            store: meeting.store,
            run_dir,
            first_rank: meeting.first_rank,
            per_node: meeting.per_node,
            stopped_since: vec![None; ranks.len()],
            watchdog: super::watchdog::Watchdog::new(run, ranks.len()),
            ranks,
            committed: commit.is_none(),
            commit,
            preempt_signal: run.preempt_signal.number(),
            timeout: Duration::from_secs_f64(run.timeout_s),
            abort_after: Duration::from_secs_f64(run.abort_after_s),
            launched: Instant::now(),
            training_after: None,
            first_failure: None,
            interrupted: None,
            preempting: false,
            killed: Vec::new(),
            stall_blamed: false,
        }
    }

    /// One turn of the watch; `true` once every rank has ended.
    pub(super) fn turn(&mut self, tick: &mut dyn FnMut()) -> anyhow::Result<bool> {
        tick();
        self.forward_signals();
        self.commit_if_accepted();
        self.reap()?;
        if self.ranks.iter().all(|r| r.status.is_some()) {
            return Ok(true);
        }
        self.blame_a_stopped_rank()?;
        self.watch_steps()?;
        self.abort_if_due()?;
        Ok(false)
    }

    /// How a rank that was preempted exits.
    fn preempted_exit(&self) -> Option<i32> {
        Some(128 + self.preempt_signal)
    }

    fn forward_signals(&mut self) {
        if crate::signals::preempted() && !self.preempting && self.interrupted.is_none() {
            self.preempting = true;
            self.signal_running(Signal::try_from(self.preempt_signal).ok());
        }
        if let (Some(sig), None) = (crate::signals::stop(), self.interrupted) {
            self.interrupted = Some((sig, Instant::now()));
            self.signal_running(Some(Signal::SIGTERM));
        }
    }

    fn signal_running(&self, sig: Option<Signal>) {
        for rank in self.ranks.iter().filter(|r| r.status.is_none()) {
            let _ = signal::kill(Pid::from_raw(rank.child.id() as i32), sig);
        }
    }

    /// A resume's files, written once rank 0 said every rank accepted the plan; this node's
    /// answer goes into the store either way.
    fn commit_if_accepted(&mut self) {
        let accepted = self.store.contains(super::rank::ACCEPTED).unwrap_or(false);
        let Some(write) = self.commit.as_mut().filter(|_| accepted) else { return };
        let said = write().err().map(|e| format!("cannot write the resumed run's files: {e:#}"));
        self.committed = said.is_none();
        // This node's place among the job's (in an elastic round, among the round's nodes).
        let node = self.first_rank / self.per_node.max(1);
        let _ = self.store.set(&super::rank::committed(node), said.unwrap_or_default().as_bytes());
        self.commit = None;
    }

    fn reap(&mut self) -> anyhow::Result<()> {
        let preempted_exit = self.preempted_exit();
        for (local, rank) in self.ranks.iter_mut().enumerate() {
            if rank.status.is_some() {
                continue;
            }
            let Some(status) = rank.child.try_wait()? else { continue };
            rank.status = Some(status);
            // A rank exits so only once every rank agreed to stop after the same step and wrote
            // its part of the checkpoint, whoever was sent the signal.
            let preempted = status.code() == preempted_exit;
            if !status.success() && !preempted && self.first_failure.is_none() && self.interrupted.is_none() {
                let (r, how) = (self.first_rank + local, describe(status));
                // Peers blocked on this rank name it in their errors.
                let _ = record_exit(self.store, r, &how);
                self.first_failure = Some((r, how, Instant::now(), Instant::now()));
            }
        }
        Ok(())
    }

    /// A stopped rank stalls every collective: once it has been stopped for `run.timeout_s`, or
    /// when a peer fails meanwhile, it is the root cause and is killed.
    fn blame_a_stopped_rank(&mut self) -> anyhow::Result<()> {
        for (local, rank) in self.ranks.iter().enumerate() {
            let stopped = rank.status.is_none() && is_stopped(rank.child.id());
            self.stopped_since[local] = if stopped { self.stopped_since[local].or(Some(Instant::now())) } else { None };
        }
        if self.interrupted.is_some() || self.stall_blamed {
            return Ok(());
        }
        let stalled =
            self.stopped_since.iter().enumerate().filter_map(|(l, s)| s.map(|s| (l, s))).min_by_key(|(_, s)| *s);
        let Some((local, since)) = stalled else { return Ok(()) };
        let r = self.first_rank + local;
        let blame = match &self.first_failure {
            None => since.elapsed() >= self.timeout,
            Some((f, ..)) => *f != r,
        };
        if !blame {
            return Ok(());
        }
        let mut how = stopped_for(since);
        match &self.first_failure {
            Some((f, then, ..)) => how += &format!("; rank {f} then {then}"),
            // Peers blocked on this rank name it in their errors.
            None => drop(record_exit(self.store, r, &how)),
        }
        let at = self.first_failure.as_ref().map_or(Instant::now(), |f| f.2);
        self.first_failure = Some((r, how, at, since));
        self.stall_blamed = true;
        // A stopped rank cannot wind down: it goes now, and its peers' collectives fail at once
        // rather than at their own timeout.
        self.kill(local)
    }

    /// A rank stuck in one training step (computation that never ends) fails the run.
    fn watch_steps(&mut self) -> anyhow::Result<()> {
        if self.interrupted.is_some() || self.first_failure.is_some() {
            return Ok(());
        }
        let running: Vec<bool> = self.ranks.iter().map(|r| r.status.is_none()).collect();
        if let Some((local, how, since)) = self.watchdog.stalled(self.run_dir, self.first_rank, &running) {
            let r = self.first_rank + local;
            // The step that never ends may be a stopped rank's, caught here a moment before the
            // stop's own timeout: the stop is the cause.
            let how = self.stopped_since[local].map_or(how, stopped_for);
            // Peers blocked on this rank name it in their errors.
            let _ = record_exit(self.store, r, &how);
            self.kill(local)?;
            self.first_failure = Some((r, how, Instant::now(), since));
        }
        if self.training_after.is_none() && self.watchdog.all_training() {
            self.training_after = Some(self.launched.elapsed());
        }
        Ok(())
    }

    /// `run.abort_after_s` after the first failure or the stop, the ranks still running are
    /// killed (each but the cause recorded with where it was).
    fn abort_if_due(&mut self) -> anyhow::Result<()> {
        let since = self.first_failure.as_ref().map(|f| f.2).or(self.interrupted.map(|i| i.1));
        if since.is_none_or(|at| at.elapsed() < self.abort_after) {
            return Ok(());
        }
        let cause = self.first_failure.as_ref().map(|f| f.0);
        for local in 0..self.ranks.len() {
            if self.ranks[local].status.is_some() {
                continue;
            }
            self.kill(local)?;
            let r = self.first_rank + local;
            if cause != Some(r) {
                self.killed.push((r, position::read(self.run_dir, r)));
            }
        }
        Ok(())
    }

    fn kill(&mut self, local: usize) -> anyhow::Result<()> {
        let rank = &mut self.ranks[local];
        let _ = rank.child.kill();
        rank.status = Some(rank.child.wait()?);
        Ok(())
    }

    /// How the ranks ended (every one has).
    pub(super) fn outcome(self) -> Outcome {
        let ended = Instant::now();
        let (run_dir, first_rank) = (self.run_dir, self.first_rank);
        let ranks = &self.ranks;
        let failure = self.first_failure.map(|(rank, how, _, began)| Failure {
            rank,
            how,
            position: position::read(run_dir, rank),
            steps_done: position::read_done(run_dir, rank),
            detect: ended.saturating_duration_since(began),
            stderr_tail: ranks[rank - first_rank].tail.lock().unwrap().iter().cloned().collect(),
            killed: self.killed,
        });
        position::remove_all(run_dir, first_rank..first_rank + self.per_node);
        let preempted_exit = Some(128 + self.preempt_signal);
        let preempted = failure.is_none()
            && self.interrupted.is_none()
            && ranks.iter().any(|r| r.status.and_then(|s| s.code()) == preempted_exit);
        Outcome {
            failure,
            interrupted: self.interrupted.map(|i| i.0),
            preempted,
            started: true,
            training_after: self.training_after,
            committed: self.committed,
        }
    }
}

fn stopped_for(since: Instant) -> String {
    format!("was stopped (SIGSTOP or a debugger) for {:.1} s and stalled the job", since.elapsed().as_secs_f64())
}
