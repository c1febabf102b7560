//! Automatic restarts (`run.max_restarts`). When a rank fails, [`spawn`] ends the others as it
//! always does; the launcher then records the failure in the manifest and starts every rank
//! again, in the same run directory, from its newest complete checkpoint (from the start when it
//! has none yet). The trace goes on from the checkpoint's rows. A failure that repeats one seen
//! before (the same cause at the same step, in the same place: a NaN, a bad batch, a module that
//! raises) is not retried, and after `run.max_restarts` restarts the run fails, naming every
//! failure. What each failure cost (detection, restart, steps computed twice) goes into the
//! manifest ([`crate::rundir::goodput`]).
//!
//! Every attempt that resumes, the user's `--resume` and a restart alike, commits as one: its ranks
//! run the plan from a temporary file, and plan.json, config.toml and the manifest take it only
//! once every rank accepted the plan and loaded the checkpoint ([`Plan::commit_run_dir`]).
//! A restart's failure and the restart itself go into the manifest at once (the run is under way);
//! a restart whose ranks fail before accepting its plan is one more failure of the run. The user's
//! own resume refused so is not retried: the run directory stays as it was.
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::spawn::{self, Outcome, Topology};
use crate::plan::Plan;
use crate::rundir::manifest::{FailureRecord, Manifest, RestartRecord, Status};
use crate::rundir::{self, position};

/// The plan that continues `plan`'s run from the run directory's newest checkpoint, with that
/// checkpoint's step; `None` when there is no checkpoint yet.
pub type Resumed<'a> = &'a dyn Fn(&Plan) -> anyhow::Result<Option<(Plan, usize)>>;

/// How the run directory is continued after a failure.
pub struct Attempts<'a> {
    pub run_dir: &'a Path,
    pub topology: &'a Topology,
    pub resumed: Resumed<'a>,
    /// What runs the ranks once: [`Local`], or an elastic round ([`super::elastic`]).
    pub attempt: &'a mut dyn Attempt,
    /// Whether the run directory holds this run's files: a fresh run's from the start, a
    /// resumed one's once the ranks of an attempt accepted its plan.
    pub committed: bool,
}

/// One attempt at running the ranks.
pub trait Attempt {
    /// Runs `plan` (from the run directory's newest checkpoint when `resume`) until every rank of
    /// this node has ended; returns the plan that ran (an elastic round may resize it) and how the
    /// ranks ended. A resume writes the run directory's files, `manifest` among them, once every
    /// rank accepted the plan ([`pending_plan`]). What writes cut short left is removed.
    fn run(&mut self, plan: Plan, resume: bool, manifest: &mut Manifest) -> anyhow::Result<(Plan, Outcome)>;
}

/// This node's ranks, with a store of their own each attempt.
pub struct Local<'a> {
    pub run_dir: &'a Path,
    pub topology: &'a Topology,
    /// The other nodes' store, where the launcher met them before it took the run directory
    /// ([`super::nodes`]): the first attempt's.
    pub met: Option<spawn::Met>,
}

impl Attempt for Local<'_> {
    fn run(&mut self, plan: Plan, resume: bool, manifest: &mut Manifest) -> anyhow::Result<(Plan, Outcome)> {
        let args = child_args(&pending_plan(self.run_dir, &plan, resume)?, self.run_dir, resume);
        let mut write = || plan.commit_run_dir(self.run_dir, manifest);
        let commit: Option<spawn::Commit> = resume.then_some(&mut write);
        let met = self.met.take();
        let outcome = launch_guarded(|| spawn::launch(&plan, self.topology, self.run_dir, &args, commit, met));
        rundir::remove_unfinished(self.run_dir);
        Ok((plan, outcome?))
    }
}

/// How the run ended after its attempts.
pub struct Supervised {
    /// The last attempt's plan (a restart may have resumed under another layout).
    pub plan: Plan,
    pub outcome: Outcome,
    /// Why a failure was not retried: the same failure again, or no restart left (`None` where
    /// the run did not fail, or restarts are off).
    pub not_retried: Option<String>,
}

