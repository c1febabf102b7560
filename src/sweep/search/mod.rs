//! `runner sweep` of an experiment with a `[search]` table ([`spec`]): at every point of the grid,
//! a search proposes trials ([`crate::search::Sampler`]) and stops the losers early
//! ([`crate::search::Scheduler`]). A trial is one run directory (`trial-007/`, under the point's
//! directory where there is a grid), run by `runner run` like a grid's point ([`trial`]); a
//! promoted trial continues the same run from its rung's checkpoint (`--resume` with a longer
//! `train.steps`), exactly as an uninterrupted run to the longer budget. Trials run `parallel` at
//! a time, locally or as Slurm jobs ([`pool`]); [`drive`] proposes, decides and starts them.
//!
//! The search's state is what its trials' run directories hold: every decision is recomputed from
//! the trials' traces, so an interrupted search resumes where it stopped (finished rungs are not
//! run again), and the same seed gives the same trials, promotions and table whatever the
//! parallelism and the order in which trials finish.
pub mod bounds;
pub mod check;
pub mod drive;
pub mod pool;
pub mod trial;

use std::path::{Path, PathBuf};

use crate::search::budget::Unit;
use crate::search::spec::{self, Spec};

use super::experiment::Experiment;
use super::grid::Point;
use crate::config::schema::{Config, ScheduleKind};
use crate::config::ConfigError;
use crate::report::search::At;
use crate::rundir::index::{Index, IndexPoint, SearchIndex};
use crate::search::halving::Rule;
use crate::search::Scheduler;

/// The source config.toml names for a trial's searched values.
pub use super::experiment::SEARCH_LABEL;

/// A search ready to run at the grid's points.
#[derive(Debug, Clone)]
pub struct Search {
    pub spec: Spec,
    pub scheduler: Scheduler,
    /// What the rungs count (successive halving only).
    pub unit: Option<Unit>,
}

impl Search {
    /// The rungs' budgets (none without successive halving).
    pub fn rungs(&self) -> &[u64] {
        match &self.scheduler {
            Scheduler::Full => &[],
            Scheduler::Halving { rungs, .. } => rungs,
        }
    }

    /// The source config.toml names for the keys the scheduler sets on a trial (its budget,
    /// validation and checkpoints at rungs).
    pub fn rung_label(&self) -> &'static str {
        if self.scheduler.rule().synchronous {
            "search [sha]"
        } else {
            "search [asha]"
        }
    }

    /// Where trials are compared, as the report reads them.
    pub fn at(&self) -> At<'_> {
        match self.unit {
            None => At::End,
            Some(Unit::Steps) => At::Steps(self.rungs()),
            Some(Unit::Epochs) => At::Epochs(self.rungs()),
        }
    }

    /// The keys the scheduler sets on every trial of a point whose configuration is `c`: a trace row (with
    /// validation) and a checkpoint at every rung, unless the pipeline has its own.
    pub(super) fn rung_keys(&self, c: &Config) -> Vec<(String, toml::Value)> {
        let (Some(unit), Some(&min)) = (self.unit, self.rungs().first()) else { return vec![] };
        let mut out = Vec::new();
        let min = toml::Value::Integer(min as i64);
        let checkpoints = c.checkpoint.every > 0 || c.checkpoint.every_steps.is_some();
        match unit {
            Unit::Steps => {
                if c.validate.every_steps.is_none() {
                    out.push(("validate.every_steps".to_owned(), min.clone()));
                }
                if !checkpoints {
                    out.push(("checkpoint.every_steps".to_owned(), min));
                }
            }
            Unit::Epochs if !checkpoints => out.push(("checkpoint.every".to_owned(), min)),
            Unit::Epochs => {}
        }
        out
    }

    /// Whether a trial's learning-rate schedule depends on its run's length, so that the scheduler pins
    /// it to the full budget's (`train.schedule.decay_end`).
    fn pins_schedule(c: &Config) -> bool {
        let s = &c.train.schedule;
        s.decay_end.is_none()
            && (matches!(s.kind, ScheduleKind::Linear | ScheduleKind::Cosine) || s.warmup_steps + s.warmup_epochs > 0)
    }
}

/// The search of `experiment` at its grid's `points`: the rungs from its budget and the
/// pipeline's length, each point's configuration checked against what a search needs of it, and
/// every value the search can give planned at every point ([`bounds::plan_every_value`]).
pub fn prepare(experiment: &Experiment, spec: &Spec, points: &[Point]) -> Result<Search, ConfigError> {
    let search = scheduled(experiment, spec, points)?;
    bounds::plan_every_value(experiment, &search, points)?;
    Ok(search)
}

