//! `runner run` as the launcher of this node's ranks: takes the run directory (over several
//! nodes, node 0 owns it: [`nodes`]), runs the ranks (restarting them after a failure as
//! `run.max_restarts` allows: [`restart`]; in rounds over the nodes of an elastic or restarted
//! multi-node run: [`elastic`]), and records how the run ended. A resume takes the run directory
//! only once every rank accepted its plan: one refused before leaves the directory as it was.
use std::path::Path;

use crate::checkpoint;
use crate::launch::agree;
use crate::launch::elastic::{self, Nodes};
use crate::launch::nodes;
use crate::launch::restart::{self, Supervised};
use crate::launch::slurm;
use crate::launch::spawn::{self, Topology};
use crate::plan::Plan;
use crate::rundir::lock::RunLock;
use crate::rundir::manifest::{Manifest, Status};

use super::resume::resumed_plan;
use super::run::{prepare_run_dir, Claim};

pub(super) fn launch(plan: &Plan, topology: &Topology, claim: Claim, run_dir: &Path) -> anyhow::Result<u8> {
    announce(plan, run_dir);
    announce_nodes(plan, topology);
    follow_sweep()?;
    // Over several nodes, restarts and a changing world size run in rounds that node 0 hosts.
    let nodes = Nodes { min: topology.min_nodes, max: topology.nnodes };
    let rounds = nodes.max > 1 && (nodes.min < nodes.max || plan.config.run.max_restarts > 0);
    if let (true, Some((addr, port))) = (rounds && topology.node_rank != 0, &topology.master) {
        return elastic::follow(plan, topology.node_rank, (addr, *port), nodes, run_dir);
    }
    let mut manifest = plan.manifest();
    // A run continued after a preemption goes on with its history of failures and restarts.
    match Manifest::read_raw(run_dir) {
        Ok(Some(earlier)) if claim.resume && earlier.status == Status::Preempted => manifest.carry_history(&earlier),
        _ => {}
    }
    // A fresh run's files are written here; a resume's once its ranks accepted it.
    let (lock, met) = match take_run_dir(plan, topology, rounds, run_dir, &manifest, claim)? {
        Taken::Lock(lock, met) => (lock, met),
        Taken::Ended(code) => return Ok(code),
    };
    let resumed = |plan: &Plan| -> anyhow::Result<Option<(Plan, usize)>> {
        let Some(found) = checkpoint::newest_unread(run_dir, plan).map_err(anyhow::Error::msg)? else {
            return Ok(None);
        };
        let step = found.record().step;
        // A run that failed after its last checkpoint has only its model left to write.
        let next = if step >= plan.total_steps() { plan.clone() } else { resumed_plan(run_dir, plan)? };
        Ok(Some((next, step)))
    };
    let at_size = |plan: &Plan, world: usize| -> anyhow::Result<(Plan, bool)> {
        let asked = elastic::resized(plan, world)?;
        if checkpoint::newest_unread(run_dir, plan).map_err(anyhow::Error::msg)?.is_some() {
            return Ok((resumed_plan(run_dir, &asked)?, true));
        }
        // No checkpoint yet: the run starts over at this size, still as the run it is
        // ([`elastic::resized`] keeps its id and the values it started with).
        Ok((asked, false))
    };
    let (supervised, committed) = if rounds {
        let (addr, port) = topology.master.clone().expect("several nodes have a master");
        let mut host = elastic::Host::serve(plan, (&addr, port), nodes, run_dir, lock.token(), &at_size)?;
        let mut attempts =
            restart::Attempts { run_dir, topology, resumed: &resumed, attempt: &mut host, committed: !claim.resume };
        let supervised = restart::supervise(plan.clone(), claim.resume, &mut manifest, &mut attempts);
        let committed = attempts.committed;
        if let Ok(s) = &supervised {
            let o = &s.outcome;
            let complete = o.failure.is_none() && o.interrupted.is_none() && !o.preempted;
            host.finish(if complete { "the run is complete".into() } else { "the run ended".into() }, complete);
        }
        (supervised, committed)
    } else {
        let mut local = restart::Local { run_dir, topology, met };
        let mut attempts =
            restart::Attempts { run_dir, topology, resumed: &resumed, attempt: &mut local, committed: !claim.resume };
        (restart::supervise(plan.clone(), claim.resume, &mut manifest, &mut attempts), attempts.committed)
    };
    match supervised {
        // A resume refused before every rank accepted it (a preemption then still writes its
        // checkpoint's step, as a run's own).
        Ok(s) if !committed && !s.outcome.preempted => refused_resume(&s.outcome, run_dir),
        Ok(s) => ended(s, manifest, topology, run_dir),
        Err(e) if !committed => Err(e.context(unchanged(run_dir))),
        Err(e) => {
            manifest.end(Status::Failed, Some(format!("{e:#}")));
            manifest.account(run_dir);
            manifest.write(run_dir)?;
            Err(e)
        }
    }
}

