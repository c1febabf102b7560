//! `runner run`: as the launcher of this node's ranks, or as one rank (of runner's own launcher,
//! torchrun or srun).
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::checkpoint;
use crate::config::{self, ConfigError};
use crate::launch::agree;
use crate::launch::env::{Launcher, RankEnv};
use crate::launch::rank;
use crate::launch::restart;
use crate::launch::slurm;
use crate::plan::device_memory::DeviceMemory;
use crate::plan::Plan;
use crate::rundir;
use crate::rundir::lock::{self, RunLock};
use crate::rundir::manifest::{Manifest, Status};
use crate::stages::preempt;
use crate::trace::{view, EpochRow};

use super::resume::{preempted_plan, restarted_plan, resumed_plan, say_resuming};
use super::{overrides, warn_of_slow_bf16, ConfigArgs, RunArgs};
use crate::checked::panic_text;

pub(super) fn run(args: &RunArgs) -> anyhow::Result<u8> {
    let claim = Claim { resume: args.resume.is_some(), force: args.force };
    if let Some(path) = &args.plan {
        // A rank of runner's own launcher: the launcher resolved and saved the plan.
        let run_dir = args.resume.clone().or(args.out.clone()).context("--plan needs --out or --resume")?;
        let env = RankEnv::from_env()?.context("--plan is for the ranks `runner run` starts (RANK is not set)")?;
        return run_rank(Plan::load(path)?, &env, &|_| run_dir.clone(), claim);
    }
    if let Some(dir) = &args.resume {
        super::resume::check_run_dir(dir)?;
    }
    let file = match (&args.file, &args.resume) {
        (Some(f), _) => f.clone(),
        (None, Some(dir)) => dir.join(rundir::CONFIG),
        (None, None) => unreachable!("clap requires FILE without --resume"),
    };
    let config = ConfigArgs { file, set: args.set.clone(), set_as: args.set_as.clone() };
    let resolved = config::resolve(&config.file, &overrides(&config.set, &config.set_as))?;
    let saved = args.resume.as_ref().and_then(|dir| Plan::load(&dir.join(rundir::PLAN)).ok().map(|p| (dir, p)));
    let asked = match saved {
        Some((dir, saved)) => {
            saved.check_resumable_world_size(&resolved.config)?;
            let own_config = format!("file {}", dir.join(rundir::CONFIG).display());
            Plan::resuming(resolved, &crate::plan::Resuming { global_batch: saved.global_batch(), own_config })?
        }
        None => Plan::new(resolved)?,
    };
    let plan = match &args.resume {
        Some(dir) => resumed_plan(dir, &asked)?,
        None => asked,
    };
    // The run directory of a plan: under torchrun or srun, rank 0's plan names it for every rank.
    let run_dir_of = |plan: &Plan| {
        args.resume
            .clone()
            .or(args.out.clone())
            .unwrap_or_else(|| Path::new("results").join(&plan.config.run.name).join(&plan.run_id))
    };
    if let Some(env) = RankEnv::from_env()? {
        return run_rank(plan, &env, &run_dir_of, claim);
    }
    let dir = run_dir_of(&plan);
    let (plan, claim) = match preempted_plan(&dir, &plan, claim)? {
        Some(resumed) => (resumed, Claim { resume: true, ..claim }),
        None => (plan, claim),
    };
    if claim.resume {
        say_resuming(&dir);
    }
    let topology = args.topology(plan.world_size())?;
    warn_of_slow_bf16(&plan);
    super::launcher::launch(&plan, &topology, claim, &dir)
}

/// How a run takes its directory.
#[derive(Debug, Clone, Copy)]
pub(super) struct Claim {
    pub resume: bool,
    pub force: bool,
}

