//! The `[search]` table of an experiment file: its keys as written ([`SearchTable`], read with the
//! file so that an unknown key is named with its line) and as checked on their own ([`Spec`]).
//! What depends on the pipeline (the budget's unit against its length, validation and
//! checkpoints at every rung) is checked with each grid point's plan ([`super::prepare`]).
//!
//! ```toml
//! [search]
//! method = "tpe"              # or "random"
//! trials = 27
//! metric = "val_loss"         # a trace column
//! direction = "minimize"      # default: the metric's own (losses minimise, accuracies maximise)
//! seed = 0
//! parallel = 3                # trials at a time
//! scheduler = "asha"          # or "sha"; default "none": every trial to the pipeline's length
//! min_steps = 30              # or min_epochs
//! max_steps = 270             # default: the pipeline's train.steps
//! reduction_factor = 3
//!
//! [search.space]
//! "train.lr" = { log_uniform = [1e-4, 0.1] }
//! "wrap.model.hidden" = { choice = [[32], [64, 64]] }
//! ```
use serde::Deserialize;

use super::budget::{self, Budget, SchedulerKind};
use crate::search::space::{Distribution, Param, Space};
use crate::search::{tpe, Sampler, Tpe};

/// `[search]` as the file gives it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchTable {
    #[serde(default)]
    pub method: Method,
    pub trials: usize,
    pub metric: String,
    pub direction: Option<Direction>,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "one")]
    pub parallel: usize,
    #[serde(default)]
    pub lag: usize,
    pub startup_trials: Option<usize>,
    #[serde(default)]
    pub scheduler: SchedulerKind,
    pub min_steps: Option<u64>,
    pub max_steps: Option<u64>,
    pub min_epochs: Option<u64>,
    pub max_epochs: Option<u64>,
    pub reduction_factor: Option<u64>,
    #[serde(default)]
    pub space: toml::Table,
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    #[default]
    Tpe,
    Random,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Minimize,
    Maximize,
}

/// The `[search]` table checked on its own.
#[derive(Debug, Clone)]
pub struct Spec {
    pub space: Space,
    pub sampler: Sampler,
    /// Successive halving's budget; `None`: every trial runs the pipeline's length.
    pub budget: Option<Budget>,
    pub trials: usize,
    pub metric: String,
    pub minimize: bool,
    pub seed: u64,
    pub parallel: usize,
    pub lag: usize,
}

/// Trace columns that identify a row rather than measure the training.
const NOT_METRICS: &[&str] = &["run_id", "epoch", "step", "rank", "world_size", "samples", "steps"];

/// The trace columns a search may optimise: what the training computes, not what a clock measures.
pub fn metrics() -> Vec<&'static str> {
    crate::trace::EPOCH_COLUMNS
        .iter()
        .copied()
        .filter(|c| !NOT_METRICS.contains(c) && !crate::trace::TIMING_COLUMNS.contains(c))
        .collect()
}

/// The most trials a search runs at each point: each is a run directory, and TPE's proposals
/// cost more with every trial before.
pub const MAX_TRIALS: usize = 10_000;

/// The direction a metric is optimised in when the file does not say: losses and errors down,
/// accuracies and scores up.
pub fn direction_of(metric: &str) -> Option<Direction> {
    let down = ["loss", "perplexity", "rmse", "mae", "grad_norm", "bytes"];
    let up = ["acc", "f1", "r2"];
    if down.iter().any(|d| metric.contains(d)) {
        Some(Direction::Minimize)
    } else if up.iter().any(|u| metric.contains(u)) {
        Some(Direction::Maximize)
    } else {
        None
    }
}

