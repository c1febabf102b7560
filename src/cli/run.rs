//! `runner run`: as the launcher of this node's ranks, or as one rank (of runner's own launcher,
//! torchrun or srun).
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::checkpoint;
use crate::config::{self, ConfigError};
use crate::launch::agree;
use crate::launch::env::{Launcher, RankEnv};
use crate::launch::rank;
use crate::launch::slurm;
use crate::launch::spawn::{self, Topology};
use crate::plan::Plan;
use crate::rundir;
use crate::rundir::lock::{self, RunLock};
use crate::rundir::manifest::{Manifest, Status};
use crate::stages::preempt;
use crate::trace::view;

use super::resume::{preempted_plan, resumed_plan, say_resuming};
use super::{overrides, warn_of_slow_bf16, ConfigArgs, RunArgs};

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
    launch(&plan, &topology, claim, &dir)
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
    let (agreed, owned) = if env.launcher == Launcher::Runner {
        (agree::Agreed { plan, resume: claim.resume }, None)
    } else {
        let parties = agree::Parties { label: "rank", me: env.rank, count: env.world_size };
        agree::rank0_plan(&store, &plan, parties, |plan| {
            rank::check_world_size(plan, env)?;
            let run_dir = run_dir_of(plan);
            let (plan, resume) = match preempted_plan(&run_dir, plan, claim)? {
                Some(resumed) => (resumed, true),
                None => (plan.clone(), claim.resume),
            };
            if resume {
                say_resuming(&run_dir);
            }
            let manifest = plan.manifest();
            let lock = prepare_run_dir(&plan, &run_dir, &manifest, Claim { resume, ..claim })?;
            Ok((agree::Agreed { plan, resume }, (lock, manifest)))
        })?
    };
    let agree::Agreed { plan, resume } = agreed;
    let run_dir = run_dir_of(&plan);
    let (_lock, mut manifest) = owned.unzip();
    // A fresh run's directory took its files before any rank started; a resume's take them once
    // every rank accepted the plan (rank 0 owns them here, under torchrun or srun).
    let committed = std::cell::Cell::new(!resume);
    let write = || {
        let m = manifest.as_ref().expect("rank 0 owns the run directory");
        commit_run_dir(&plan, &run_dir, m)?;
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
    .unwrap_or_else(|panic| match panic.downcast::<crate::checked::Failure>() {
        // A model's forward pass failed (a user's module raised): its message is the error.
        Ok(failure) => Err(anyhow::anyhow!(failure.0)),
        Err(panic) => Err(anyhow::anyhow!("rank {} panicked: {}", env.rank, panic_text(&panic))),
    });
    let preempted = result.as_ref().err().and_then(|e| e.downcast_ref::<preempt::Preempted>()).copied();
    // A resume refused before every rank accepted it leaves the run's manifest as it was.
    if let Some(manifest) = manifest.as_mut().filter(|_| committed.get()) {
        match (&result, preempted) {
            (Ok(_), _) => {
                manifest.end(Status::Complete, None);
                manifest.stopped(&run_dir, &plan.config.train);
            }
            (Err(_), Some(p)) => {
                manifest.end(Status::Preempted, None);
                manifest.preempted_at_step = Some(p.step);
            }
            (Err(e), None) => manifest.end(Status::Failed, Some(format!("rank 0: {e:#}"))),
        }
        manifest.write(&run_dir)?;
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
        let by_step = plan.config.train.steps.is_some();
        crate::say!("\n{}", view::epoch_table(&rows, by_step));
        let pipeline = view::pipeline_table(&rows);
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
    }
    Ok(0)
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

fn launch(plan: &Plan, topology: &Topology, claim: Claim, run_dir: &Path) -> anyhow::Result<u8> {
    crate::say!("{}", plan.data_flow());
    for note in plan.data.notes().iter().cloned().chain(crate::numerics::notes()) {
        crate::say!("{note}");
    }
    for line in crate::stages::track::plan_lines(plan, Some(run_dir)) {
        crate::say!("{line}");
    }
    if let Some(sweep) = std::env::var(crate::launch::env::SWEEP_PID).ok().and_then(|p| p.parse::<i32>().ok()) {
        // Started by `runner sweep`: its end (even by SIGKILL) interrupts this run.
        let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM);
        if nix::unistd::getppid().as_raw() != sweep {
            return Err(anyhow::anyhow!("the sweep that started this run has ended"));
        }
    }
    let mut manifest = plan.manifest();
    let _lock = prepare_run_dir(plan, run_dir, &manifest, claim)?;
    // Every rank runs the plan resolved here, never the pipeline file again. A resume's plan
    // waits in a temporary file until every rank accepted it: then it is the run's plan.json.
    let plan_file =
        if claim.resume { rundir::tmp_path(&run_dir.join(rundir::PLAN)) } else { run_dir.join(rundir::PLAN) };
    if claim.resume {
        plan.save(&plan_file)?;
    }
    let child_args: Vec<OsString> = vec![
        "run".into(),
        "--plan".into(),
        plan_file.into(),
        if claim.resume { "--resume" } else { "--out" }.into(),
        run_dir.into(),
    ];
    let mut commit = || commit_run_dir(plan, run_dir, &manifest);
    let commit: Option<&mut dyn FnMut() -> anyhow::Result<()>> = claim.resume.then_some(&mut commit);
    // Every way the launcher ends records how: an error (a store it cannot serve or join, a
    // configuration the other nodes do not share) or a panic is a failed run.
    let launched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        spawn::launch(plan, topology, run_dir, &child_args, commit)
    }))
    .unwrap_or_else(|panic| Err(anyhow::anyhow!("the launcher panicked: {}", panic_text(&panic))));
    // Every rank has ended: what a write cut short left (a checkpoint being written when a signal
    // came, a temporary file, a resume's plan never accepted) goes now, not at the next start.
    rundir::remove_unfinished(run_dir);
    let outcome = match launched {
        Ok(outcome) => outcome,
        Err(e) if !claim.resume => {
            manifest.end(Status::Failed, Some(format!("{e:#}")));
            manifest.write(run_dir)?;
            return Err(e);
        }
        Err(e) => return Err(e.context(unchanged(run_dir))),
    };
    if !outcome.committed && !outcome.preempted {
        return refused_resume(&outcome, run_dir);
    }
    if outcome.preempted {
        // The newest checkpoint: the one the ranks just wrote, or, when the signal came before
        // any rank started, the one a resumed run started from (none: the run starts over).
        let step = checkpoint::newest_unread(run_dir, plan).ok().flatten().map(|f| f.record().step);
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
    match &outcome.failure {
        None => {
            manifest.end(Status::Complete, None);
            manifest.stopped(run_dir, &plan.config.train);
            manifest.write(run_dir)?;
            crate::say!("  run directory: {}", run_dir.display());
            Ok(0)
        }
        Some(f) => {
            manifest.end(Status::Failed, Some(f.summary()));
            manifest.write(run_dir)?;
            crate::say_err!("\nerror: the run failed: {}", f.summary());
            if !f.stderr_tail.is_empty() {
                crate::say_err!("  last lines rank {} wrote to stderr:", f.rank);
                for line in &f.stderr_tail {
                    crate::say_err!("    {line}");
                }
            }
            crate::say_err!(
                "  run directory (traces keep every finished {}): {}",
                trace_unit(&plan.config),
                run_dir.display()
            );
            Ok(1)
        }
    }
}