/// Launches this node's ranks of `plan` (resuming from the newest checkpoint when `resume`) and
/// restarts them after a failure as `run.max_restarts` allows, keeping `manifest` up to date.
pub fn supervise(
    plan: Plan,
    resume: bool,
    manifest: &mut Manifest,
    attempts: &mut Attempts,
) -> anyhow::Result<Supervised> {
    let (run_dir, topology) = (attempts.run_dir, attempts.topology);
    let (mut plan, mut resume) = (plan, resume);
    let mut from_step = if resume { newest_step(run_dir, &plan) } else { 0 };
    // After a restart: when every rank of the failed attempt had stopped, and its record.
    let mut restarting: Option<(Instant, usize)> = None;
    let mut restarts = 0;
    loop {
        let began = Instant::now();
        let (ran, outcome) = attempts.attempt.run(plan, resume, manifest)?;
        plan = ran;
        attempts.committed |= outcome.committed;
        if !attempts.committed {
            // The user's resume, refused before every rank accepted it: nothing is retried or
            // recorded (the launcher says so, the run directory as it was).
            return Ok(Supervised { plan, outcome, not_retried: None });
        }
        if let Some((down, i)) = restarting.take() {
            let waited = began.duration_since(down);
            manifest.restarts[i].restart_s = outcome.training_after.map(|t| (waited + t).as_secs_f64());
            manifest.restarts[i].world_size = plan.world_size();
        }
        let Some(f) = outcome.failure.as_ref().filter(|_| outcome.interrupted.is_none() && !outcome.preempted) else {
            return Ok(Supervised { plan, outcome, not_retried: None });
        };
        let down = Instant::now();
        let steps_done = f.steps_done.unwrap_or(from_step).max(from_step);
        let failure = FailureRecord {
            rank: Some(f.rank),
            node: node_name(topology),
            cause: f.cause(),
            position: f.position.clone(),
            step: steps_done,
            at: now(),
            detect_s: Some(f.detect.as_secs_f64()),
        };
        let seen = manifest.failures.iter().find(|old| old.repeats(&failure)).cloned();
        manifest.failures.push(failure);
        let max = plan.config.run.max_restarts;
        let not_retried = match (seen, max) {
            (_, 0) => None,
            (Some(seen), _) => {
                Some(format!("it failed the same way before (at {}): a failure that repeats is not retried", seen.at))
            }
            (None, max) if restarts >= max => Some(format!("no restart left (run.max_restarts = {max})")),
            (None, _) => match restart_from(&plan, steps_done, manifest, attempts)? {
                Err(why) => Some(why),
                Ok((next, step)) => {
                    restarts += 1;
                    let from = match step {
                        0 => "from the start (no checkpoint yet)".to_owned(),
                        s => format!("from the checkpoint of step {s}"),
                    };
                    let failure = manifest.failures.last().expect("pushed").summary();
                    crate::say_err!("\n{failure}; restarting every rank {from} (restart {restarts} of {max})");
                    restarting = Some((down, manifest.restarts.len() - 1));
                    (plan, resume, from_step) = (next, step > 0, step);
                    continue;
                }
            },
        };
        manifest.write(run_dir)?;
        return Ok(Supervised { plan, outcome, not_retried });
    }
}

/// Makes the run directory ready for a restart after a failure at `steps_done` steps: the plan
/// that goes on from the newest checkpoint, or from the start where there is none yet, with that
/// checkpoint's step; the restart recorded in `manifest`, written at once. `Err` says why the run
/// cannot restart (its checkpoint does not verify, the plan is refused).
fn restart_from(
    plan: &Plan,
    steps_done: usize,
    manifest: &mut Manifest,
    attempts: &Attempts,
) -> anyhow::Result<Result<(Plan, usize), String>> {
    let (next, step) = match (attempts.resumed)(plan) {
        Ok(Some((next, step))) => (next, step),
        Ok(None) => (plan.clone(), 0),
        Err(e) => return Ok(Err(format!("it cannot restart: {e:#}"))),
    };
    start_over_unless(step > 0, &next, attempts.run_dir)?;
    manifest.restarts.push(RestartRecord {
        at: now(),
        by: "runner".into(),
        from_step: step,
        world_size: next.world_size(),
        recomputed_steps: steps_done.saturating_sub(step),
        restart_s: None,
    });
    manifest.reshards = next.reshards.clone();
    manifest.write(attempts.run_dir)?;
    Ok(Ok((next, step)))
}

/// Saves the plan an attempt's ranks run and returns its file: plan.json for a fresh start; for
/// a resume, a temporary file beside it, which the run directory takes as plan.json once every
/// rank accepted it (and which goes, as every temporary file, once the attempt ended).
pub fn pending_plan(run_dir: &Path, plan: &Plan, resume: bool) -> anyhow::Result<PathBuf> {
    let file = pending_plan_file(run_dir, resume);
    plan.save(&file)?;
    Ok(file)
}

/// The file [`pending_plan`] saves the plan to.
pub fn pending_plan_file(run_dir: &Path, resume: bool) -> PathBuf {
    let file = run_dir.join(rundir::PLAN);
    if resume {
        rundir::tmp_path(&file)
    } else {
        file
    }
}