impl Spec {
    /// Checks the table; each problem is `(key under [search], message)`, every one reported.
    /// `taken` are the keys [set] and [sweep] give.
    pub fn check(raw: &SearchTable, taken: &[String]) -> Result<Spec, Vec<(String, String)>> {
        let mut errors: Vec<(String, String)> = Vec::new();
        let mut bad = |key: &str, message: String| errors.push((key.to_owned(), message));
        if raw.trials == 0 {
            bad("trials", "trials = 0: give the number of trials to run, at least 1".into());
        }
        if raw.trials > MAX_TRIALS {
            bad(
                "trials",
                format!(
                    "trials = {}: at most {MAX_TRIALS} at each point (each is a run directory of its own): give \
                     fewer, or run several searches with other seeds",
                    raw.trials
                ),
            );
        }
        if raw.parallel == 0 {
            bad("parallel", "parallel = 0: give how many trials run at a time, at least 1".into());
        }
        let direction = direction(raw, &mut bad);
        let space = space(&raw.space, taken, &mut bad);
        if raw.method == Method::Random {
            if let Some(n) = space.size().filter(|n| *n < raw.trials as u128) {
                bad(
                    "trials",
                    format!(
                        "trials = {}, but the space holds {n} points (integers and choices only) and random search \
                         draws each at most once: give trials ≤ {n}, or run every point as a grid with [sweep]",
                        raw.trials
                    ),
                );
            }
            for (key, set) in [("startup_trials", raw.startup_trials.is_some()), ("lag", raw.lag > 0)] {
                if set {
                    bad(key, format!("{key} is for method = \"tpe\" (random search learns from no result)"));
                }
            }
        }
        let budget = budget::budget(raw, &mut bad);
        if !errors.is_empty() {
            return Err(errors);
        }
        let sampler = match raw.method {
            Method::Random => Sampler::Random,
            Method::Tpe => Sampler::Tpe(Tpe { startup: raw.startup_trials.unwrap_or(tpe::STARTUP) }),
        };
        Ok(Spec {
            space,
            sampler,
            budget,
            trials: raw.trials,
            metric: raw.metric.clone(),
            minimize: direction == Some(Direction::Minimize),
            seed: raw.seed,
            parallel: raw.parallel,
            lag: raw.lag,
        })
    }
}

/// The metric's direction: `direction`, or the one the metric's name implies; `None` (an error
/// reported) for a metric that is not a trace column, that measures nothing that reproduces, or
/// whose direction cannot be told.
fn direction(raw: &SearchTable, bad: &mut impl FnMut(&str, String)) -> Option<Direction> {
    let metrics = metrics();
    if !crate::trace::EPOCH_COLUMNS.contains(&raw.metric.as_str()) {
        let hint = crate::config::resolve::closest(&raw.metric, &metrics)
            .map(|m| format!("did you mean `{m}`? "))
            .unwrap_or_default();
        bad(
            "metric",
            format!(
                "metric = \"{}\" is not a column of the trace: {hint}(the metrics: {})",
                raw.metric,
                metrics.join(", ")
            ),
        );
        None
    } else if !metrics.contains(&raw.metric.as_str()) {
        let why = if NOT_METRICS.contains(&raw.metric.as_str()) {
            "identifies a trace row, it measures nothing"
        } else {
            "is measured time or memory: it differs from run to run, so the search would not reproduce"
        };
        bad(
            "metric",
            format!("metric = \"{}\" {why}; search on a value the training computes, e.g. val_loss", raw.metric),
        );
        None
    } else {
        match raw.direction.or_else(|| direction_of(&raw.metric)) {
            Some(d) => Some(d),
            None => {
                bad(
                    "metric",
                    format!(
                        "metric = \"{}\": say whether to minimize or maximize it (direction = \"minimize\")",
                        raw.metric
                    ),
                );
                None
            }
        }
    }
}