/// The search with its scheduler's rungs, each point's configuration checked against them.
fn scheduled(experiment: &Experiment, spec: &Spec, points: &[Point]) -> Result<Search, ConfigError> {
    let fail = |m: String| Err(ConfigError::new(format!("{}: [search] {m}", experiment.file.display())));
    let Some(budget) = spec.budget else {
        if spec.metric.starts_with("val_") && points.iter().any(|p| p.plan.config.validate.every == 0) {
            return fail(format!("metric = \"{}\" is measured by validation, but validate.every is 0", spec.metric));
        }
        return Ok(Search { spec: spec.clone(), scheduler: Scheduler::Full, unit: None });
    };
    let (unit, name) = (budget.unit, budget.scheduler());
    let length = |p: &Point| match unit {
        Unit::Steps => p.plan.config.train.steps.map(|s| s as u64),
        Unit::Epochs => p.plan.config.train.steps.is_none().then_some(p.plan.config.train.epochs as u64),
    };
    let max = match budget.max {
        Some(max) => max,
        None => match length(&points[0]) {
            Some(max) if points.iter().all(|p| length(p) == Some(max)) => max,
            Some(_) => return fail(format!("the grid's points run for different lengths: give max_{}", unit.name())),
            None => {
                return fail(format!(
                    "max_{0}: the pipeline does not give its length as {1}: give max_{0}",
                    unit.name(),
                    unit.key()
                ))
            }
        },
    };
    if max <= budget.min {
        return fail(format!(
            "min_{0} = {1} must be below the full budget ({max}, {2} of the pipeline)",
            unit.name(),
            budget.min,
            unit.key()
        ));
    }
    for p in points {
        let c = &p.plan.config;
        let from = |key: &str| p.plan.sources.get(key).map_or("default".to_owned(), |s| s.clone());
        let why = if c.train.early_stop.is_some() {
            Some(format!(
                "train.early_stop ({}) stops trials by its own rule; {name} decides when they stop: remove one",
                from("train.early_stop")
            ))
        } else if unit == Unit::Steps && c.train.steps.is_none() && from("train.epochs") != "default" {
            Some(format!(
                "{name}'s budget counts steps (min_steps), but the pipeline gives its length as train.epochs = {} ({}): \
                 give it as train.steps, or give the budget in epochs (min_epochs)",
                c.train.epochs,
                from("train.epochs")
            ))
        } else if unit == Unit::Epochs && c.train.steps.is_some() {
            Some(format!(
                "{name}'s budget counts epochs (min_epochs), but the pipeline counts train.steps ({}): give the budget \
                 in steps (min_steps)",
                from("train.steps")
            ))
        } else {
            cadence(c, unit, budget.min, &spec.metric, &from)
        };
        if let Some(why) = why {
            let at = if points.len() > 1 { format!("point {}: ", p.dir) } else { String::new() };
            return fail(format!("{at}{why}"));
        }
    }
    let rungs = crate::search::halving::rungs(budget.min, max, budget.eta);
    let rule = Rule { eta: budget.eta as usize, synchronous: budget.synchronous };
    Ok(Search { spec: spec.clone(), scheduler: Scheduler::Halving { rungs, rule }, unit: Some(unit) })
}

/// Why the trace rows (with the metric) would not fall on every rung: they must, for a trial's
/// rung to be read from its trace and for a promoted trial to write the rows of an
/// uninterrupted run.
fn cadence(c: &Config, unit: Unit, min: u64, metric: &str, from: &dyn Fn(&str) -> String) -> Option<String> {
    let validates = c.validate.every > 0;
    if metric.starts_with("val_") && !validates {
        return Some(format!(
            "metric = \"{metric}\" is measured by validation, but validate.every is 0 ({})",
            from("validate.every")
        ));
    }
    match unit {
        Unit::Steps => c.validate.every_steps.filter(|n| !min.is_multiple_of(*n as u64)).map(|n| {
            format!(
                "validate.every_steps = {n} ({}) does not divide min_steps = {min}: every rung must end on a trace row; \
                 leave it out (the search then writes one at every {min} steps) or make it divide {min}",
                from("validate.every_steps")
            )
        }),
        Unit::Epochs => (validates && !min.is_multiple_of(c.validate.every as u64)).then(|| {
            format!(
                "validate.every = {} ({}) does not divide min_epochs = {min}: every rung must end with a validation",
                c.validate.every,
                from("validate.every")
            )
        }),
    }
}

/// The directory of trial `t` of the point `point` (`trial-007`; `POINT/trial-007` with a grid).
pub fn trial_dir(point: &Point, grid: bool, trials: usize, t: usize) -> String {
    let width = (trials.saturating_sub(1)).to_string().len().max(3);
    let name = format!("trial-{t:0width$}");
    if grid {
        format!("{}/{name}", point.dir)
    } else {
        name
    }
}

/// `to` relative to the directory `from` (both made absolute): how best.toml names the pipeline.
pub fn relative(from: &Path, to: &Path) -> PathBuf {
    let abs = |p: &Path| crate::config::extends::normalize(&std::path::absolute(p).unwrap_or_else(|_| p.to_owned()));
    crate::config::paths::relative(&abs(from), &abs(to))
}

