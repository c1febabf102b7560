//! Continuing a run directory: from its newest checkpoint (`--resume`), or after a preemption.
use std::path::Path;

use crate::checkpoint;
use crate::config::ConfigError;
use crate::plan::Plan;
use crate::rundir;
use crate::rundir::manifest::Reshard;
use crate::rundir::manifest::{Manifest, Status};

use super::run::Claim;

/// The plan that continues a preempted run of `asked`'s configuration in `dir`: Slurm reruns
/// the command line it requeued, and that resumes from the checkpoint the preemption wrote.
/// `None` for any other directory, or when already resuming.
pub(super) fn preempted_plan(dir: &Path, asked: &Plan, claim: Claim) -> anyhow::Result<Option<Plan>> {
    if claim.resume {
        return Ok(None);
    }
    match Manifest::read_raw(dir) {
        // Preempted before its first checkpoint: the run starts over.
        Ok(Some(m)) if m.status == Status::Preempted && m.run_id == asked.run_id && m.preempted_at_step.is_none() => {
            crate::say!("run {} was preempted before its first checkpoint: it starts over", m.run_id);
            Ok(None)
        }
        Ok(Some(m)) if m.status == Status::Preempted && m.run_id == asked.run_id => Ok(Some(resumed_plan(dir, asked)?)),
        _ => Ok(None),
    }
}

/// Under torchrun or srun, when the launcher started the ranks again after a failure
/// (`TORCHELASTIC_RESTART_COUNT`, `SLURM_RESTART_COUNT` above 0): the plan that continues the
/// unfinished run of `asked`'s configuration in `dir` from its newest checkpoint, with that
/// checkpoint's step; `None` to start it over (no checkpoint yet, or no such run). A complete run
/// is left complete.
pub(super) fn restarted_plan(dir: &Path, asked: &Plan) -> anyhow::Result<Option<(Plan, usize)>> {
    match Manifest::read(dir) {
        Ok(m) if m.run_id == asked.run_id && m.status == Status::Complete => Err(ConfigError::new(format!(
            "run {} in {} is complete: nothing is left to run; its launcher restarted it after it ended",
            m.run_id,
            dir.display()
        ))
        .into()),
        Ok(m) if m.run_id == asked.run_id => match checkpoint::newest_unread(dir, asked).map_err(ConfigError::new)? {
            Some(found) if found.record().step >= asked.total_steps() => Ok(Some((asked.clone(), found.record().step))),
            Some(found) => Ok(Some((resumed_plan(dir, asked)?, found.record().step))),
            None => Ok(None),
        },
        _ => Ok(None),
    }
}

pub(super) fn say_resuming(dir: &Path) {
    if let Ok(m) = Manifest::read(dir) {
        let why = match (m.failure, m.preempted_at_step) {
            (Some(f), _) => format!(": {f}"),
            (None, Some(step)) => format!(" at step {step}"),
            (None, None) => String::new(),
        };
        crate::say!("resuming run {} ({}{why})", m.run_id, format!("{:?}", m.status).to_lowercase());
    }
}

/// `--resume DIR` names a run directory: a checkpoint's directory (or a file, or nothing) is
/// refused saying what to give instead.
pub(super) fn check_run_dir(dir: &Path) -> Result<(), ConfigError> {
    if dir.join(rundir::PLAN).is_file() || dir.join(rundir::CONFIG).is_file() {
        return Ok(());
    }
    let why = if dir.join(checkpoint::INDEX).is_file() {
        let run = dir.parent().and_then(Path::parent).filter(|r| r.join(rundir::PLAN).is_file());
        match run {
            Some(run) => format!(
                "it is a checkpoint of the run in {0}: resume that run with --resume {0} (it goes on from its newest \
                 checkpoint; to go on from this one, move the newer ones out of {1})",
                run.display(),
                checkpoint::dir(run).display()
            ),
            None => "it is a checkpoint's directory: give the run directory that holds its checkpoints/".to_owned(),
        }
    } else if !dir.exists() {
        "no such directory".to_owned()
    } else if !dir.is_dir() {
        "it is a file, not a run directory".to_owned()
    } else {
        format!("it is not a run directory (it has no {} nor {})", rundir::PLAN, rundir::CONFIG)
    };
    Err(ConfigError::new(format!("--resume {}: {why}", dir.display())))
}

