//! Running points: each is `runner run` (this same binary) in a child process, into its own run
//! directory, with its output in `run.log` there; one point at a time. A point already complete
//! with the same resolved configuration (same run id) is skipped, so an interrupted sweep
//! resumes where it stopped.
use std::ffi::OsString;
use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::Context;

use super::grid::Point;
use super::progress::SweepProgress;
use crate::launch::manifest::{Manifest, Status};

pub const LOG: &str = "run.log";

/// What became of the points.
#[derive(Debug, Default)]
pub struct Outcome {
    pub ran: usize,
    pub skipped: usize,
    /// Each failed point's directory and why it failed.
    pub failed: Vec<(String, String)>,
}

/// Runs every point into `sweep_dir/<point>/`. With `force`, complete points run again; with
/// `fail_fast`, the first failure stops the sweep.
pub fn run_points(points: &[Point], sweep_dir: &Path, force: bool, fail_fast: bool) -> anyhow::Result<Outcome> {
    let complete: Vec<bool> = points.iter().map(|p| !force && is_complete(p, &sweep_dir.join(&p.dir))).collect();
    let to_run = complete.iter().filter(|c| !**c).count();
    let mut progress = SweepProgress::new(points.len(), to_run, "sweep");
    let mut outcome = Outcome::default();
    for (point, complete) in points.iter().zip(complete) {
        if complete {
            progress.skip(&point.dir, "already complete (same configuration), skipped");
            outcome.skipped += 1;
            continue;
        }
        progress.start(&point.dir);
        let result = run_point(point, &sweep_dir.join(&point.dir));
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

/// Whether `run_dir` holds a complete run of exactly this point's configuration.
pub fn is_complete(point: &Point, run_dir: &Path) -> bool {
    Manifest::read(run_dir).is_ok_and(|m| {
        m.status == Status::Complete && m.run_id == point.plan.run_id && run_dir.join(crate::sweep::TRACE).is_file()
    })
}

/// Runs one point into `run_dir`; `Err` says why it failed.
pub fn run_point(point: &Point, run_dir: &Path) -> Result<(), String> {
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

/// `runner run PIPELINE --set-as LABEL KEY=VALUE ... --out RUN_DIR`, its output in run.log.
fn spawn(point: &Point, run_dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create {}", run_dir.display()))?;
    // A manifest left by an earlier run must not pass for this one's.
    let _ = std::fs::remove_file(run_dir.join("manifest.json"));
    let log_path = run_dir.join(LOG);
    let log = File::create(&log_path).with_context(|| format!("cannot write {}", log_path.display()))?;
    let mut args: Vec<OsString> = vec!["run".into(), point.plan.pipeline_file.clone().into()];
    for o in &point.overrides {
        args.extend(["--set-as".into(), o.label.clone().into(), o.text.clone().into()]);
    }
    args.extend(["--out".into(), run_dir.into()]);
    let exe = std::env::current_exe().context("cannot find the runner binary to run points")?;
    let status = Command::new(exe)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .context("cannot start `runner run` for the point")?;
    if !status.success() && Manifest::read(run_dir).is_err() {
        anyhow::bail!("`runner run` {status} before writing a manifest; see {}", log_path.display());
    }
    Ok(())
}
