//! `runner sweep FILE --launcher slurm`: every point that has to run becomes one Slurm job
//! (`sbatch`), with the resources of the experiment file's `[slurm]` table, into the same run
//! directory a local sweep uses. Its job script (`slurm.sh` in the run directory) runs
//! `srun runner run ...`, each task one rank; it carries `--requeue` and `--signal` so that a
//! preempted job checkpoints, requeues itself and resumes. The sweep polls `squeue` and shows
//! each job's state until every job has ended, then reads each point's manifest as a local sweep
//! does. A stop signal to the sweep cancels its jobs (`scancel`).
//!
//! ```toml
//! [slurm]
//! partition = "gpu"
//! time = "01:00:00"
//! nodes = 1
//! cpus_per_task = 4
//! extra = ["--account=ml"]
//! ```
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Deserialize;

use super::grid::Point;
use super::progress::SweepProgress;
use super::state;
use crate::rundir::manifest::Manifest;

/// The script each point's job runs, in its run directory.
pub const SCRIPT: &str = "slurm.sh";

/// Seconds before its time limit that Slurm sends a job `run.preempt_signal` (`--signal`).
const WARNING_S: u32 = 90;

/// How often the sweep asks Slurm for its jobs' states.
pub(super) const POLL: Duration = Duration::from_millis(500);

/// The `[slurm]` table of an experiment file: each point's job resources.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Resources {
    /// The partition (`sbatch --partition`); the cluster's default when absent.
    pub partition: Option<String>,
    /// The time limit, in Slurm's format (`30`, minutes; `01:30:00`; `1-00:00:00`).
    pub time: Option<String>,
    /// Nodes per job; the point's `run.world_size` ranks are spread evenly over them.
    pub nodes: usize,
    /// Tasks (ranks) per node; when given, nodes × ntasks_per_node must be the world size.
    pub ntasks_per_node: Option<usize>,
    /// CPU cores per task (rank).
    pub cpus_per_task: Option<usize>,
    /// GPUs per node (`sbatch --gpus-per-node`).
    pub gpus_per_node: Option<usize>,
    /// Other sbatch flags, as given on sbatch's command line (`["--account=ml", "--qos=low"]`).
    pub extra: Vec<String>,
}

impl Default for Resources {
    fn default() -> Resources {
        Resources {
            partition: None,
            time: None,
            nodes: 1,
            ntasks_per_node: None,
            cpus_per_task: None,
            gpus_per_node: None,
            extra: Vec::new(),
        }
    }
}

impl Resources {
    /// The `#SBATCH` flags of a job of `world` ranks, or why these resources cannot hold them.
    fn flags(&self, world: usize) -> Result<Vec<String>, String> {
        if self.nodes == 0 {
            return Err("[slurm] nodes must be at least 1".into());
        }
        let per_node = match self.ntasks_per_node {
            Some(n) if n * self.nodes == world => n,
            Some(n) => {
                return Err(format!(
                    "[slurm] nodes ({}) × ntasks_per_node ({n}) is {}, but run.world_size is {world}",
                    self.nodes,
                    n * self.nodes
                ))
            }
            None if world.is_multiple_of(self.nodes) => world / self.nodes,
            None => {
                return Err(format!(
                    "run.world_size ({world}) does not divide evenly over [slurm] nodes = {}",
                    self.nodes
                ))
            }
        };
        let mut flags = vec![format!("--nodes={}", self.nodes), format!("--ntasks-per-node={per_node}")];
        let optional = [
            ("partition", self.partition.clone()),
            ("time", self.time.clone()),
            ("cpus-per-task", self.cpus_per_task.map(|n| n.to_string())),
            ("gpus-per-node", self.gpus_per_node.map(|n| n.to_string())),
        ];
        flags.extend(optional.into_iter().filter_map(|(k, v)| Some(format!("--{k}={}", v?))));
        flags.extend(self.extra.iter().cloned());
        Ok(flags)
    }
}

/// What became of a batch of jobs.
#[derive(Debug, Default)]
pub struct Batch {
    /// Each job's result, in the order given; `None` for a job that never ran to an end (not
    /// submitted, or cancelled by --fail-fast or a stop signal).
    pub results: Vec<Option<Result<(), String>>>,
    /// The stop signal that cancelled the jobs.
    pub stopped: Option<i32>,
}