/// Over several nodes: how many, which this is, and where node 0 is.
fn announce_nodes(plan: &Plan, topology: &Topology) {
    if let Some((addr, port)) = topology.master.as_ref().filter(|_| topology.nnodes > 1) {
        let from = topology.engine.as_ref().map(|e| format!(", from {e}")).unwrap_or_default();
        crate::say!(
            "nodes: {} × {} ranks, this is node {}; node 0 at {addr}:{port}{from}",
            topology.nnodes,
            plan.world_size() / topology.nnodes,
            topology.node_rank
        );
    }
}

/// A run started by `runner sweep` ends with it (even by SIGKILL): an error if it has ended already.
fn follow_sweep() -> anyhow::Result<()> {
    if let Some(sweep) = std::env::var(crate::launch::env::SWEEP_PID).ok().and_then(|p| p.parse::<i32>().ok()) {
        let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM);
        if nix::unistd::getppid().as_raw() != sweep {
            return Err(anyhow::anyhow!("the sweep that started this run has ended"));
        }
    }
    Ok(())
}

/// How this node's launcher took its run directory.
enum Taken {
    /// It owns it (node 0's, or this node's own): the lock it holds, and the store where it met
    /// the other nodes of a fixed-size run.
    Lock(RunLock, Option<spawn::Met>),
    /// This node ended: its ranks ran in node 0's directory, or a signal came first. The exit code.
    Ended(u8),
}

/// Takes the run directory ([`prepare_run_dir`]). Over the nodes of a fixed-size run (not in
/// `rounds`), the nodes meet first: node 0 says whether it took its directory; another node runs
/// its ranks in node 0's directory when its `--out` is that one ([`nodes::follow`]), and
/// otherwise takes its own. A node refused its directory refuses the run on every node.
fn take_run_dir(
    plan: &Plan,
    topology: &Topology,
    rounds: bool,
    run_dir: &Path,
    manifest: &Manifest,
    claim: Claim,
) -> anyhow::Result<Taken> {
    if topology.nnodes == 1 || rounds {
        return Ok(Taken::Lock(prepare_run_dir(plan, run_dir, manifest, claim)?, None));
    }
    let timeout = std::time::Duration::from_secs_f64(plan.config.run.timeout_s);
    let met = match spawn::rendezvous(topology, plan.world_size(), timeout) {
        Ok(met) => met,
        Err(e) => return before_any_rank(e).map(Taken::Ended),
    };
    let me = topology.node_rank;
    if me == 0 {
        return match prepare_run_dir(plan, run_dir, manifest, claim) {
            Ok(lock) => {
                let file = restart::pending_plan_file(run_dir, claim.resume);
                nodes::took(&met, lock.token(), &file, claim.resume)?;
                Ok(Taken::Lock(lock, Some(met)))
            }
            Err(e) => {
                nodes::refused(&met, &format!("{e:#}"), topology.nnodes);
                Err(e)
            }
        };
    }
    let role = match nodes::role(&met, run_dir, me) {
        Ok(role) => role,
        Err(e) => return before_any_rank(e).map(Taken::Ended),
    };
    match role {
        nodes::Role::Shared(taken) => Ok(Taken::Ended(nodes::follow(plan, topology, met, run_dir, &taken)?)),
        nodes::Role::Own => {
            match nodes::own_run_dir(plan, run_dir).and_then(|()| prepare_run_dir(plan, run_dir, manifest, claim)) {
                Ok(lock) => Ok(Taken::Lock(lock, Some(met))),
                Err(e) => {
                    let parties = agree::Parties { label: "node", me, count: topology.nnodes };
                    agree::refuse(&met.store, parties, &format!("{e:#}"));
                    Err(e)
                }
            }
        }
    }
}

/// A rendezvous that ended before any directory was taken: by a signal (said, with its exit
/// code), or with the error.
fn before_any_rank(e: anyhow::Error) -> anyhow::Result<u8> {
    let Some(i) = crate::signals::interruption() else { return Err(e) };
    crate::say_err!("\ninterrupted by {} before any rank started: nothing was written", crate::signals::name(i.signal));
    Ok(128 + i.signal as u8)
}

/// What a run says before its ranks start: the plan (with its run id), its notes and where it
/// tracks. Said by the launcher, or by rank 0 under torchrun or srun.
pub(super) fn announce(plan: &Plan, run_dir: &Path) {
    crate::say!("{}", plan.data_flow());
    let device = crate::device::notes(plan.config.run.device);
    for note in plan.data.notes().iter().cloned().chain(crate::numerics::notes()).chain(device) {
        crate::say!("{note}");
    }
    for line in crate::stages::track::plan_lines(plan, Some(run_dir)) {
        crate::say!("{line}");
    }
}