/// Takes the run directory for this run: creates it, locks it (a second launcher is refused,
/// naming the pid holding it), refuses one that is not this run's unless `--force`, removes
/// what a fresh run replaces (only the runner's own files) and stale temporary files, and writes
/// plan.json, config.toml and the manifest.
fn prepare_run_dir(plan: &Plan, run_dir: &Path, manifest: &Manifest, claim: Claim) -> anyhow::Result<RunLock> {
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
        }
        rundir::clear_for_fresh_run(run_dir);
    }
    // A resume writes them once every rank has accepted its plan ([`commit_run_dir`]).
    if !claim.resume {
        commit_run_dir(plan, run_dir, manifest)?;
    }
    Ok(lock)
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

/// Writes the run's plan.json, config.toml and manifest: before a fresh run starts its ranks; for
/// a resume (which may extend or reshard the run), once every rank accepted its plan.
fn commit_run_dir(plan: &Plan, run_dir: &Path, manifest: &Manifest) -> anyhow::Result<()> {
    // Written again if the resumed run stops early.
    let _ = std::fs::remove_file(run_dir.join(rundir::STOPPED));
    plan.save(&run_dir.join(rundir::PLAN))?;
    rundir::atomic_write(&run_dir.join(rundir::CONFIG), plan.annotated_toml().as_bytes())?;
    manifest.write(run_dir)
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