/// Submits one job per (point, run directory) and waits for them all. With `fail_fast`, the
/// first failure cancels the others.
pub fn run_all(
    jobs: &[(&Point, PathBuf)],
    resources: &Resources,
    progress: &mut SweepProgress,
    fail_fast: bool,
) -> anyhow::Result<Batch> {
    let mut batch = Batch { results: vec![None; jobs.len()], stopped: None };
    // Job id → (index, label, submitted at, last state shown).
    let mut live: BTreeMap<String, (usize, String, Instant, String)> = BTreeMap::new();
    for (i, (point, run_dir)) in jobs.iter().enumerate() {
        if state::stop_signal() != 0 {
            break;
        }
        let label = point.dir.clone();
        match submit(point, run_dir, resources, state::resumable(point, run_dir)) {
            Ok(id) => {
                progress.line(&format!("{label}: submitted as job {id}"));
                live.insert(id, (i, label, Instant::now(), String::new()));
            }
            Err(e) => {
                let why = format!("{e:#}");
                progress.finish_after(&label, &format!("FAILED: {why}"), Duration::ZERO);
                batch.results[i] = Some(Err(why));
                if fail_fast {
                    cancel(live.keys());
                    return Ok(batch);
                }
            }
        }
    }
    while !live.is_empty() {
        let sig = state::stop_signal();
        if sig != 0 {
            cancel(live.keys());
            for (_, (_, label, _, _)) in std::mem::take(&mut live) {
                progress.line(&format!("{label}: cancelled (scancel)"));
            }
            batch.stopped = Some(sig as i32);
            break;
        }
        let states = states(live.keys())?;
        let mut ended = Vec::new();
        for (id, (i, label, since, shown)) in live.iter_mut() {
            let state = states.get(id).cloned().unwrap_or_else(|| "ENDED".into());
            if is_terminal(&state) {
                ended.push(id.clone());
                let result = outcome(&jobs[*i].1, &state);
                let text = match &result {
                    Ok(()) => "complete".to_owned(),
                    Err(why) => format!("FAILED: {why}"),
                };
                progress.finish_after(label, &format!("{text} (job {id})"), since.elapsed());
                batch.results[*i] = Some(result);
            } else if *shown != state {
                progress.line(&format!("{label}: job {id} {state}"));
                *shown = state;
            }
        }
        let failed = ended.iter().any(|id| matches!(batch.results[live[id].0], Some(Err(_))));
        for id in &ended {
            live.remove(id);
        }
        if failed && fail_fast {
            cancel(live.keys());
            break;
        }
        let counts = live.values().fold(BTreeMap::<&str, usize>::new(), |mut m, (_, _, _, s)| {
            *m.entry(s.as_str()).or_default() += 1;
            m
        });
        let summary: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {}", s.to_lowercase())).collect();
        progress.message(&summary.join(", "));
        std::thread::sleep(POLL);
    }
    Ok(batch)
}

/// The point's result once its job has ended in `state`: its manifest, as a local sweep reads it.
pub(super) fn outcome(run_dir: &Path, state: &str) -> Result<(), String> {
    let log = run_dir.join(crate::rundir::RUN_LOG);
    match Manifest::read(run_dir) {
        Ok(m) if m.status == crate::rundir::manifest::Status::Complete => Ok(()),
        Ok(m) => Err(m
            .failure
            .unwrap_or_else(|| format!("the run ended {:?} (job {state}); see {}", m.status, log.display()))),
        Err(_) => Err(format!("the job ended {state} before the run wrote a manifest; see {}", log.display())),
    }
}

/// Slurm's states in which a job will not run again.
pub(super) fn is_terminal(state: &str) -> bool {
    !matches!(
        state,
        "PENDING"
            | "RUNNING"
            | "CONFIGURING"
            | "COMPLETING"
            | "REQUEUED"
            | "REQUEUE_FED"
            | "REQUEUE_HOLD"
            | "RESIZING"
            | "SUSPENDED"
            | "STOPPED"
            | "SIGNALING"
            | "STAGE_OUT"
            | "RESV_DEL_HOLD"
    )
}

