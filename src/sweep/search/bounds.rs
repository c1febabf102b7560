//! The values a search's space can give, checked before any trial runs: every choice and both
//! ends of every range. [`crate::sweep::experiment::check_values`] resolves each against the pipeline when the experiment
//! is read (its key exists and takes that type); [`plan_every_value`] plans each at every grid
//! point, with the scheduler's keys and its first rung, so that a value the plan refuses
//! (`run.world_size = 0`) stops the sweep before its first trial rather than failing a trial.
use super::Search;
use crate::config::ConfigError;
use crate::sweep::experiment::Experiment;
use crate::sweep::experiment::{bounds, labelled, AXIS_LABEL, SEARCH_LABEL};
use crate::sweep::grid::Point;

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
