//! Running points: each is `runner run` (this same binary) in a child process, into its own run
//! directory, with its output in `run.log` there; one point at a time. A point already complete
//! with the same resolved configuration (same run id) is skipped, so an interrupted sweep
//! resumes where it stopped: a point left `interrupted` or `crashed` with a checkpoint resumes
//! from it. SIGINT, SIGTERM or SIGHUP to the sweep are forwarded to the running point's launcher,
//! which stops its ranks and marks the point `interrupted`; then the sweep stops.
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;

use super::grid::Point;
use super::progress::SweepProgress;
pub use super::state::{is_complete, resumable, stop_signal};
use crate::rundir::manifest::{Manifest, Status};

pub const LOG: &str = crate::rundir::RUN_LOG;

/// How `runner sweep` runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The sweep directory; default `results/<experiment file stem>/`.
    pub out: Option<PathBuf>,
    pub fail_fast: bool,
    pub force: bool,
    pub check: bool,
    pub launcher: Launcher,
    /// `--tolerance`: the relative difference --check accepts in float values (None: bit for bit).
    pub tolerance: Option<f64>,
}

/// Where the points run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Launcher {
    /// One after another on this machine.
    Local,
    /// Each an sbatch job, side by side, with the experiment file's [slurm] resources.
    Slurm,
}

/// Where the points of `experiment` run.
pub enum Runs<'a> {
    Local,
    Slurm(&'a super::slurm::Resources),
}

/// A point stopped by a signal to the sweep (its launcher marked it `interrupted`).
#[derive(Debug)]
pub struct Stopped(pub i32);

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped by signal {}", self.0)
    }
}

/// What became of the points.
#[derive(Debug, Default)]
pub struct Outcome {
    pub ran: usize,
    pub skipped: usize,
    /// Each failed point's directory and why it failed.
    pub failed: Vec<(String, String)>,
    /// The signal that stopped the sweep, and the point it interrupted.
    pub stopped: Option<(i32, String)>,
}

/// Runs every point into `sweep_dir/<point>/`. With `force`, complete points run again; with
/// `fail_fast`, the first failure stops the sweep.
pub fn run_points(
    points: &[Point],
    sweep_dir: &Path,
    force: bool,
    fail_fast: bool,
    runs: &Runs,
) -> anyhow::Result<Outcome> {
    let complete: Vec<bool> = points.iter().map(|p| !force && is_complete(p, &sweep_dir.join(&p.dir))).collect();
    let to_run = complete.iter().filter(|c| !**c).count();
    let mut progress = SweepProgress::new(points.len(), to_run, "sweep");
    let mut outcome = Outcome::default();
    if let Runs::Slurm(resources) = runs {
        let mut jobs = Vec::new();
        for (point, complete) in points.iter().zip(complete) {
            if complete {
                progress.skip(&point.dir, "already complete (same configuration), skipped");
                outcome.skipped += 1;
            } else {
                jobs.push((point, sweep_dir.join(&point.dir)));
            }
        }
        let batch = super::slurm::run_all(&jobs, resources, &mut progress, fail_fast)?;
        for ((point, _), result) in jobs.iter().zip(batch.results) {
            match result {
                Some(Ok(())) => outcome.ran += 1,
                Some(Err(why)) => {
                    outcome.ran += 1;
                    outcome.failed.push((point.dir.clone(), why));
                }
                None => {}
            }
        }
        if let Some(sig) = batch.stopped {
            outcome.stopped = Some((sig, String::new()));
        }
        progress.clear();
        return Ok(outcome);
    }
    for (point, complete) in points.iter().zip(complete) {
        if complete {
            progress.skip(&point.dir, "already complete (same configuration), skipped");
            outcome.skipped += 1;
            continue;
        }
        progress.start(&point.dir);
        let result = run_point(point, &sweep_dir.join(&point.dir));
        if let Some(sig) = stop_signal_of(&result) {
            progress.finish(&point.dir, "interrupted");
            outcome.stopped = Some((sig, point.dir.clone()));
            break;
        }
        outcome.ran += 1;
        match result {
            Ok(()) => progress.finish(&point.dir, "complete"),
            Err(why) => {
                progress.finish(&point.dir, &format!("FAILED: {why}"));
                outcome.failed.push((point.dir.clone(), why));
                if fail_fast {
                    break;
                }
            }
        }
    }
    progress.clear();
    Ok(outcome)
}