/// `[search.space]`: each key's distribution, in the file's order. A key may be quoted
/// (`"train.lr" = {...}`) or nested (`[search.space.train] lr = {...}`).
fn space(table: &toml::Table, taken: &[String], bad: &mut impl FnMut(&str, String)) -> Space {
    let mut params = Vec::new();
    let mut leaves = Vec::new();
    distributions("", table, &mut leaves);
    if leaves.is_empty() {
        bad("space", "[search.space] names no key to search: give each key a distribution, e.g. \"train.lr\" = { log_uniform = [0.0001, 0.1] }".into());
    }
    for (key, value) in leaves {
        let at = format!("space.{key}");
        if taken.contains(&key) {
            bad(&at, format!("`{key}` is searched in [search.space] and also set by [set] or [sweep]; keep one"));
            continue;
        }
        match Distribution::parse(&value) {
            Ok(dist) => params.push(Param { key, dist }),
            Err(e) => bad(&at, format!("[search.space] `{key}`: {e}")),
        }
    }
    Space(params)
}

/// The leaves of `[search.space]`: tables are followed until a distribution (or anything else).
fn distributions(prefix: &str, table: &toml::Table, out: &mut Vec<(String, toml::Value)>) {
    for (k, v) in table {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(t) if !Distribution::is_written(v) => distributions(&key, t, out),
            _ => out.push((key, v.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::budget::Unit;

    fn check(text: &str) -> Result<Spec, Vec<(String, String)>> {
        let raw: SearchTable = toml::from_str(text).unwrap();
        Spec::check(&raw, &["train.epochs".to_owned()])
    }

    const SPACE: &str = "[space]\n\"train.lr\" = { log_uniform = [0.0001, 0.1] }\n";

    #[test]
    fn a_search_reads_with_its_defaults() {
        let s = check(&format!("trials = 8\nmetric = \"val_acc\"\n{SPACE}")).unwrap();
        assert_eq!(s.sampler, Sampler::Tpe(Tpe { startup: 10 }));
        assert!(!s.minimize, "accuracies are maximised");
        assert_eq!((s.seed, s.parallel, s.lag, s.budget), (0, 1, 0, None));
        let s = check(
            "trials = 8\nmetric = \"val_loss\"\nscheduler = \"asha\"\nmin_steps = 10\n[space.train]\nlr = { uniform = [0.01, 0.1] }\n",
        )
        .unwrap();
        assert_eq!(s.budget, Some(Budget { unit: Unit::Steps, min: 10, max: None, eta: 3, synchronous: false }));
        assert_eq!(s.space.0[0].key, "train.lr");
    }

    #[test]
    fn the_keys_are_checked_together() {
        let e = check(&format!(
            "trials = 8\nmetric = \"samples_per_s\"\nscheduler = \"asha\"\nreduction_factor = 1\nmin_steps = 4\n{SPACE}\"train.epochs\" = {{ int = [1, 3] }}\n"
        ))
        .unwrap_err();
        let keys: Vec<&str> = e.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["metric", "space.train.epochs", "reduction_factor"]);
        assert!(e[0].1.contains("is measured time or memory"), "{}", e[0].1);
        let e = check(&format!("trials = 8\nmetric = \"lr\"\nmin_steps = 3\n{SPACE}")).unwrap_err();
        assert_eq!(e[0].1, "metric = \"lr\": say whether to minimize or maximize it (direction = \"minimize\")");
        assert_eq!(
            e[1].1,
            "min_steps is for scheduler = \"asha\" or \"sha\" (without one every trial runs the pipeline's length)"
        );
        let e = check(&format!("trials = 8\nmetric = \"val_loss\"\nscheduler = \"sha\"\n{SPACE}")).unwrap_err();
        assert!(e[0].1.starts_with("scheduler = \"sha\" needs a budget: min_steps"), "{}", e[0].1);
        let s =
            check(&format!("trials = 8\nmetric = \"val_loss\"\nscheduler = \"sha\"\nmin_epochs = 1\n{SPACE}")).unwrap();
        assert_eq!(s.budget, Some(Budget { unit: Unit::Epochs, min: 1, max: None, eta: 3, synchronous: true }));
    }
}
