//! `runner sweep FILE --check` of a search: the whole search runs again from nothing into a
//! temporary directory (under Slurm, one in the sweep directory that every node sees), with the
//! same parallelism, and is compared with the stored one: the same trials with the same values,
//! and every non-timing value of every trial's trace ([`crate::sweep::check`]'s comparison),
//! and its model.safetensors where the stored trial keeps one (a committed search may leave its
//! weights out). Equal traces give equal promotions and an equal table, which are computed from
//! them; equal models say that each trial's last rung was finished, not only traced.
use std::path::Path;

use super::{drive, Search};
use crate::rundir::index::Index;
use crate::sweep::check::{compare_runs, Found};
use crate::sweep::execute::Runs;
use crate::sweep::experiment::Experiment;
use crate::sweep::grid::Point;
use crate::tensorfile::TensorFile;

/// Every difference between the stored search in `sweep_dir` and a rerun, and how many trials
/// were compared.
pub fn check(
    experiment: &Experiment,
    search: &Search,
    points: &[Point],
    sweep_dir: &Path,
    runs: &Runs,
    tolerance: Option<f64>,
) -> anyhow::Result<(Found, usize)> {
    let stored = Index::read(sweep_dir)?;
    let mut found = Found::default();
    if stored.search.is_none() {
        found.differences.push(format!("{} holds a grid, not a search: run the sweep first", sweep_dir.display()));
        return Ok((found, 0));
    }
    let scratch = match runs {
        Runs::Local => tempfile::Builder::new().prefix("runner-check-").tempdir()?,
        Runs::Slurm(_) => tempfile::Builder::new().prefix(".check-").tempdir_in(sweep_dir)?,
    };
    crate::say!("rerunning the search into {}", scratch.path().display());
    let mut write_index = |studies: &[drive::Study], ran: bool| -> anyhow::Result<()> {
        let trials: Vec<_> = studies.iter().flat_map(|s| s.trials.iter().map(move |t| (s.at, t))).collect();
        super::index(experiment, search, scratch.path(), points, &trials).write(scratch.path(), ran)
    };
    let how = drive::Options { force: true, fail_fast: false };
    let finished = drive::run(experiment, search, points, scratch.path(), runs, how, &mut write_index)?;
    if let Some(sig) = finished.stopped {
        anyhow::bail!("the check was stopped by signal {sig}");
    }
    let rerun = Index::read(scratch.path())?;
    let mut compared = 0;
    for (i, p) in stored.points.iter().enumerate() {
        let Some(q) = rerun.points.get(i) else {
            found.differences.push(format!(
                "{}: stored, but the rerun proposed {} trials in all",
                p.dir,
                rerun.points.len()
            ));
            continue;
        };
        if p.dir != q.dir || p.values != q.values {
            let show =
                |v: &[(String, String)]| v.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ");
            found.differences.push(format!(
                "{}: stored with {}, but the rerun proposes {} ({})",
                p.dir,
                show(&p.values),
                q.dir,
                show(&q.values)
            ));
            continue;
        }
        compared += 1;
        let (a, b) = (sweep_dir.join(&p.dir), scratch.path().join(&q.dir));
        let ran = |d: &Path| d.join(crate::rundir::TRACE).is_file();
        let this = match (ran(&a), ran(&b)) {
            (true, true) => {
                let (mut differences, within, beyond) = compare_runs(&a, &b, tolerance);
                differences.extend(compare_models(&a, &b, tolerance));
                (differences, within, beyond)
            }
            (false, false) => (vec![], None, 0.0),
            (true, false) => (vec!["the stored trial ran, the rerun's did not".into()], None, 0.0),
            (false, true) => (vec!["the rerun's trial ran, the stored one did not".into()], None, 0.0),
        };
        found.add(&p.dir, this);
    }
    for q in rerun.points.iter().skip(stored.points.len()) {
        found.differences.push(format!("{}: proposed by the rerun, not stored", q.dir));
    }
    Ok((found, compared))
}

/// Every difference between the models of two trial directories, tensor by tensor (their
/// metadata aside): bit for bit, or within the relative `tolerance`. None where the stored trial
/// keeps no model.safetensors.
fn compare_models(stored: &Path, rerun: &Path, tolerance: Option<f64>) -> Vec<String> {
    let (a, b) = (stored.join(crate::rundir::MODEL), rerun.join(crate::rundir::MODEL));
    if !a.is_file() {
        return vec![];
    }
    let (a, b) = match (TensorFile::open(&a), TensorFile::open(&b)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) => return vec![format!("the stored model.safetensors cannot be read: {e}")],
        (_, Err(e)) => return vec![format!("the rerun's model.safetensors cannot be read: {e}")],
    };
    let names = |f: &TensorFile| f.entries().into_iter().map(|(n, _)| n).collect::<std::collections::BTreeSet<_>>();
    if names(&a) != names(&b) {
        return vec!["model.safetensors: the stored model and the rerun's hold other tensors".into()];
    }
    let mut out = Vec::new();
    for name in names(&a) {
        let differs = match tolerance {
            None => a.bytes(&name, u64::MAX).ok() != b.bytes(&name, u64::MAX).ok(),
            Some(tol) => match (a.tensor(&name, u64::MAX), b.tensor(&name, u64::MAX)) {
                (Ok(x), _) if x.numel() == 0 => false,
                (Ok(x), Ok(y)) if x.size() == y.size() => {
                    let (x, y) = (x.to_kind(tch::Kind::Double), y.to_kind(tch::Kind::Double));
                    let scale = x.abs().max().double_value(&[]).max(f64::MIN_POSITIVE);
                    (x - y).abs().max().double_value(&[]) / scale > tol
                }
                _ => true,
            },
        };
        if differs {
            out.push(format!("model.safetensors: `{name}` differs between the stored model and the rerun's"));
        }
    }
    out
}