/// The signal, when `result` is a point stopped by one.
fn stop_signal_of(result: &Result<(), String>) -> Option<i32> {
    let sig = stop_signal();
    (result.is_err() && sig != 0).then_some(sig as i32)
}

/// Runs one point into `run_dir`; `Err` says why it failed.
pub fn run_point(point: &Point, run_dir: &Path) -> Result<(), String> {
    if stop_signal() != 0 {
        return Err(Stopped(stop_signal() as i32).to_string());
    }
    spawn(point, run_dir).map_err(|e| format!("{e:#}"))?;
    match Manifest::read(run_dir) {
        Ok(m) if m.status == Status::Complete => Ok(()),
        Ok(m) => Err(m.failure.unwrap_or_else(|| format!("the run ended {:?}; see {}", m.status, log_of(run_dir)))),
        Err(e) => Err(format!("{e:#}; see {}", log_of(run_dir))),
    }
}

fn log_of(run_dir: &Path) -> String {
    run_dir.join(LOG).display().to_string()
}

/// Runs the point into `run_dir` (resuming it there when [`resumable`]) and waits for it,
/// forwarding a stop signal to it.
fn spawn(point: &Point, run_dir: &Path) -> anyhow::Result<()> {
    let mut child = start(point, run_dir, resumable(point, run_dir))?;
    let log_path = run_dir.join(LOG);
    let mut forwarded = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        let sig = stop_signal();
        if sig != 0 && !forwarded {
            // The launcher stops its ranks, marks the point interrupted and exits.
            forward(&child, sig);
            forwarded = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if forwarded {
        anyhow::bail!("{}", Stopped(stop_signal() as i32));
    }
    if !status.success() && Manifest::read(run_dir).is_err() {
        anyhow::bail!("`runner run` {status} before writing a manifest; see {}", log_path.display());
    }
    Ok(())
}

/// Sends stop signal `sig` to a point's launcher.
pub fn forward(child: &Child, sig: usize) {
    if let Ok(sig) = nix::sys::signal::Signal::try_from(sig as i32) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig);
    }
}

/// Starts `runner run PIPELINE --set-as LABEL KEY=VALUE ... --out RUN_DIR` (or, with `resume`,
/// `--resume RUN_DIR`), its output in run.log. The sweep owns its points' directories: `--force`.
pub fn start(point: &Point, run_dir: &Path, resume: bool) -> anyhow::Result<Child> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create {}", run_dir.display()))?;
    if let Some(pid) = crate::rundir::lock::holder(run_dir) {
        let pid = pid.map_or(String::new(), |p| format!(" (pid {p})"));
        anyhow::bail!("{} is in use by another runner{pid}", run_dir.display());
    }
    if !resume {
        // A manifest left by an earlier run must not pass for this one's.
        let _ = std::fs::remove_file(run_dir.join(crate::rundir::MANIFEST));
    }
    let log_path = run_dir.join(LOG);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(resume)
        .truncate(!resume)
        .open(&log_path)
        .with_context(|| format!("cannot write {}", log_path.display()))?;
    let mut args: Vec<OsString> = vec!["run".into(), point.plan.pipeline_file.clone().into()];
    for o in &point.overrides {
        args.extend(["--set-as".into(), o.label.clone().into(), o.text.clone().into()]);
    }
    if resume {
        args.extend(["--resume".into(), run_dir.into()]);
    } else {
        args.extend(["--out".into(), run_dir.into(), "--force".into()]);
    }
    let exe = std::env::current_exe().context("cannot find the runner binary to run points")?;
    // Started from the sweep's main thread: PR_SET_PDEATHSIG in the child follows this thread.
    Command::new(exe)
        .args(&args)
        .env(crate::launch::env::SWEEP_PID, std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("cannot start `runner run` for the point")
}
