//! A search's report, rebuilt from its trials' traces: each trial's metric at each rung is read
//! from its trace ([`trace_of`]), the promotions are decided again from them
//! ([`crate::search::halving::decide`], as the search decided them), and every trial is listed with
//! its values, the budget it reached, its metric there and its status (`table.md`, `table.csv`,
//! `summary.parquet`), with the plots ([`super::search_plot`]) and the best trial as a pipeline
//! file to run again (`best.toml`).
use std::path::Path;

use polars::prelude::*;

use crate::rundir::atomic_write;
use crate::rundir::index::{Index, SearchIndex};
use crate::rundir::manifest::{Manifest, Status as RunStatus};
use crate::search::halving::{self, Outcome, Status};

/// Where a search's trials are compared.
#[derive(Debug, Clone, Copy)]
pub enum At<'a> {
    /// At the end of each trial's run (no ASHA: one rung).
    End,
    /// At the trace rows of these optimizer steps.
    Steps(&'a [u64]),
    /// At the trace rows that end these epochs.
    Epochs(&'a [u64]),
}

impl<'a> At<'a> {
    pub fn of(search: &'a SearchIndex) -> At<'a> {
        match search.unit.as_deref() {
            Some("epochs") => At::Epochs(&search.rungs),
            Some(_) => At::Steps(&search.rungs),
            None => At::End,
        }
    }

    pub fn rungs(&self) -> usize {
        match self {
            At::End => 1,
            At::Steps(r) | At::Epochs(r) => r.len(),
        }
    }
}

/// What a trial's run directory says of it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrialTrace {
    /// The metric at each rung, where the run reached it.
    pub outcomes: Vec<Option<Outcome>>,
    /// The optimizer step of each rung's row.
    pub steps: Vec<Option<u64>>,
    /// Why the run failed, when it did.
    pub failure: Option<String>,
}

/// Trial `run_dir`'s results at `at` from rank 0's rows of its trace. With `failures`, a run
/// whose manifest says it failed has failed at the first rung it did not reach.
pub fn trace_of(run_dir: &Path, at: At, metric: &str, failures: bool) -> TrialTrace {
    let n = at.rungs();
    let mut out = TrialTrace { outcomes: vec![None; n], steps: vec![None; n], failure: None };
    let manifest = Manifest::read(run_dir).ok();
    let committed = committed_step(run_dir, manifest.as_ref());
    if let Ok(mut rows) = rank0_rows(run_dir, metric) {
        rows.retain(|row| committed.is_none_or(|last| row.step <= last));
        for k in 0..n {
            let row = match at {
                At::End => rows.last().filter(|_| manifest.as_ref().is_some_and(|m| m.status == RunStatus::Complete)),
                At::Steps(r) => rows.iter().rev().find(|row| row.step == r[k]),
                At::Epochs(r) => rows.iter().rev().find(|row| row.epoch == r[k]),
            };
            let Some(row) = row else { continue };
            out.steps[k] = Some(row.step);
            out.outcomes[k] = Some(match row.value {
                Some(v) => Outcome::Value(v),
                None => {
                    out.failure = Some(format!(
                        "the trace's row at step {} has no {metric} (it was not measured there)",
                        row.step
                    ));
                    Outcome::Failed
                }
            });
        }
    }
    if let Some(m) = manifest.filter(|m| failures && m.status == RunStatus::Failed) {
        if let Some(k) = out.outcomes.iter().position(Option::is_none) {
            out.outcomes[k] = Some(Outcome::Failed);
            out.failure = Some(m.failure.unwrap_or_else(|| "the run failed".into()));
        }
    }
    out
}

/// The last step whose rows count as done in `run_dir` (`None`: all of them): a rung is done
/// only once its checkpoint and its model are committed. A run that is not complete (a promotion
/// stopped after its last trace row, before its final checkpoint and model) counts up to the
/// step its model.safetensors was written after, and nothing without one; a model file of an
/// older runner, which does not say its step, counts every row as before.
fn committed_step(run_dir: &Path, manifest: Option<&Manifest>) -> Option<u64> {
    if manifest.is_none_or(|m| m.status == RunStatus::Complete) {
        return None;
    }
    let model = run_dir.join(crate::rundir::MODEL);
    if !model.exists() {
        return Some(0);
    }
    let file = crate::tensorfile::TensorFile::open(&model).ok()?;
    file.metadata()?.get(crate::checkpoint::model::MODEL_STEP)?.parse().ok()
}

struct Row {
    step: u64,
    epoch: u64,
    value: Option<f64>,
}

/// Rank 0's rows, in the trace's order.
fn rank0_rows(run_dir: &Path, metric: &str) -> anyhow::Result<Vec<Row>> {
    let df = crate::trace::read_parquet(&run_dir.join(crate::rundir::TRACE))?;
    let df = df.filter(&df.column("rank")?.cast(&DataType::UInt32)?.u32()?.equal(0))?;
    let col = |name: &str| -> anyhow::Result<Column> { Ok(df.column(name)?.cast(&DataType::UInt64)?) };
    let (steps, epochs) = (col("step")?, col("epoch")?);
    let values = df.column(metric)?.cast(&DataType::Float64)?;
    let (steps, epochs, values) = (steps.u64()?, epochs.u64()?, values.f64()?);
    Ok((0..df.height())
        .map(|i| Row { step: steps.get(i).unwrap_or(0), epoch: epochs.get(i).unwrap_or(0), value: values.get(i) })
        .collect())
}

/// One trial as the report shows it.
#[derive(Debug, Clone)]
pub struct Trial {
    /// The grid point it belongs to ("" without a grid), and its directory.
    pub group: String,
    pub dir: String,
    /// Its searched keys' values (TOML text).
    pub values: Vec<(String, String)>,
    pub trace: TrialTrace,
    pub status: Status,
    pub best: bool,
}

/// Every trial of the search in `index`, grouped by grid point, with the promotions decided again.
pub fn trials(dir: &Path, index: &Index, search: &SearchIndex) -> Vec<Trial> {
    let at = At::of(search);
    let keys: Vec<&str> = search.space.iter().map(|(k, _)| k.as_str()).collect();
    let mut out: Vec<Trial> = index
        .points
        .iter()
        .map(|p| Trial {
            group: p.dir.rsplit_once('/').map(|(g, _)| g.to_owned()).unwrap_or_default(),
            dir: p.dir.clone(),
            values: p.values.iter().filter(|(k, _)| keys.contains(&k.as_str())).cloned().collect(),
            trace: trace_of(&dir.join(&p.dir), at, &search.metric, true),
            status: Status::Pending(0),
            best: false,
        })
        .collect();
    for group in groups(&out) {
        let members: Vec<usize> = (0..out.len()).filter(|i| out[*i].group == group).collect();
        let results: Vec<Vec<Option<Outcome>>> = members.iter().map(|i| out[*i].trace.outcomes.clone()).collect();
        let decisions = halving::decide(rule(search), &results, search.trials, search.minimize);
        for (t, &i) in members.iter().enumerate() {
            out[i].status = decisions.status(t, &results[t]);
        }
        if let Some(best) = best_of(&members.iter().map(|i| &out[*i]).collect::<Vec<_>>(), search.minimize) {
            out[members[best]].best = true;
        }
    }
    out
}

/// The grid points' names, in the order of the trials.
pub fn groups(trials: &[Trial]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for t in trials {
        if !out.contains(&t.group) {
            out.push(t.group.clone());
        }
    }
    out
}

/// The best trial of a group: the best metric among those at the highest rung any reached.
fn best_of(trials: &[&Trial], minimize: bool) -> Option<usize> {
    let reached =
        |t: &Trial| t.trace.outcomes.iter().rposition(|o| matches!(o, Some(Outcome::Value(v)) if !v.is_nan()));
    let top = trials.iter().filter_map(|t| reached(t)).max()?;
    (0..trials.len()).filter(|i| reached(trials[*i]) == Some(top)).min_by(|a, b| {
        let score = |i: usize| halving::score(trials[i].trace.outcomes[top].expect("reached"), minimize);
        score(*a).total_cmp(&score(*b)).then(a.cmp(b))
    })
}

/// The highest rung a trial has a result at, and that result.
pub fn reached(trace: &TrialTrace) -> Option<(usize, Outcome)> {
    trace.outcomes.iter().enumerate().rev().find_map(|(k, o)| o.map(|o| (k, o)))
}

/// The status as the table says it; a failure's whole reason, its lines joined (a message's first
/// line is often only "invalid configuration:").
pub fn status_text(t: &Trial) -> String {
    let why = || match t.trace.failure.as_deref().map(one_line) {
        Some(why) if !why.is_empty() => why,
        _ => "see its run.log".to_owned(),
    };
    let text = match t.status {
        Status::Complete => "complete".to_owned(),
        Status::Stopped(k) => format!("stopped at rung {k}"),
        Status::Waiting(k) => format!("waiting at rung {k}"),
        Status::Pending(k) => format!("not run to rung {k}"),
        Status::Failed(k) => format!("failed at rung {k}: {}", why()),
    };
    if t.best {
        format!("{text}, best")
    } else {
        text
    }
}

/// A message of several lines as one: each line trimmed, empty ones dropped.
fn one_line(text: &str) -> String {
    text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// A number with four significant digits, as the table shows it.
pub fn short(text: &str) -> String {
    match text.parse::<f64>() {
        Ok(x) if text.contains(['.', 'e', 'E']) => {
            if x != 0.0 && !(1e-3..1e4).contains(&x.abs()) {
                format!("{x:.3e}")
            } else {
                let digits = (3 - x.abs().log10().floor().max(-3.0) as i64).clamp(0, 6) as usize;
                format!("{x:.digits$}")
            }
        }
        _ => text.to_owned(),
    }
}

/// Rebuilds the search's table, plots and best.toml in `dir`; returns table.md.
pub fn write(dir: &Path, index: &Index, search: &SearchIndex) -> anyhow::Result<String> {
    let trials = trials(dir, index, search);
    if trials.iter().all(|t| reached(&t.trace).is_none()) {
        let why = format!(
            "{} has no trial with a result to report on ({} trials: run `runner sweep {}` first)",
            dir.display(),
            trials.len(),
            index.experiment
        );
        return Err(crate::config::ConfigError::new(why).into());
    }
    let md = super::search_table::markdown(index, search, &trials);
    let mut frame = super::search_table::frame(search, &trials)?;
    crate::trace::write_parquet(&dir.join("summary.parquet"), &mut frame)?;
    atomic_write(&dir.join("table.csv"), &super::table::csv(&mut frame)?)?;
    atomic_write(&dir.join("table.md"), md.as_bytes())?;
    let mut written = vec!["table.md", "table.csv", "summary.parquet"];
    written.extend(super::search_plot::write_all(dir, search, &trials)?);
    for (n, group) in groups(&trials).iter().enumerate() {
        let Some(best) = trials.iter().position(|t| t.best && t.group == *group) else { continue };
        let name = if group.is_empty() { "best.toml".to_owned() } else { format!("{group}/best.toml") };
        let text = best_toml(index, search, best, &trials[best])?;
        atomic_write(&dir.join(&name), text.as_bytes())?;
        if n < 3 {
            written.push(if group.is_empty() { "best.toml" } else { "<point>/best.toml" });
        }
    }
    written.dedup();
    Ok(format!("{md}\nWritten in {}: {}", dir.display(), written.join(", ")))
}

/// The best trial as a pipeline file: `extends` the search's pipeline, with the trial's
/// overrides at its full budget, so that `runner run best.toml` trains it again.
fn best_toml(index: &Index, search: &SearchIndex, i: usize, trial: &Trial) -> anyhow::Result<String> {
    let mut table = toml::Table::new();
    for o in &search.overrides[i] {
        let (key, value) = o.split_once('=').ok_or_else(|| anyhow::anyhow!("a bad override in sweep.json: {o}"))?;
        let value: toml::Table = toml::from_str(&format!("v = {value}"))?;
        let parts: Vec<&str> = key.split('.').collect();
        let mut t = &mut table;
        for part in &parts[..parts.len() - 1] {
            t = t
                .entry(part.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .ok_or_else(|| anyhow::anyhow!("sweep.json sets both {part} and a key below it"))?;
        }
        let value = rebased(key.trim(), value["v"].clone(), &search.pipeline, &trial.group);
        t.insert(parts[parts.len() - 1].to_owned(), value);
    }
    let result = match reached(&trial.trace) {
        Some((k, Outcome::Value(v))) => {
            format!("{} {v} at step {}", search.metric, trial.trace.steps[k].unwrap_or_default())
        }
        _ => String::new(),
    };
    let head = format!(
        "# The best trial of {} ({}: {result}), as a pipeline file that `runner sweep` and `runner report` write\n\
         # from the trials' traces:\n\
         # `runner run` it to train the same run again, to the trial's full budget.\n\
         extends = {}\n\n",
        index.experiment,
        trial.dir,
        toml::Value::String(relative_up(&search.pipeline, &trial.group))
    );
    Ok(head + &toml::to_string(&table)?)
}

/// A path a trial's override set (relative to the pipeline file, as a `--set` path is), as the
/// best.toml in the sweep directory's `sub` names it: relative to best.toml, the file that sets it
/// there. `pipeline` is relative to the sweep directory; other keys and absolute paths are kept.
fn rebased(key: &str, value: toml::Value, pipeline: &str, sub: &str) -> toml::Value {
    if !crate::config::paths::PATH_KEYS.contains(&key) {
        return value;
    }
    let dir = Path::new(pipeline).parent().unwrap_or(Path::new(""));
    let one = |v: toml::Value| match v.as_str().map(Path::new).filter(|p| p.is_relative()) {
        Some(p) => toml::Value::String(relative_up(
            &crate::config::extends::normalize(&dir.join(p)).display().to_string(),
            sub,
        )),
        None => v,
    };
    match value {
        toml::Value::Array(paths) => toml::Value::Array(paths.into_iter().map(one).collect()),
        v => one(v),
    }
}

/// `path` (relative to the sweep directory) as seen from its subdirectory `sub`.
fn relative_up(path: &str, sub: &str) -> String {
    let depth = if sub.is_empty() { 0 } else { sub.split('/').count() };
    "../".repeat(depth) + path
}

/// How the search's rungs promoted, as its index records.
pub(super) fn rule(search: &SearchIndex) -> halving::Rule {
    halving::Rule { eta: search.reduction_factor.max(1), synchronous: search.synchronous }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_show_four_significant_digits() {
        assert_eq!(short("0.0031622776601683794"), "0.003162");
        assert_eq!(short("0.35124"), "0.3512");
        assert_eq!(short("12.5"), "12.50");
        assert_eq!(short("1.5e-5"), "1.500e-5");
        assert_eq!(short("64"), "64");
        assert_eq!(short("[64, 32]"), "[64, 32]");
        assert_eq!(relative_up("../pipelines/p.toml", "world_size=2"), "../../pipelines/p.toml");
        let path = |s: &str| toml::Value::String(s.into());
        assert_eq!(rebased("load.path", path("data/a.bin"), "../p/p.toml", "world_size=2"), path("../../p/data/a.bin"));
        assert_eq!(rebased("wrap.init", path("/abs/m"), "../p/p.toml", ""), path("/abs/m"));
        assert_eq!(rebased("run.name", path("data/a.bin"), "../p/p.toml", ""), path("data/a.bin"));
    }

    #[test]
    fn a_failed_trial_shows_its_whole_reason() {
        let failure =
            "p.toml: invalid configuration:\n  `train.lr` (search [search.space] train.lr=-1.0): must be above 0\n";
        let trace =
            TrialTrace { outcomes: vec![Some(Outcome::Failed)], steps: vec![None], failure: Some(failure.into()) };
        let t = Trial {
            group: String::new(),
            dir: "trial-000".into(),
            values: vec![],
            trace,
            status: Status::Failed(0),
            best: false,
        };
        assert_eq!(
            status_text(&t),
            "failed at rung 0: p.toml: invalid configuration: `train.lr` (search [search.space] train.lr=-1.0): must be above 0"
        );
    }
}