/// Records how the run ended, says it, and gives the exit code.
fn ended(supervised: Supervised, mut manifest: Manifest, topology: &Topology, run_dir: &Path) -> anyhow::Result<u8> {
    let Supervised { plan, outcome, not_retried } = supervised;
    if outcome.preempted {
        // The newest checkpoint: the one the ranks just wrote, or, when the signal came before
        // any rank started, the one a resumed run started from (none: the run starts over).
        let step = checkpoint::newest_unread(run_dir, &plan).ok().flatten().map(|f| f.record().step);
        manifest.end(Status::Preempted, None);
        manifest.preempted_at_step = step;
        manifest.write(run_dir)?;
        let said = match (outcome.started, step) {
            (true, Some(step)) => format!("preempted at step {step}: checkpoint written"),
            (false, Some(step)) => format!("preempted before any rank started: it resumes from step {step}"),
            (_, None) => "preempted before its first checkpoint".to_owned(),
        };
        // One requeue per job: node 0's launcher asks for it.
        match topology.node_rank {
            0 => slurm::requeue(&said, step.is_some(), run_dir),
            _ => crate::say_err!("{said}; node 0 says how the run goes on"),
        }
        return Ok(128 + plan.config.run.preempt_signal.number() as u8);
    }
    if let Some(sig) = outcome.interrupted {
        manifest.end(Status::Interrupted, None);
        manifest.write(run_dir)?;
        let what = if outcome.started {
            format!("every rank was stopped; the trace keeps every finished {}", trace_unit(&plan.config))
        } else {
            "no rank had started; nothing was written but the run's configuration".to_owned()
        };
        crate::say_err!("\ninterrupted by {}: {what} in {}", crate::signals::name(sig), run_dir.display());
        return Ok(128 + sig as u8);
    }
    let restarts = format!("{} restart{}", manifest.restarts.len(), plural(manifest.restarts.len()));
    let Some(f) = &outcome.failure else {
        manifest.end(Status::Complete, None);
        manifest.stopped(run_dir, &plan.config.train);
        manifest.account(run_dir);
        manifest.write(run_dir)?;
        if let Some(g) = &manifest.goodput {
            crate::say!("  {restarts}; {}", g.line(manifest.failures.len()));
        }
        crate::say!("  run directory: {}", run_dir.display());
        return Ok(0);
    };
    let summary = match &not_retried {
        None => f.summary(),
        Some(why) => {
            let earlier: Vec<String> =
                manifest.failures[..manifest.failures.len() - 1].iter().map(|f| f.summary()).collect();
            format!("{}; not restarted: {why}; earlier failures ({restarts}): {}", f.summary(), earlier.join("; "))
        }
    };
    manifest.end(Status::Failed, Some(summary.clone()));
    manifest.account(run_dir);
    manifest.write(run_dir)?;
    crate::say_err!("\nerror: the run failed: {summary}");
    if !f.stderr_tail.is_empty() {
        crate::say_err!("  last lines rank {} wrote to stderr:", f.rank);
        for line in &f.stderr_tail {
            crate::say_err!("    {line}");
        }
    }
    crate::say_err!("  run directory (traces keep every finished {}): {}", trace_unit(&plan.config), run_dir.display());
    Ok(1)
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// What a trace row counts, as the interrupt and failure messages name it: an epoch, or an
/// interval of optimizer steps (a run in `train.steps` writes a row every `validate.every_steps`).
fn trace_unit(c: &crate::config::schema::Config) -> String {
    match c.train.steps {
        None => "epoch".into(),
        Some(total) => {
            let every = c.validate.every_steps.unwrap_or(total);
            format!("interval of {every} optimizer step{}", if every == 1 { "" } else { "s" })
        }
    }
}

/// What a resume that ended before its ranks accepted its plan left: the run directory as it was.
fn unchanged(run_dir: &Path) -> String {
    let status = Manifest::read(run_dir).map_or("its".to_owned(), |m| format!("{:?}", m.status).to_lowercase());
    format!(
        "the resume stopped before every rank had accepted its plan: {} is as it was (still {status}, its plan, \
         configuration, trace and checkpoints untouched)",
        run_dir.display()
    )
}

/// How a resume ended that never had every rank accept its plan (a rank refused it or failed
/// loading the checkpoint, or a signal came first): said, with the directory left as it was.
fn refused_resume(outcome: &spawn::Outcome, run_dir: &Path) -> anyhow::Result<u8> {
    if let Some(sig) = outcome.interrupted {
        crate::say_err!("\ninterrupted by {}: {}", crate::signals::name(sig), unchanged(run_dir));
        return Ok(128 + sig as u8);
    }
    match &outcome.failure {
        Some(f) => {
            crate::say_err!("\nerror: the resume failed: {}", f.summary());
            if !f.stderr_tail.is_empty() {
                crate::say_err!("  last lines rank {} wrote to stderr:", f.rank);
                for line in &f.stderr_tail {
                    crate::say_err!("    {line}");
                }
            }
            crate::say_err!("  {}", unchanged(run_dir));
            Ok(1)
        }
        None => {
            crate::say_err!("\nerror: {}", unchanged(run_dir));
            Ok(1)
        }
    }
}
