//! `runner sweep FILE --check`: reruns every point into a temporary directory and compares every
//! non-timing value of its trace with the stored one. Reproducibility is a claim the tables make;
//! this checks it and lists every difference.
use std::path::Path;

use polars::prelude::*;

use super::execute;
use super::execute::Runs;
use super::grid::Point;
use super::progress::SweepProgress;
use crate::config::Override;
use crate::numerics::Numerics;
use crate::rundir::manifest::{Manifest, Status};
use crate::trace;

pub use crate::trace::TIMING_COLUMNS;

/// Columns added to trace.parquet after traces were committed (the training recipe's, the state's
/// bytes): a stored trace without them is compared on the others; one that has them is compared
/// on them too. Measured columns added later (peak memory, the bytes sent) are never compared:
/// [`TIMING_COLUMNS`].
pub const LATER_COLUMNS: &[&str] =
    &["lr", "grad_norm_mean", "grad_norm_max", "param_bytes", "grad_bytes", "optim_bytes"];

/// Makes the reruns compute under the stored sweep's `MKL_CBWR` (its children inherit it and keep
/// it, whatever their run.numerics says); returns the stored settings and those of the reruns
/// (the points' own: portable ones pin the same kernels on any CPU), or refuses a stored setting
/// MKL would not take.
pub fn apply_stored_numerics(
    stored: Option<&Numerics>,
    index: &Path,
    points: &[Point],
) -> anyhow::Result<(Option<Numerics>, Numerics)> {
    if let Some(stored) = stored {
        let origin = format!("in {}", index.display());
        crate::numerics::check(&stored.mkl_cbwr, &origin).map_err(crate::config::ConfigError::new)?;
        std::env::set_var("MKL_CBWR", &stored.mkl_cbwr);
    }
    let here = match points.first() {
        Some(p) => crate::numerics::of_plan(p.plan.config.run.numerics, p.plan.threads_per_rank),
        None => crate::numerics::current(1),
    };
    Ok((stored.cloned(), here))
}

/// The first line of a check: where the table was made and where it reruns, and, where their
/// kernels differ, how.
pub fn first_line(stored: Option<&Numerics>, here: &Numerics) -> String {
    let Some(stored) = stored else {
        return format!("stored on an unrecorded CPU (a sweep of an older runner); rerunning on {here}");
    };
    let aten = |n: &Numerics| n.kernels.as_ref().map(|k| k.aten.clone());
    let differs = match (aten(stored), aten(here)) {
        (Some(a), Some(b)) if a != b => format!(": other kernels (ATen {a} there, {b} here)"),
        (None, _) => ": other kernels may differ (the table does not record ATen's)".to_owned(),
        _ => String::new(),
    };
    format!("stored on {stored}; rerunning on {here}{differs}")
}

/// Why a rerun here may not give the stored bits: the table was computed with a CPU's own
/// kernels, on another CPU model or with another ATen capability; or under the portable
/// numerics of an older runner, which pinned MKL alone. None where every kernel was pinned, or
/// the same CPU model computed with the same kernels.
pub fn other_cpu(stored: Option<&Numerics>, here: &Numerics) -> Option<String> {
    let stored = stored?;
    if stored.is_portable() {
        return None;
    }
    let aten = |n: &Numerics| n.kernels.as_ref().map(|k| k.aten.clone());
    if stored.kernels.is_none() && crate::numerics::mkl::branch(&stored.mkl_cbwr) == crate::numerics::MKL_CBWR {
        return Some(
            "this table was computed under the portable numerics of an older runner, which pinned MKL's kernels \
             alone: ATen's vectorised kernels and oneDNN's chose by the CPU (unrecorded), and differ between CPUs \
             with other vector instructions (AVX2, AVX-512) in the last bits; regenerate it with --force"
                .to_owned(),
        );
    }
    let same = stored.cpu == here.cpu && aten(stored).is_some_and(|a| Some(a) == aten(here));
    let named = |n: &Numerics| match aten(n) {
        Some(a) => format!("{} (ATen {a})", n.cpu),
        None => n.cpu.clone(),
    };
    (!same).then(|| {
        format!(
            "this table was computed with its CPU's own kernels (run.numerics = \"native\") on {}, and is checked \
             on {}: native kernels differ between CPU models and instruction sets in the last bits of their sums",
            named(stored),
            named(here)
        )
    })
}

