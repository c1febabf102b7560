//! A search's table: `table.md` for people (a section per grid point), and one polars frame for
//! `summary.parquet` and `table.csv` (every value a number where it is one, every rung's metric
//! its own column). Nothing measured by a clock is in them: a rerun of the search writes them
//! again byte for byte.
use polars::prelude::*;

use super::search::{groups, reached, short, status_text, Trial};
use crate::rundir::index::{Index, SearchIndex};
use crate::search::halving::{Outcome, Status};

/// The page: what was searched and how, then a table per grid point.
pub fn markdown(index: &Index, search: &SearchIndex, trials: &[Trial]) -> String {
    let method = if search.method == "tpe" { "TPE" } else { "Random" };
    let unit = search.unit.as_deref().unwrap_or("steps");
    let rungs = search.rungs.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
    let eta = search.reduction_factor;
    let how = match search.unit {
        Some(_) if search.synchronous => format!(
            "successive halving with rungs at {rungs} {unit} (reduction factor {eta}): each rung, once every trial \
             has reached it, promotes its best 1/{eta}"
        ),
        Some(_) => format!(
            "ASHA with rungs at {rungs} {unit} (reduction factor {eta}): each rung promotes its best 1/{eta} in the \
             order trials entered it"
        ),
        None => "every trial run to the pipeline's length".to_owned(),
    };
    let better = if search.minimize { "lower" } else { "higher" };
    let mut out = format!(
        "# Search {}\n\n{method} search (seed {}) of {} trials per point over {}; {how}. Metric: `{}` ({better} is \
         better), rank 0's trace row at each rung. Budget: the {unit} a trial reached; {} is its value there.\n",
        index.experiment,
        search.seed,
        search.trials,
        search.space.iter().map(|(k, d)| format!("`{k}` ({d})")).collect::<Vec<_>>().join(", "),
        search.metric,
        search.metric,
    );
    let all = groups(trials);
    for group in &all {
        let mine: Vec<&Trial> = trials.iter().filter(|t| t.group == *group).collect();
        if !group.is_empty() {
            out += &format!("\n## {group}\n");
        }
        out += &summary(search, &mine);
        out += &table(search, &mine);
    }
    out
}

/// The group's counts and compute: the steps its trials ran against every trial at full budget.
fn summary(search: &SearchIndex, trials: &[&Trial]) -> String {
    let count = |f: fn(&Status) -> bool| trials.iter().filter(|t| f(&t.status)).count();
    let complete = count(|s| *s == Status::Complete);
    let stopped = count(|s| matches!(s, Status::Stopped(_)));
    let failed = count(|s| matches!(s, Status::Failed(_)));
    let steps: u64 = trials.iter().filter_map(|t| t.trace.steps.iter().flatten().max()).sum();
    // Every trial at the full budget: each trial's steps per unit of budget, times the last rung.
    let full = search.unit.as_ref().and_then(|_| {
        let max = *search.rungs.last()?;
        trials.iter().try_fold(0u64, |sum, t| {
            let (k, s) = t.trace.steps.iter().enumerate().find_map(|(k, s)| s.map(|s| (k, s)))?;
            Some(sum + s * max / search.rungs[k])
        })
    });
    let against = full
        .map(|f| format!(" ({:.0}% of the {f} of every trial at the full budget)", 100.0 * steps as f64 / f as f64));
    let mut out = format!(
        "\n{} of {} trials run: {complete} complete, {stopped} stopped early, {failed} failed; {steps} optimizer steps in \
         all{}.\n",
        trials.iter().filter(|t| reached(&t.trace).is_some()).count(),
        search.trials,
        against.unwrap_or_default()
    );
    if let Some(best) = trials.iter().find(|t| t.best) {
        let (k, v) = reached(&best.trace).expect("the best has a result");
        let value = match v {
            Outcome::Value(v) => format!("{v:.4}"),
            Outcome::Failed => "failed".into(),
        };
        let step = best.trace.steps[k].unwrap_or_default();
        let at = match search.unit.as_deref() {
            Some("epochs") => format!("after {} epochs (step {step})", search.rungs[k]),
            _ => format!("at step {step}"),
        };
        out += &format!(
            "Best: `{}`, {} = {value} {at}; its configuration is `{}best.toml`.\n",
            best.dir,
            search.metric,
            if best.group.is_empty() { String::new() } else { format!("{}/", best.group) }
        );
        if search.rungs.len() > 1 {
            // A trial stopped early shows its value after fewer steps: it may look better.
            out += &format!(
                "The best is the {} {} among the trials at the highest rung reached ({} {}), not across the \
                 table: a trial stopped at a lower rung shows its value after a shorter run.\n",
                if search.minimize { "lowest" } else { "highest" },
                search.metric,
                search.rungs[k],
                search.unit.as_deref().unwrap_or("steps")
            );
        }
    }
    out
}

