//! Sweeps: an experiment file ([`experiment`]) names a pipeline and a grid of overrides
//! ([`grid`]); `runner sweep` validates every point before anything runs, runs them one after
//! another ([`execute`]) with one progress display ([`progress`]), resumes where an interrupted
//! sweep stopped, writes the result tables and plots ([`crate::report`]), and with `--check`
//! reruns every point to show the stored traces reproduce ([`check`]). An experiment with a
//! `[search]` table runs a search at every point of its grid instead ([`search`]).
//!
//! ```text
//! runner sweep experiments/world_size.toml            # → results/world_size/
//! runner sweep experiments/world_size.toml --check    # rerun every point, compare the traces
//! runner sweep experiments/world_size.toml --launcher slurm   # every point a Slurm job
//! ```
pub mod check;
pub mod execute;
pub mod experiment;
pub mod grid;
pub mod points;
pub mod progress;
pub mod scaling;
pub mod search;
pub mod slurm;
pub mod state;

use std::path::Path;

use anyhow::Context;

pub use execute::{Launcher, Options, Runs};
pub use experiment::Experiment;

/// The differences `--check` lists; the rest are counted.
const SHOWN: usize = 20;

pub fn sweep(file: &Path, opts: &Options) -> anyhow::Result<u8> {
    // Refused at once, as `runner run` refuses it: every point would fail on it.
    crate::numerics::check_environment().map_err(crate::config::ConfigError::new)?;
    let experiment = Experiment::load(file)?;
    let points = experiment.points()?;
    let search = match &experiment.search {
        Some(spec) => Some(search::prepare(&experiment, spec, &points)?),
        None => None,
    };
    let runs = match opts.launcher {
        Launcher::Local => Runs::Local,
        Launcher::Slurm => Runs::Slurm(&experiment.slurm),
    };
    let dir = opts.out.clone().unwrap_or_else(|| Path::new("results").join(experiment.name()));
    let mut axes: Vec<String> = experiment.axes.iter().map(|a| format!("{} ({})", a.key, a.values.len())).collect();
    if !experiment.named.is_empty() {
        axes.insert(0, format!("{} named points", experiment.named.len()));
    }
    crate::say!(
        "{}: {} points of {} over {}",
        file.display(),
        points.len(),
        experiment.pipeline.display(),
        if axes.is_empty() { "no axis".to_owned() } else { axes.join(" × ") }
    );
    if let Some(search) = &search {
        crate::say!("at each point, {}", search::describe(search));
    }
    if opts.check {
        return check_stored(&experiment, search.as_ref(), &points, &dir, &runs, opts.tolerance);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create the sweep directory {}", dir.display()))?;
    // One sweep per directory at a time.
    let _lock = crate::rundir::lock::acquire(&dir).map_err(|e| crate::config::ConfigError::new(e.message(&dir)))?;
    match &search {
        Some(search) => search::sweep(&experiment, search, &points, &dir, opts, &runs),
        None => run_grid(file, &experiment, &points, &dir, opts, &runs),
    }
}

/// `--check`: reruns every point (every trial of a search) and compares the traces with the
/// stored ones; 0 when they reproduce.
fn check_stored(
    experiment: &Experiment,
    search: Option<&search::Search>,
    points: &[grid::Point],
    dir: &Path,
    runs: &Runs,
    tolerance: Option<f64>,
) -> anyhow::Result<u8> {
    // The index is written before any point runs: without it nothing was stored here.
    let Ok(index) = crate::rundir::index::Index::read(dir) else {
        return Err(crate::config::ConfigError::new(format!(
            "{} holds no sweep to check (no {}): run the sweep without --check first",
            dir.display(),
            crate::rundir::index::INDEX
        ))
        .into());
    };
    let index_file = dir.join(crate::rundir::index::INDEX);
    let (stored, here) = check::apply_stored_numerics(index.numerics.as_ref(), &index_file, points)?;
    crate::say!("{}", check::first_line(stored.as_ref(), &here));
    let other_cpu = check::other_cpu(stored.as_ref(), &here);
    let stored = stored.map_or_else(|| "an unrecorded CPU".to_owned(), |s| s.to_string());
    if let Some(why) = &other_cpu {
        crate::say!("note: {why}; a bit-for-bit check may fail here");
    }
    let (found, what) = match search {
        None => (check::check(points, dir, runs, tolerance)?, format!("{} points", points.len())),
        Some(search) => {
            let (found, n) = search::check::check(experiment, search, points, dir, runs, tolerance)?;
            (found, format!("{n} trials"))
        }
    };
    if let Some((n, largest)) = found.within {
        crate::say!("{n} float values differ by at most {largest:e} (relative), within --tolerance");
    }
    if found.differences.is_empty() {
        let how = if tolerance.is_some() { "equal within the tolerance" } else { "identical" };
        crate::say!("\n{what} reproduce {}: every non-timing value of every trace is {how}.", dir.display());
        return Ok(0);
    }
    report_differences(&found, dir, other_cpu, &stored, &here);
    Ok(1)
}

/// What `--check` found different, and what would make the check pass.
fn report_differences(
    found: &check::Found,
    dir: &Path,
    other_cpu: Option<String>,
    stored: &str,
    here: &impl std::fmt::Display,
) {
    let n = found.differences.len();
    crate::say_err!(
        "\nerror: {n} {} between {} and a rerun:",
        if n == 1 { "difference" } else { "differences" },
        dir.display()
    );
    for d in found.differences.iter().take(SHOWN) {
        crate::say_err!("  {d}");
    }
    if n > SHOWN {
        crate::say_err!("  ... and {} more", n - SHOWN);
    }
    if found.reran == 0 {
        crate::say_err!("no point was rerun: none has a stored run of its configuration (each line above says why)");
        return;
    }
    match other_cpu {
        Some(why) => crate::say_err!(
            "{why}. {}To check such a table elsewhere, give --tolerance REL (values within a relative \
             difference REL count as equal); to make tables that check bit for bit on any x86-64 CPU, set \
             run.numerics = \"portable\" in the experiment and run it again.",
            match found.beyond {
                b if b > 0.0 => format!(
                    "The largest relative difference is {b:.1e}: --tolerance {:.0e} accepts it. ",
                    10f64.powf(b.log10().ceil())
                ),
                _ => String::new(),
            }
        ),
        None => crate::say_err!(
            "stored on {stored}, rerun on {here}; where the CPUs differ, --tolerance REL accepts values within a \
             relative difference REL"
        ),
    }
}

/// Runs the grid's points that are not complete (all with `--force`), then writes the tables.
fn run_grid(
    file: &Path,
    experiment: &Experiment,
    points: &[grid::Point],
    dir: &Path,
    opts: &Options,
    runs: &Runs,
) -> anyhow::Result<u8> {
    // Written before any point runs (--check needs it); its numerics are this machine's only
    // where a point will run here.
    let runs_here = points.iter().any(|p| opts.force || !execute::is_complete(p, &dir.join(&p.dir)));
    grid::index(file, &experiment.axes, points).write(dir, runs_here)?;
    let outcome = execute::run_points(points, dir, opts.force, opts.fail_fast, runs)?;
    if let Some((sig, point)) = &outcome.stopped {
        match runs {
            Runs::Local => crate::say_err!(
                "\ninterrupted: point {point} was stopped and marked interrupted; run the sweep again to resume it"
            ),
            Runs::Slurm(_) => crate::say_err!(
                "\ninterrupted: the sweep cancelled its Slurm jobs (scancel); run the sweep again to resume them"
            ),
        }
        return Ok(128 + *sig as u8);
    }
    let failed = outcome.failed.len();
    let complete = outcome.ran - failed + outcome.skipped;
    let not_reached = points.len() - outcome.ran - outcome.skipped;
    crate::say!(
        "\n{complete} of {} points complete ({} run now, {} already complete).",
        points.len(),
        outcome.ran - failed,
        outcome.skipped
    );
    if complete > 0 {
        let table = crate::report::write(dir)?;
        crate::say!("\n{table}");
    }
    for (point, why) in &outcome.failed {
        crate::say_err!("error: point {point} failed: {why}");
    }
    if not_reached > 0 {
        crate::say_err!(
            "error: --fail-fast stopped the sweep; {not_reached} of {} points did not run \
             (run the sweep again to resume)",
            points.len()
        );
    }
    Ok(if complete == points.len() { 0 } else { 1 })
}