/// `sweep.json` of a search: its trials as points (grid values, then searched values), with the
/// search's settings and each trial's overrides at full budget.
pub fn index(
    experiment: &Experiment,
    search: &Search,
    dir: &Path,
    points: &[Point],
    trials: &[(&Point, &trial::Trial)],
) -> Index {
    let mut overrides = Vec::new();
    let listed = trials
        .iter()
        .map(|(p, t)| {
            overrides.push(t.full.iter().map(|o| o.text.clone()).collect());
            let values = p.values.iter().chain(&t.values).map(|(k, v)| (k.clone(), v.to_string())).collect();
            IndexPoint { dir: t.dir.clone(), point: None, values }
        })
        .collect();
    let spec = &search.spec;
    Index {
        experiment: experiment.file.display().to_string(),
        axes: experiment.axes.iter().map(|a| a.key.clone()).collect(),
        points: listed,
        numerics: points.first().map(|p| crate::numerics::of_plan(p.plan.config.run.numerics, p.plan.threads_per_rank)),
        search: Some(SearchIndex {
            method: if spec.sampler.learns() { "tpe" } else { "random" }.into(),
            seed: spec.seed,
            trials: spec.trials,
            metric: spec.metric.clone(),
            minimize: spec.minimize,
            reduction_factor: search.scheduler.rule().eta,
            synchronous: search.scheduler.rule().synchronous,
            unit: search.unit.map(|u| u.name().to_owned()),
            rungs: search.rungs().to_vec(),
            space: spec.space.0.iter().map(|p| (p.key.clone(), p.dist.describe())).collect(),
            pipeline: relative(dir, &experiment.pipeline).display().to_string(),
            overrides,
        }),
    }
}

/// `runner sweep` of a search: runs it at every grid point into `dir` (which the caller holds
/// locked), then writes its report. The exit code.
pub fn sweep(
    experiment: &Experiment,
    search: &Search,
    points: &[Point],
    dir: &Path,
    opts: &super::execute::Options,
    runs: &super::execute::Runs,
) -> anyhow::Result<u8> {
    let mut write_index = |studies: &[drive::Study], ran: bool| -> anyhow::Result<()> {
        let trials: Vec<(&Point, &trial::Trial)> =
            studies.iter().flat_map(|s| s.trials.iter().map(move |t| (s.at, t))).collect();
        index(experiment, search, dir, points, &trials).write(dir, ran)
    };
    let how = drive::Options { force: opts.force, fail_fast: opts.fail_fast };
    let finished = drive::run(experiment, search, points, dir, runs, how, &mut write_index)?;
    if let Some(sig) = finished.stopped {
        crate::say_err!(
            "\ninterrupted: the running trials were stopped and marked interrupted; run the sweep again to resume \
             the search (finished rungs are not run again)"
        );
        return Ok(128 + sig as u8);
    }
    let table = crate::report::write(dir);
    match &table {
        Ok(table) => crate::say!("\n{table}"),
        Err(e) => crate::say_err!("error: {e:#}"),
    }
    for (trial, why) in &finished.failed {
        crate::say_err!("warning: {trial} failed: {why}");
    }
    if !finished.done {
        crate::say_err!("error: --fail-fast stopped the search after a failed trial; run the sweep again to resume it");
        return Ok(1);
    }
    Ok(if table.is_ok() { 0 } else { 1 })
}

/// The line `runner sweep` starts with: the search, its scheduler and its parallelism; and a
/// note where `direction` goes against the metric's own (accepted: the file may mean it).
pub fn describe(search: &Search) -> String {
    let s = &search.spec;
    let own = spec::direction_of(&s.metric).map(|d| d == spec::Direction::Minimize);
    let note = match own {
        Some(own) if own != s.minimize => format!(
            "\nnote: direction = \"{}\" on {}, which is {}d by default: the search keeps the trials with the {} {}",
            if s.minimize { "minimize" } else { "maximize" },
            s.metric,
            if own { "minimize" } else { "maximize" },
            if s.minimize { "lowest" } else { "highest" },
            s.metric
        ),
        _ => String::new(),
    };
    summary(search) + &note
}

fn summary(search: &Search) -> String {
    let s = &search.spec;
    let method = match s.sampler {
        crate::search::Sampler::Random => "random".to_owned(),
        crate::search::Sampler::Tpe(t) => format!("TPE (random for its first {}; lag {})", t.startup, s.lag),
    };
    let scheduler = match (&search.scheduler, search.unit) {
        (Scheduler::Halving { rungs, rule }, Some(unit)) => format!(
            "{} at {} {} (reduction factor {})",
            if rule.synchronous { "successive halving" } else { "ASHA" },
            rungs.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
            unit.name(),
            rule.eta
        ),
        _ => "each to its full length".to_owned(),
    };
    format!(
        "a {method} search of {} trials, {scheduler}, {} at a time, optimising {} ({})",
        s.trials,
        s.parallel,
        s.metric,
        if s.minimize { "lower is better" } else { "higher is better" }
    )
}