/// Float values that differed within a tolerance: how many, and the largest relative difference.
pub type Within = Option<(usize, f64)>;

/// What --check found: every difference (a line each), the float values within the tolerance,
/// and the largest relative difference of the float values beyond it.
#[derive(Debug, Default)]
pub struct Found {
    /// The points rerun (the others had no stored run of their configuration to compare with).
    pub reran: usize,
    pub differences: Vec<String>,
    pub within: Within,
    pub beyond: f64,
}

impl Found {
    pub(super) fn add(&mut self, dir: &str, (differences, within, beyond): (Vec<String>, Within, f64)) {
        self.differences.extend(differences.into_iter().map(|d| format!("{dir}: {d}")));
        if let Some((n, r)) = within {
            let (m, q) = self.within.unwrap_or((0, 0.0));
            self.within = Some((m + n, q.max(r)));
        }
        self.beyond = self.beyond.max(beyond);
    }
}

/// Every difference between the stored sweep in `sweep_dir` and a rerun of its points (run
/// where `runs` says: under Slurm, side by side, into a folder in the sweep directory that every
/// node sees).
pub fn check(points: &[Point], sweep_dir: &Path, runs: &Runs, tolerance: Option<f64>) -> anyhow::Result<Found> {
    let scratch = match runs {
        Runs::Local => tempfile::Builder::new().prefix("runner-check-").tempdir()?,
        Runs::Slurm(_) => tempfile::Builder::new().prefix(".check-").tempdir_in(sweep_dir)?,
    };
    let mut progress = SweepProgress::new(points.len(), points.len(), "check");
    let mut found = Found::default();
    let mut stored = Vec::new();
    for point in points {
        match stored_run(point, &sweep_dir.join(&point.dir)) {
            Ok(point) => stored.push(point),
            Err(why) => {
                progress.skip(&point.dir, &why);
                found.differences.push(format!("{}: {why}", point.dir));
            }
        }
    }
    found.reran = stored.len();
    let stored: Vec<&Point> = stored.iter().collect();
    let rerun_dir = |point: &Point| scratch.path().join(&point.dir);
    let mut compared = |point: &Point, result: Result<(), String>| {
        let this = match result {
            Err(why) => (vec![format!("the rerun failed: {why}")], None, 0.0),
            Ok(()) => compare_runs(&sweep_dir.join(&point.dir), &rerun_dir(point), tolerance),
        };
        let outcome = match this.0.len() {
            0 => "reproduced".to_owned(),
            1 => "1 difference".to_owned(),
            n => format!("{n} differences"),
        };
        found.add(&point.dir, this);
        outcome
    };
    match runs {
        Runs::Local => {
            for point in stored {
                progress.start(&point.dir);
                let result = execute::run_point(point, &rerun_dir(point));
                let outcome = compared(point, result);
                progress.finish(&point.dir, &outcome);
            }
        }
        Runs::Slurm(resources) => {
            let jobs: Vec<_> = stored.iter().map(|p| (*p, rerun_dir(p))).collect();
            let batch = super::slurm::run_all(&jobs, resources, &mut progress, false)?;
            for ((point, _), result) in jobs.iter().zip(batch.results) {
                let result = result.unwrap_or_else(|| Err("the job was cancelled".into()));
                let outcome = compared(point, result);
                progress.line(&format!("{}: {outcome}", point.dir));
            }
        }
    }
    progress.clear();
    Ok(found)
}

/// Every difference between the traces of two run directories.
pub(super) fn compare_runs(stored: &Path, rerun: &Path, tolerance: Option<f64>) -> (Vec<String>, Within, f64) {
    match (
        trace::read_parquet(&stored.join(crate::rundir::TRACE)),
        trace::read_parquet(&rerun.join(crate::rundir::TRACE)),
    ) {
        (Ok(a), Ok(b)) => compare_all(&a, &b, tolerance),
        (Err(e), _) | (_, Err(e)) => (vec![format!("{e:#}")], None, 0.0),
    }
}