/// This process is one rank. Under runner's own launcher the launcher owns the run directory
/// (config.toml, the manifest, the lock) and resolved the plan; under another launcher (torchrun,
/// srun) rank 0 does both, and every rank runs rank 0's plan or refuses, naming the keys that
/// differ ([`agree`]).
fn run_rank(plan: Plan, env: &RankEnv, run_dir_of: &dyn Fn(&Plan) -> PathBuf, claim: Claim) -> anyhow::Result<u8> {
    if let Some(pid) = env.launcher_pid {
        rank::die_with_launcher(pid);
    }
    preempt::watch(plan.config.run.preempt_signal);
    // Before the rendezvous: a rank that would be refused says why at once, not after waiting
    // for ranks that were never started.
    rank::check_world_size(&plan, env)?;
    let timeout = std::time::Duration::from_secs_f64(plan.config.run.timeout_s);
    let store = std::sync::Arc::new(rank::open_store(env, timeout)?);
    // Each rank's host, which rank 0 records in the manifest under torchrun or srun.
    store.set(&host_key(env.rank), crate::rundir::manifest::hostname().as_bytes())?;
    let hosts_store = store.clone();
    // Rank 0 under torchrun or srun: whether this attempt goes on after a failure of the run.
    let restarting = std::cell::Cell::new(false);
    let (agreed, owned) = if env.launcher == Launcher::Runner {
        (agree::Agreed { plan, resume: claim.resume }, None)
    } else {
        let parties = agree::Parties { label: "rank", me: env.rank, count: env.world_size };
        agree::rank0_plan(&store, &plan, parties, |plan| {
            rank::check_world_size(plan, env)?;
            claim_as_rank0(plan, env, &run_dir_of(plan), claim, &restarting)
        })?
    };
    let agree::Agreed { plan, resume } = agreed;
    let run_dir = run_dir_of(&plan);
    if env.rank == 0 && env.launcher != Launcher::Runner {
        super::launcher::announce(&plan, &run_dir);
    }
    let (_lock, mut manifest) = owned.unzip();
    // A fresh run's directory took its files before any rank started; a resume's take them once
    // every rank accepted the plan (rank 0 owns them here, under torchrun or srun).
    let committed = std::cell::Cell::new(!resume);
    let write = || {
        let m = manifest.as_ref().expect("rank 0 owns the run directory");
        plan.commit_run_dir(&run_dir, m)?;
        committed.set(true);
        Ok(())
    };
    let commit = match (env.launcher, &manifest) {
        (Launcher::Runner, _) => rank::Commit::Launcher,
        (_, Some(_)) => rank::Commit::Here(&write),
        (_, None) => rank::Commit::Elsewhere,
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rank::run(&plan, env, store, &run_dir, resume, commit)
    }))
    .unwrap_or_else(|panic| Err(panic_error(panic, env.rank)));
    let preempted = result.as_ref().err().and_then(|e| e.downcast_ref::<preempt::Preempted>()).copied();
    let mut requeue = None;
    // A resume refused before every rank accepted it leaves the run's manifest as it was; a
    // restart after a failure (torchrun's, a requeued srun job's) records its own failure there.
    if let Some(manifest) = manifest.as_mut().filter(|_| committed.get() || restarting.get()) {
        manifest.hosts = rank_hosts(&hosts_store, env.world_size);
        requeue = record_end(manifest, &plan, env, &run_dir, &result, preempted);
        manifest.account(&run_dir);
        manifest.write(&run_dir)?;
    }
    match requeue {
        // Under srun rank 0 owns the run and requeues the job (the requeued one resumes).
        Some(Ok(resumable)) => slurm::requeue("a rank failed", resumable, &run_dir),
        Some(Err(why)) => crate::say_err!("a rank failed; the job is not requeued: {why}"),
        None => {}
    }
    if let Some(p) = preempted {
        // Under srun rank 0 owns the run, and requeues the job once; under runner's launcher,
        // the launcher does.
        if manifest.is_some() {
            slurm::requeue(&format!("preempted at step {}: checkpoint written", p.step), true, &run_dir);
        }
        return Ok(128 + plan.config.run.preempt_signal.number() as u8);
    }
    let rows = result?;
    if env.rank == 0 {
        summary(&plan, env, &rows, &run_dir);
    }
    Ok(0)
}