fn table(search: &SearchIndex, trials: &[&Trial]) -> String {
    let keys: Vec<&str> = search.space.iter().map(|(k, _)| k.as_str()).collect();
    let unit = search.unit.as_deref().unwrap_or("steps");
    let mut header = vec!["trial".to_owned()];
    header.extend(keys.iter().map(|k| format!("`{k}`")));
    header.extend([format!("budget ({unit})"), search.metric.clone(), "status".to_owned()]);
    let mut out = format!("\n| {} |\n", header.join(" | "));
    let align: Vec<&str> =
        (0..header.len()).map(|i| if i == 0 || i == header.len() - 1 { "---" } else { "---:" }).collect();
    out += &format!("| {} |\n", align.join(" | "));
    for t in trials {
        let name = t.dir.rsplit('/').next().unwrap_or(&t.dir);
        let mut cells = vec![if t.best { format!("**{name}**") } else { name.to_owned() }];
        cells.extend(
            keys.iter().map(|k| {
                t.values.iter().find(|(key, _)| key == k).map(|(_, v)| short(v)).unwrap_or_else(|| "—".into())
            }),
        );
        let (budget, value) = match reached(&t.trace) {
            Some((k, o)) => (budget_of(search, t, k), value_text(o)),
            None => ("—".into(), "—".into()),
        };
        // A reason may hold a `|`, which would end the cell.
        cells.extend([budget, value, status_text(t).replace('|', "\\|")]);
        out += &format!("| {} |\n", cells.join(" | "));
    }
    out
}

fn budget_of(search: &SearchIndex, t: &Trial, k: usize) -> String {
    match search.unit {
        Some(_) => search.rungs[k].to_string(),
        None => t.trace.steps[k].map_or("—".into(), |s| s.to_string()),
    }
}

fn value_text(o: Outcome) -> String {
    match o {
        Outcome::Value(v) => format!("{v:.4}"),
        Outcome::Failed => "—".into(),
    }
}

/// One row per trial: its grid point, directory, values, the budget reached, the metric at it
/// and at every rung, and its status.
pub fn frame(search: &SearchIndex, trials: &[Trial]) -> PolarsResult<DataFrame> {
    let n = trials.len();
    let mut cols: Vec<Column> = Vec::new();
    if trials.iter().any(|t| !t.group.is_empty()) {
        cols.push(Column::new("point".into(), trials.iter().map(|t| t.group.clone()).collect::<Vec<_>>()));
    }
    cols.push(Column::new("trial".into(), trials.iter().map(|t| t.dir.clone()).collect::<Vec<_>>()));
    for (key, _) in &search.space {
        let texts: Vec<Option<String>> =
            trials.iter().map(|t| t.values.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())).collect();
        let numbers: Vec<Option<f64>> = texts.iter().map(|v| v.as_ref().and_then(|v| v.parse().ok())).collect();
        // A number where every value is one; the TOML text otherwise (choices of lists, strings).
        if numbers.iter().zip(&texts).all(|(x, v)| x.is_some() == v.is_some()) {
            cols.push(Column::new(key.as_str().into(), numbers));
        } else {
            cols.push(Column::new(key.as_str().into(), texts));
        }
    }
    let budget: Vec<Option<u64>> = trials
        .iter()
        .map(|t| {
            reached(&t.trace).and_then(|(k, _)| match search.unit {
                Some(_) => Some(search.rungs[k]),
                None => t.trace.steps[k],
            })
        })
        .collect();
    cols.push(Column::new(format!("budget_{}", search.unit.as_deref().unwrap_or("steps")).into(), budget));
    let value = |o: Option<Outcome>| match o {
        Some(Outcome::Value(v)) => Some(v),
        _ => None,
    };
    cols.push(Column::new(
        search.metric.as_str().into(),
        trials.iter().map(|t| reached(&t.trace).and_then(|(_, o)| value(Some(o)))).collect::<Vec<_>>(),
    ));
    if search.unit.is_some() {
        for (k, r) in search.rungs.iter().enumerate() {
            let name = format!("{}_at_{r}", search.metric);
            cols.push(Column::new(name.into(), trials.iter().map(|t| value(t.trace.outcomes[k])).collect::<Vec<_>>()));
        }
    }
    cols.push(Column::new("status".into(), trials.iter().map(status_text).collect::<Vec<_>>()));
    cols.push(Column::new("best".into(), trials.iter().map(|t| t.best).collect::<Vec<_>>()));
    DataFrame::new(n, cols)
}