/// The plan of the run in `dir`, continued under the configuration the user resumes with
/// (`asked`); refused, before any rank starts, when a key other than those that extend a run or
/// spread it another way changed, or its newest checkpoint does not verify. A resume under
/// another world size or strategy is recorded in the plan (and so in the manifest).
pub(super) fn resumed_plan(dir: &Path, asked: &Plan) -> anyhow::Result<Plan> {
    let saved_path = dir.join(rundir::PLAN);
    if !saved_path.is_file() {
        return Err(ConfigError::new(format!(
            "{} has no {} (it was made by an older runner, or is not a run directory): start a new run",
            dir.display(),
            rundir::PLAN
        ))
        .into());
    }
    let mut plan = Plan::load(&saved_path)?.resumed(asked)?;
    let found = checkpoint::latest(dir, &plan).map_err(ConfigError::new)?.ok_or_else(|| no_checkpoint(dir, &plan))?;
    let record = found.record();
    if record.global_batch != plan.global_batch() {
        return Err(ConfigError::new(format!(
            "checkpoint {} was written with a global batch of {} samples per step, this run's is {}: it belongs to \
             another run; move it out of {} to resume from the one before, or start a new run",
            found.dir.display(),
            record.global_batch,
            plan.global_batch(),
            checkpoint::dir(dir).display()
        ))
        .into());
    }
    if record.layout != plan.layout() {
        let reshard = Reshard { step: record.step, from: record.layout, to: plan.layout() };
        // A resume of the same checkpoint again (the last one stopped before its first) replaces it.
        if plan.reshards.last().is_some_and(|r| r.step == reshard.step && r.from == reshard.from) {
            plan.reshards.pop();
        }
        crate::say!(
            "resuming at step {} with {} (the checkpoint was written with {})",
            record.step,
            reshard.to,
            reshard.from
        );
        plan.reshards.push(reshard);
    }
    let done = found.record().step;
    if let (Some(steps), true) = (plan.config.train.steps, done >= plan.total_steps()) {
        let source = plan.sources.get("train.steps").map(String::as_str).unwrap_or("default");
        return Err(ConfigError::new(format!(
            "`train.steps` ({source}) is {steps} but the newest checkpoint of {} is at step {done}: nothing is left to \
             run; pass --set train.steps=N with N > {done} to train further",
            dir.display(),
        ))
        .into());
    }
    let epochs = plan.config.train.epochs;
    if done >= plan.total_steps() {
        let source = plan.sources.get("train.epochs").map(String::as_str).unwrap_or("default");
        return Err(ConfigError::new(format!(
            "`train.epochs` ({source}) is {epochs} but the newest checkpoint of {} is at epoch {}: nothing is left to \
             run; pass --set train.epochs=N with N > {} to train further",
            dir.display(),
            found.record().epoch,
            found.record().epoch
        ))
        .into());
    }
    Ok(plan)
}

/// Why `dir` holds no checkpoint to resume from, and what to do.
fn no_checkpoint(dir: &Path, plan: &Plan) -> anyhow::Error {
    let ck = checkpoint::dir(dir);
    let old: Vec<String> = std::fs::read_dir(&ck)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".pt"))
        .collect();
    let k = &plan.config.checkpoint;
    let why = if let Some(name) = old.first() {
        format!(
            "its checkpoints ({name}{}) are of an older runner's format, which this one cannot resume: start a new run",
            if old.len() > 1 { format!(" and {} more", old.len() - 1) } else { String::new() }
        )
    } else {
        match (k.every, k.every_steps) {
            (0, None) => "the run writes none: set checkpoint.every (epochs) or checkpoint.every_steps (optimizer \
                          steps) and start a new run"
                .to_owned(),
            (_, Some(n)) => format!(
                "the run stopped before its first checkpoint (checkpoint.every_steps = {n}): start it again without \
                 --resume"
            ),
            (e, None) => format!(
                "the run stopped before its first checkpoint (checkpoint.every = {e} epochs): start it again without \
                 --resume"
            ),
        }
    };
    ConfigError::new(format!("{} holds no checkpoint to resume from: {why}", ck.display())).into()
}