/// A rank's panic as its error: a model's failed forward pass (a user's module raised) by its own
/// message.
fn panic_error(panic: Box<dyn std::any::Any + Send>, rank: usize) -> anyhow::Error {
    match panic.downcast::<crate::checked::Failure>() {
        Ok(failure) => anyhow::anyhow!(failure.0),
        Err(panic) if crate::checked::is_out_of_memory(&panic_text(&panic)) => {
            anyhow::anyhow!("ran {}", crate::checked::panic_report(&panic))
        }
        Err(panic) => anyhow::anyhow!("rank {rank} panicked: {}", panic_text(&panic)),
    }
}

/// Rank 0's summary at the end of a run: the epochs, memory, the pipeline's ranks, the loss's chart.
fn summary(plan: &Plan, env: &RankEnv, rows: &[EpochRow], run_dir: &Path) {
    let by_step = plan.config.train.steps.is_some();
    crate::say!("\n{}", view::epoch_table(rows, by_step));
    let memory = view::memory_line(rows, plan.memory.as_ref(), &plan.memory_by_rank);
    if !memory.is_empty() {
        crate::say!("{memory}\n");
    }
    let pipeline = view::pipeline_table(rows);
    if !pipeline.is_empty() {
        crate::say!("  per rank, mean of the epochs (bubble: share of the training time spent waiting in send/recv)\n{pipeline}");
    }
    let losses: Vec<f64> = rows.iter().filter(|r| r.rank == 0).map(|r| r.global_train_loss).collect();
    let unit = match (by_step, plan.config.validate.every_steps) {
        (false, _) => "epochs".to_owned(),
        (true, Some(n)) => format!("validations (every {n} steps)"),
        (true, None) => "validations".to_owned(),
    };
    crate::say!("  loss\n{}", view::chart(&unit, &losses, 6));
    if let Some(line) =
        crate::device::peak_line(plan.device(env.local_rank), DeviceMemory::of(plan).map(|e| e.to_string()))
    {
        crate::say!("{line}");
    }
    if env.launcher != Launcher::Runner {
        crate::say!("  run directory: {}", run_dir.display());
    }
}

/// How the run ended, into rank 0's manifest; under srun with restarts left, whether to requeue
/// the job (`Ok(whether it resumes from a checkpoint)`) or why not.
fn record_end(
    manifest: &mut Manifest,
    plan: &Plan,
    env: &RankEnv,
    run_dir: &Path,
    result: &anyhow::Result<Vec<EpochRow>>,
    preempted: Option<preempt::Preempted>,
) -> Option<Result<bool, &'static str>> {
    let mut requeue = None;
    match (result, preempted) {
        (Ok(_), _) => {
            manifest.end(Status::Complete, None);
            manifest.stopped(run_dir, &plan.config.train);
        }
        (Err(_), Some(p)) => {
            manifest.end(Status::Preempted, None);
            manifest.preempted_at_step = Some(p.step);
        }
        (Err(e), None) => {
            manifest.end(Status::Failed, Some(format!("rank 0: {e:#}")));
            let repeated = restart::record_rank0_failure(manifest, run_dir, &format!("{e:#}"));
            let slurm_restarts = manifest.restarts.iter().filter(|r| r.by == "slurm").count();
            if env.launcher == Launcher::Srun && plan.config.run.max_restarts > 0 {
                requeue = Some(match (repeated, slurm_restarts < plan.config.run.max_restarts) {
                    (true, _) => Err("it failed the same way before: a failure that repeats is not retried"),
                    (false, false) => Err("no restart left (run.max_restarts)"),
                    (false, true) => Ok(checkpoint::newest_unread(run_dir, plan).ok().flatten().is_some()),
                });
            }
        }
    }
    requeue
}