/// Writes the point's job script into its run directory and submits it (continuing the run
/// there with `resume`); the job's id.
pub(super) fn submit(point: &Point, run_dir: &Path, resources: &Resources, resume: bool) -> anyhow::Result<String> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create {}", run_dir.display()))?;
    let run_dir = std::path::absolute(run_dir)?;
    if let Some(pid) = crate::rundir::lock::holder(&run_dir) {
        let pid = pid.map_or(String::new(), |p| format!(" (pid {p})"));
        anyhow::bail!("{} is in use by another runner{pid}", run_dir.display());
    }
    if !resume {
        // A manifest or log left by an earlier run must not pass for this one's.
        let _ = std::fs::remove_file(run_dir.join(crate::rundir::MANIFEST));
        let _ = std::fs::remove_file(run_dir.join(crate::rundir::RUN_LOG));
    }
    let exe = std::env::current_exe().context("cannot find the runner binary to run points")?;
    let flags = resources.flags(point.plan.world_size()).map_err(crate::config::ConfigError::new)?;
    let script = script(point, &run_dir, &exe, &flags, resume)?;
    let path = run_dir.join(SCRIPT);
    crate::rundir::atomic_write(&path, script.as_bytes())?;
    let out = Command::new("sbatch")
        .arg("--parsable")
        .arg(&path)
        .output()
        .context("cannot run sbatch (is Slurm installed here, and SLURM_CONF set if needed?)")?;
    if !out.status.success() {
        anyhow::bail!("sbatch refused the job: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    // `--parsable` prints `id` or `id;cluster`.
    let text = String::from_utf8_lossy(&out.stdout);
    let id = text.trim().split(';').next().unwrap_or_default().to_owned();
    anyhow::ensure!(id.chars().all(|c| c.is_ascii_digit()) && !id.is_empty(), "sbatch printed no job id: {text:?}");
    Ok(id)
}

/// The job script: `#SBATCH` lines, then `srun runner run ...` (each task one rank).
fn script(point: &Point, run_dir: &Path, exe: &Path, flags: &[String], resume: bool) -> anyhow::Result<String> {
    let pipeline = std::path::absolute(&point.plan.pipeline_file)?;
    let mut s =
        String::from("#!/bin/sh\n# Written by `runner sweep --launcher slurm`; resubmit with: sbatch slurm.sh\n");
    let name = format!("runner:{}", point.dir);
    let log = run_dir.join(crate::rundir::RUN_LOG);
    let signal = format!("{}@{WARNING_S}", point.plan.config.run.preempt_signal.name());
    for flag in [
        format!("--job-name={name}"),
        format!("--output={}", log.display()),
        "--open-mode=append".to_owned(),
        "--requeue".to_owned(),
        format!("--signal={signal}"),
    ]
    .iter()
    .chain(flags)
    {
        s += &format!("#SBATCH {flag}\n");
    }
    let mut args = vec![exe.display().to_string(), "run".into(), pipeline.display().to_string()];
    for o in &point.overrides {
        args.extend(["--set-as".into(), o.label.clone(), o.text.clone()]);
    }
    if resume {
        args.extend(["--resume".into(), run_dir.display().to_string()]);
    } else {
        args.extend(["--out".into(), run_dir.display().to_string(), "--force".into()]);
    }
    let quoted: Vec<String> = args.iter().map(|a| quote(a)).collect();
    s += &format!("exec srun {}\n", quoted.join(" "));
    Ok(s)
}

/// `text` as one word for sh.
fn quote(text: &str) -> String {
    if !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@".contains(c)) {
        return text.to_owned();
    }
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The states of the given jobs (`squeue --states=all`); a job Slurm no longer lists is absent.
pub(super) fn states<'a>(ids: impl Iterator<Item = &'a String>) -> anyhow::Result<BTreeMap<String, String>> {
    let list: Vec<&String> = ids.collect();
    if list.is_empty() {
        return Ok(BTreeMap::new());
    }
    let joined = list.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(",");
    let out = Command::new("squeue")
        .args(["--noheader", "--states=all", "--format=%i %T", "--jobs", &joined])
        .output()
        .context("cannot run squeue")?;
    // squeue fails when every job has left the controller's memory: then none is listed.
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' ').map(|(id, state)| (id.trim().to_owned(), state.trim().to_owned())))
        .collect())
}

pub(super) fn cancel<'a>(ids: impl Iterator<Item = &'a String>) {
    let ids: Vec<&String> = ids.collect();
    if !ids.is_empty() {
        let _ = Command::new("scancel").args(ids).output();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_become_sbatch_flags() {
        let r = Resources {
            partition: Some("gpu".into()),
            time: Some("10".into()),
            nodes: 2,
            gpus_per_node: Some(4),
            extra: vec!["--qos=low".into()],
            ..Resources::default()
        };
        assert_eq!(
            r.flags(8).unwrap(),
            ["--nodes=2", "--ntasks-per-node=4", "--partition=gpu", "--time=10", "--gpus-per-node=4", "--qos=low"]
        );
        assert_eq!(Resources::default().flags(3).unwrap(), ["--nodes=1", "--ntasks-per-node=3"]);
    }

    #[test]
    fn resources_that_cannot_hold_the_ranks_are_refused() {
        let r = Resources { nodes: 2, ..Resources::default() };
        assert!(r.flags(3).unwrap_err().contains("does not divide evenly over [slurm] nodes = 2"));
        let r = Resources { nodes: 2, ntasks_per_node: Some(1), ..Resources::default() };
        assert!(r.flags(4).unwrap_err().contains("nodes (2) × ntasks_per_node (1) is 2, but run.world_size is 4"));
    }

    #[test]
    fn words_are_quoted_for_sh() {
        assert_eq!(quote("train.lr=0.1"), "train.lr=0.1");
        assert_eq!(quote("sweep axis"), "'sweep axis'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
    }

    #[test]
    fn only_ended_states_are_terminal() {
        for s in ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "ENDED"] {
            assert!(is_terminal(s), "{s}");
        }
        for s in ["PENDING", "RUNNING", "COMPLETING", "REQUEUED"] {
            assert!(!is_terminal(s), "{s}");
        }
    }
}
