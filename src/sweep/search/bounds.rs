//! The values a search's space can give, checked before any trial runs: every choice and both
//! ends of every range. [`check_values`] resolves each against the pipeline when the experiment
//! is read (its key exists and takes that type); [`plan_every_value`] plans each at every grid
//! point, with the scheduler's keys and its first rung, so that a value the plan refuses
//! (`run.world_size = 0`) stops the sweep before its first trial rather than failing a trial.
use std::path::Path;

use super::{Search, SEARCH_LABEL};
use crate::config::ConfigError;
use crate::search::{Distribution, Param};
use crate::sweep::experiment::{labelled, AXIS_LABEL};
use crate::sweep::grid::Point;
use crate::sweep::Experiment;

/// The values of `param` a check tries, each with what it is ("a choice", "its low end").
fn bounds(param: &Param) -> Vec<(toml::Value, &'static str)> {
    use Distribution::*;
    let ends = |low: toml::Value, high: toml::Value| vec![(low, "its low end"), (high, "its high end")];
    match &param.dist {
        Uniform { low, high } | LogUniform { low, high } => ends((*low).into(), (*high).into()),
        Int { low, high } | LogInt { low, high } => ends((*low).into(), (*high).into()),
        Choice(values) => values.iter().map(|v| (v.clone(), "one of its choices")).collect(),
    }
}

/// Whether every value `param` can take resolves against the pipeline (its key exists and takes
/// values of that type). The first problem, as the resolver says it.
pub fn check_values(pipeline: &Path, param: &Param) -> Result<(), String> {
    for (v, _) in bounds(param) {
        crate::config::resolve(pipeline, &[labelled(SEARCH_LABEL, &param.key, &v)]).map_err(|e| e.message)?;
    }
    Ok(())
}

/// Plans every value of every searched key at every point of the grid (the other keys as the
/// point gives them); every value that cannot run is reported, each with its whole reason.
pub fn plan_every_value(experiment: &Experiment, search: &Search, points: &[Point]) -> Result<(), ConfigError> {
    let mut problems = Vec::new();
    for p in points {
        let mut given: Vec<_> = p.values.iter().map(|(k, v)| labelled(AXIS_LABEL, k, v)).collect();
        given.extend(search.rung_keys(&p.plan.config).iter().map(|(k, v)| labelled(search.rung_label(), k, v)));
        if let (Some(unit), Some(first)) = (search.unit, search.rungs().first()) {
            given.push(labelled(search.rung_label(), unit.key(), &toml::Value::Integer(*first as i64)));
        }
        for param in &search.spec.space.0 {
            for (v, what) in bounds(param) {
                let mut trial = given.clone();
                trial.push(labelled(SEARCH_LABEL, &param.key, &v));
                if let Err(why) = experiment.plan_of(trial) {
                    let at = if points.len() > 1 { format!(" at point {}", p.dir) } else { String::new() };
                    problems.push(format!(
                        "`{}` = {v} ({what}){at} cannot run:\n    {}",
                        param.key,
                        why.replace('\n', "\n    ")
                    ));
                }
            }
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(ConfigError::new(format!(
        "{}: [search.space] gives {} {} that cannot run; nothing was run. Give each key only values its \
         pipeline accepts:\n  {}",
        experiment.file.display(),
        problems.len(),
        if problems.len() == 1 { "value" } else { "values" },
        problems.join("\n  ")
    )))
}