/// Rank 0 under torchrun or srun, once every rank runs the same configuration: takes the run
/// directory (`claim_run_dir`) for `plan`, or for the plan that goes on from its checkpoint when
/// the run was preempted, or when its launcher started the ranks again after a failure.
/// `restarting` is set for the launcher's restart after a failure: the run is under way, and its
/// manifest records the restart at once (its plan and configuration only once every rank
/// accepted the resumed plan, as for any resume).
fn claim_as_rank0(
    plan: &Plan,
    env: &RankEnv,
    run_dir: &Path,
    claim: Claim,
    restarting: &std::cell::Cell<bool>,
) -> anyhow::Result<(agree::Agreed, (RunLock, Manifest))> {
    let restarted = env.restarts > 0 && !claim.resume;
    let (plan, resume, from_step) = match preempted_plan(run_dir, plan, claim)? {
        Some(resumed) => (resumed, true, None),
        None if restarted => match restarted_plan(run_dir, plan)? {
            Some((resumed, step)) => (resumed, true, Some(step)),
            None => (plan.clone(), false, Some(0)),
        },
        None => (plan.clone(), claim.resume, None),
    };
    if resume {
        say_resuming(run_dir);
    }
    let mut manifest = plan.manifest();
    if let Ok(earlier) = Manifest::read(run_dir) {
        let by = if env.launcher == Launcher::Srun { "slurm" } else { "torchrun" };
        match from_step {
            // The launcher's restart after a failure of this run.
            Some(step) if earlier.run_id == plan.run_id => {
                restart::record_relaunch(&mut manifest, &earlier, by, step, run_dir);
                restarting.set(true);
            }
            _ if resume && earlier.status == Status::Preempted => manifest.carry_history(&earlier),
            _ => {}
        }
    }
    let lock = prepare_run_dir(&plan, run_dir, &manifest, Claim { resume, ..claim })?;
    if resume && restarting.get() {
        manifest.write(run_dir)?;
    }
    Ok((agree::Agreed { plan, resume }, (lock, manifest)))
}

/// Takes the run directory for this run: creates it, locks it (a second launcher is refused,
/// naming the pid holding it), refuses one that is not this run's unless `--force`, removes
/// what a fresh run replaces (only the runner's own files) and stale temporary files, and, for a
/// fresh run, writes plan.json, config.toml and the manifest (a resume writes them once every
/// rank accepted its plan: [`Plan::commit_run_dir`]).
pub(super) fn prepare_run_dir(
    plan: &Plan,
    run_dir: &Path,
    manifest: &Manifest,
    claim: Claim,
) -> anyhow::Result<RunLock> {
    if run_dir.exists() && !run_dir.is_dir() {
        let why =
            format!("{} is a file, not a directory: give --out a directory (new, or this run's)", run_dir.display());
        return Err(ConfigError::new(why).into());
    }
    std::fs::create_dir_all(run_dir)
        .with_context(|| format!("cannot create the run directory {}", run_dir.display()))?;
    let lock = lock::acquire(run_dir).map_err(|e| ConfigError::new(e.message(run_dir)))?;
    if claim.resume {
        rundir::remove_stale(run_dir);
    } else {
        if !claim.force {
            if let Some(why) = rundir::foreign(run_dir, &plan.run_id) {
                return Err(ConfigError::new(format!(
                    "--out {} is not this run's directory: {why}; choose another --out, or pass --force to run there \
                     anyway (only the runner's own files are replaced)",
                    run_dir.display()
                ))
                .into());
            }
            if let Some(ended) = rundir::completed(run_dir) {
                return Err(ConfigError::new(format!(
                    "{dir} holds this configuration's complete run (ended {ended}): a fresh run would replace its \
                     model and traces. It is kept as it is; to run again elsewhere give --out DIR, to extend it \
                     --resume {dir} with a larger train.epochs or train.steps, or pass --force to replace it",
                    dir = run_dir.display()
                ))
                .into());
            }
        }
        rundir::clear_for_fresh_run(run_dir);
    }
    // A resume writes them once every rank has accepted its plan.
    if !claim.resume {
        plan.commit_run_dir(run_dir, manifest)?;
    }
    Ok(lock)
}

fn host_key(rank: usize) -> String {
    format!("runner/host/{rank}")
}

/// Each rank's host, as the ranks said it in the store at their start ("?" for one that did not).
fn rank_hosts(store: &crate::dist::Store, world: usize) -> Vec<String> {
    let said = |r: usize| -> Option<String> {
        let bytes = store.contains(&host_key(r)).ok()?.then(|| store.get(&host_key(r)).ok()).flatten()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    };
    (0..world).map(|r| said(r).unwrap_or_else(|| "?".into())).collect()
}