/// The point to rerun against the stored run in `dir`: `point` itself when the stored run is of
/// exactly its configuration; `point` under the stored run's `run.numerics` when that is all that
/// changed (a check reruns under the stored numerics); or why there is none to check, naming
/// the keys that changed.
fn stored_run(point: &Point, dir: &Path) -> Result<Point, String> {
    let m = Manifest::read(dir).map_err(|e| format!("no stored run to check ({e:#})"))?;
    if m.status != Status::Complete {
        return Err(format!("the stored run is {:?}, not complete; run the sweep first", m.status));
    }
    if !dir.join(crate::rundir::TRACE).is_file() {
        return Err(format!("{} is missing", dir.join(crate::rundir::TRACE).display()));
    }
    if m.run_id == point.plan.run_id {
        return Ok(point.clone());
    }
    let changed =
        format!("the configuration changed since the stored run (run id {} then, {} now)", m.run_id, point.plan.run_id);
    let then = crate::plan::Plan::load(&dir.join(crate::rundir::PLAN)).map_err(|e| format!("{changed}; {e}"))?;
    let differences = then.differences(&point.plan);
    if let [d] = &differences[..] {
        if d.key == "run.numerics" {
            let stored = toml::Value::try_from(then.config.run.numerics).map_err(|e| e.to_string())?;
            let mut overrides = point.overrides.clone();
            overrides.push(Override {
                label: "sweep --check, the stored run's".into(),
                text: format!("run.numerics={stored}"),
            });
            let plan = crate::config::resolve(&point.plan.pipeline_file, &overrides)
                .and_then(crate::plan::Plan::new)
                .map_err(|e| format!("{changed}: {d}; under the stored numerics: {e}"))?;
            if plan.run_id == m.run_id {
                return Ok(Point { plan, overrides, ..point.clone() });
            }
        }
    }
    let what: Vec<String> = differences.iter().map(|d| d.to_string()).collect();
    Err(format!(
        "{changed}: {}; --check reruns a stored configuration: restore these values to check it, or run the sweep \
         without --check to store the new one",
        if what.is_empty() {
            "no key differs, its input files or extended values do".to_owned()
        } else {
            what.join(", ")
        }
    ))
}

/// Every difference in the non-timing columns of two traces, each naming the row (epoch, rank),
/// the column, both values and their relative difference; float values within `tolerance`
/// (relative) are counted apart, with the largest such difference.
pub fn compare(stored: &DataFrame, rerun: &DataFrame, tolerance: Option<f64>) -> (Vec<String>, Within) {
    let (out, within, _) = compare_all(stored, rerun, tolerance);
    (out, within)
}

/// [`compare`], and the largest relative difference of the float values beyond the tolerance.
fn compare_all(stored: &DataFrame, rerun: &DataFrame, tolerance: Option<f64>) -> (Vec<String>, Within, f64) {
    let mut out = Vec::new();
    let mut within: Within = None;
    let mut beyond = 0.0f64;
    let names = |df: &DataFrame| -> Vec<String> {
        df.get_column_names().iter().map(|n| n.to_string()).filter(|n| !TIMING_COLUMNS.contains(&n.as_str())).collect()
    };
    let (a, b) = (names(stored), names(rerun));
    for n in a.iter().filter(|n| !b.contains(n)) {
        out.push(format!("column `{n}` is stored but absent from the rerun"));
    }
    for n in b.iter().filter(|n| !a.contains(n) && !LATER_COLUMNS.contains(&n.as_str())) {
        out.push(format!("column `{n}` is in the rerun but not stored"));
    }
    if stored.height() != rerun.height() {
        out.push(format!("the stored trace has {} rows, the rerun {}", stored.height(), rerun.height()));
    }
    let rows = stored.height().min(rerun.height());
    let at = |i: usize| -> String {
        let get = |c: &str| {
            stored.column(c).ok().and_then(|s| s.get(i).ok()).map(|v| v.to_string()).unwrap_or_else(|| "?".into())
        };
        format!("row {i} (epoch {}, rank {})", get("epoch"), get("rank"))
    };
    for name in a.iter().filter(|n| b.contains(n)) {
        let (x, y) = (stored.column(name).expect("listed"), rerun.column(name).expect("listed"));
        if x.dtype() != y.dtype() {
            out.push(format!("column `{name}` is {} stored but {} in the rerun", x.dtype(), y.dtype()));
            continue;
        }
        for i in 0..rows {
            let (u, v) = (x.get(i).expect("in range"), y.get(i).expect("in range"));
            if same(&u, &v) {
                continue;
            }
            match (relative(&u, &v), tolerance) {
                (Some(r), Some(t)) if r <= t => {
                    let (n, q) = within.unwrap_or((0, 0.0));
                    within = Some((n + 1, q.max(r)));
                }
                (r, _) => {
                    beyond = beyond.max(r.unwrap_or(0.0));
                    let by = r.map(|r| format!(" (relative difference {r:.1e})")).unwrap_or_default();
                    out.push(format!("{}: `{name}` stored {} but the rerun gives {}{by}", at(i), exact(&u), exact(&v)));
                }
            }
        }
    }
    (out, within, beyond)
}