/// The arguments of this node's ranks: every rank runs the plan resolved here (`plan_file`),
/// never the pipeline file again.
pub fn child_args(plan_file: &Path, run_dir: &Path, resume: bool) -> Vec<OsString> {
    vec![
        "run".into(),
        "--plan".into(),
        plan_file.into(),
        if resume { "--resume" } else { "--out" }.into(),
        run_dir.into(),
    ]
}

/// A launch whose panic is a failed run, as any error is.
pub fn launch_guarded(launch: impl FnOnce() -> anyhow::Result<Outcome>) -> anyhow::Result<Outcome> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(launch))
        .unwrap_or_else(|panic| Err(anyhow::anyhow!("the launcher panicked: {}", crate::checked::panic_text(&panic))))
}

/// Before a restart: without a checkpoint (`resuming` false), the run starts over, so what the
/// failed attempt wrote goes (the run's own files only) and the plan and configuration are
/// written again; with one, the plan that goes on from it is committed by the attempt, once
/// every rank accepted it.
fn start_over_unless(resuming: bool, plan: &Plan, run_dir: &Path) -> anyhow::Result<()> {
    if !resuming {
        rundir::clear_for_fresh_run(run_dir);
        rundir::atomic_write(&run_dir.join(rundir::CONFIG), plan.annotated_toml().as_bytes())?;
        plan.save(&run_dir.join(rundir::PLAN))?;
    }
    position::remove_all(run_dir, 0..plan.world_size());
    Ok(())
}

/// The step of the newest checkpoint in `run_dir` (0 when there is none).
fn newest_step(run_dir: &Path, plan: &Plan) -> usize {
    crate::checkpoint::newest_unread(run_dir, plan).ok().flatten().map_or(0, |f| f.record().step)
}

/// This host's name, with its node index in a multi-node run.
fn node_name(topology: &Topology) -> String {
    let host = crate::rundir::manifest::hostname();
    match topology.nnodes {
        1 => host,
        _ => format!("node {} ({host})", topology.node_rank),
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Under torchrun or srun, which start the ranks again themselves (`by`: "torchrun", "slurm"),
/// rank 0 of the new attempt records in `manifest` the history of `earlier` (the run directory's
/// manifest of the attempt before), that attempt's failure where its rank 0 could not record it
/// (it was killed: the manifest was left running), and this restart from `from_step`.
pub fn record_relaunch(manifest: &mut Manifest, earlier: &Manifest, by: &str, from_step: usize, run_dir: &Path) {
    manifest.carry_history(earlier);
    // The furthest any rank of the failed attempt got.
    let reached = (0..earlier.world_size).filter_map(|r| position::read_done(run_dir, r)).max();
    if matches!(earlier.status, Status::Running | Status::Crashed) {
        manifest.failures.push(FailureRecord {
            rank: None,
            node: earlier.host.clone(),
            cause: "the ranks ended without saying why (rank 0 was killed)".into(),
            position: None,
            step: reached.unwrap_or(from_step),
            at: earlier.ended_at.clone().unwrap_or_else(now),
            detect_s: None,
        });
    }
    let failed_at = manifest.failures.last().map_or(from_step, |f| f.step).max(reached.unwrap_or(0));
    let at = now();
    // Until this rank 0 started: the launcher's own time to restart (torchrun's, Slurm's requeue).
    let restart_s = manifest.failures.last().and_then(|f| crate::rundir::goodput::seconds_between(&f.at, &at));
    manifest.restarts.push(RestartRecord {
        at,
        by: by.into(),
        from_step,
        world_size: manifest.world_size,
        recomputed_steps: failed_at.saturating_sub(from_step),
        restart_s,
    });
}

/// Under torchrun or srun, rank 0's account of a failed attempt (its own error, which names the
/// rank it lost when another failed first), recorded in `manifest`. Returns whether it repeats
/// a failure recorded before.
pub fn record_rank0_failure(manifest: &mut Manifest, run_dir: &Path, error: &str) -> bool {
    let failure = FailureRecord {
        rank: None,
        node: node_name(&Topology::single()),
        cause: format!("rank 0: {}", error.lines().next().unwrap_or(error)),
        position: position::read(run_dir, 0),
        step: position::read_done(run_dir, 0).unwrap_or(0),
        at: now(),
        detect_s: None,
    };
    let repeated = manifest.failures.iter().any(|old| old.repeats(&failure));
    manifest.failures.push(failure);
    repeated
}