/// |a − b| / max(|a|, |b|) of two finite floats.
fn relative(a: &AnyValue, b: &AnyValue) -> Option<f64> {
    let (x, y) = match (a, b) {
        (AnyValue::Float64(x), AnyValue::Float64(y)) => (*x, *y),
        (AnyValue::Float32(x), AnyValue::Float32(y)) => (*x as f64, *y as f64),
        _ => return None,
    };
    (x.is_finite() && y.is_finite()).then(|| (x - y).abs() / x.abs().max(y.abs()))
}

/// Bit-for-bit equality (NaN equals NaN; 0.0 and −0.0 differ).
fn same(a: &AnyValue, b: &AnyValue) -> bool {
    match (a, b) {
        (AnyValue::Float64(x), AnyValue::Float64(y)) => x.to_bits() == y.to_bits(),
        (AnyValue::Float32(x), AnyValue::Float32(y)) => x.to_bits() == y.to_bits(),
        _ => a == b,
    }
}

/// A value with every digit it has (floats in their shortest exact form).
fn exact(v: &AnyValue) -> String {
    match v {
        AnyValue::Float64(x) => format!("{x:?}"),
        AnyValue::Float32(x) => format!("{x:?}"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{epochs_frame, EpochRow, EPOCH_COLUMNS};

    fn row(epoch: u32, rank: u32, loss: f64, epoch_s: f64) -> EpochRow {
        EpochRow {
            step: epoch as u64,
            epoch,
            rank,
            world_size: 2,
            train_loss: loss,
            train_acc: 0.5,
            global_train_loss: loss,
            global_train_acc: 0.5,
            val_loss: (rank == 0).then_some(0.7),
            val_acc: (rank == 0).then_some(0.6),
            samples: 100,
            steps: 4,
            epoch_s,
            samples_per_s: 100.0 / epoch_s,
            comm_s: epoch_s / 10.0,
            compute_s: epoch_s / 2.0,
            lr: 0.1,
            ..Default::default()
        }
    }

    #[test]
    fn the_timing_columns_are_trace_columns() {
        for c in TIMING_COLUMNS {
            assert!(EPOCH_COLUMNS.contains(c), "{c}");
        }
    }

    #[test]
    fn timings_may_differ_and_nothing_else_may() {
        let a = epochs_frame("r", &[row(1, 0, 0.9, 1.0), row(1, 1, 0.9, 1.0)]).unwrap();
        let b = epochs_frame("r", &[row(1, 0, 0.9, 2.5), row(1, 1, 0.9, 0.1)]).unwrap();
        assert_eq!(compare(&a, &b, None).0, Vec::<String>::new());

        let c = epochs_frame("r", &[row(1, 0, 0.9, 1.0), row(1, 1, 0.9000000000000001, 1.0)]).unwrap();
        assert_eq!(
            compare(&a, &c, None).0,
            [
                "row 1 (epoch 1, rank 1): `train_loss` stored 0.9 but the rerun gives 0.9000000000000001 \
                 (relative difference 1.2e-16)",
                "row 1 (epoch 1, rank 1): `global_train_loss` stored 0.9 but the rerun gives 0.9000000000000001 \
                 (relative difference 1.2e-16)",
            ]
        );
        // Within a tolerance: counted, with the largest relative difference, not listed.
        let (found, within) = compare(&a, &c, Some(1e-12));
        assert!(found.is_empty(), "{found:?}");
        let (n, largest) = within.unwrap();
        assert_eq!(n, 2);
        assert!(largest > 1e-16 && largest < 1e-15, "{largest}");
        let short = epochs_frame("r", &[row(1, 0, 0.9, 1.0)]).unwrap();
        assert_eq!(compare(&a, &short, None).0, ["the stored trace has 2 rows, the rerun 1"]);
    }
}
