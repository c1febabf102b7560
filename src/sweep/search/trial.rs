//! One trial: its values, the configuration of its run to each rung ([set], the grid point's
//! values, the searched values, the scheduler's keys, then the rung's budget), and what its run directory
//! holds. A trial's identity is the run id of its run to the first rung: a promotion resumes that
//! run (`runner run --resume` with the next rung's `train.steps`), which keeps its id.
//!
//! Under ASHA a trial's learning-rate schedule is its full budget's: where the schedule's shape
//! depends on the run's length (a linear or cosine decay, a warmup), `train.schedule.decay_end`
//! is set to the full budget's last step, so that each rung runs the first steps of one curve
//! and a promoted trial continues on it (without it, a cosine over 30 steps is another curve than
//! the first 30 steps of one over 90).
use std::path::Path;

use super::{Search, SEARCH_LABEL};
use crate::config::Override;
use crate::plan::Plan;
use crate::report::search::{trace_of, TrialTrace};
use crate::rundir::manifest::{Manifest, Status};
use crate::search::budget::Unit;
use crate::sweep::experiment::Experiment;
use crate::sweep::experiment::{labelled, AXIS_LABEL};
use crate::sweep::grid::Point;

#[derive(Debug, Clone)]
pub struct Trial {
    /// Its number among its point's trials, and its directory (relative to the sweep's).
    pub index: usize,
    pub dir: String,
    /// The sampler's floats, and the searched keys' values they stand for.
    pub point: Vec<f64>,
    pub values: Vec<(String, toml::Value)>,
    /// What its runs are given before the budget (the point's axis values, its values, the scheduler's keys).
    given: Vec<Override>,
    /// The grid point's values.
    axes: Vec<(String, toml::Value)>,
    /// The run to the first rung, or why the trial's configuration is invalid.
    pub first: Result<Plan, String>,
    /// Every override of its run at the full budget (what best.toml sets).
    pub full: Vec<Override>,
}

impl Trial {
    pub fn new(
        experiment: &Experiment,
        search: &Search,
        at: &Point,
        index: usize,
        dir: String,
        point: Vec<f64>,
    ) -> Trial {
        let values = search.spec.space.values(&point);
        let mut given: Vec<Override> = at.values.iter().map(|(k, v)| labelled(AXIS_LABEL, k, v)).collect();
        given.extend(values.iter().map(|(k, v)| labelled(SEARCH_LABEL, k, v)));
        given.extend(search.rung_keys(&at.plan.config).iter().map(|(k, v)| labelled(search.rung_label(), k, v)));
        let mut trial = Trial {
            index,
            dir,
            point,
            values,
            given,
            axes: at.values.clone(),
            first: Err(String::new()),
            full: Vec::new(),
        };
        if let (Some(unit), Some(max)) = (search.unit, search.rungs().last()) {
            // The schedule pinned to the full budget, in steps (an epoch's steps are the trial's).
            if let Ok(first) = trial.plan(experiment, search, 0) {
                if Search::pins_schedule(&first.config) {
                    let total = match unit {
                        Unit::Steps => *max,
                        Unit::Epochs => max * first.optimizer_steps_per_epoch() as u64,
                    };
                    let end = toml::Value::Integer(total as i64 - 1);
                    trial.given.push(labelled(search.rung_label(), "train.schedule.decay_end", &end));
                }
            }
        }
        trial.first = trial.plan(experiment, search, 0);
        let top = search.rungs().len().saturating_sub(1);
        trial.full = trial.run_to(experiment, search, top).map(|p| p.overrides).unwrap_or_default();
        trial
    }

    /// The run id naming this trial's run directory (`None`: its configuration is invalid).
    pub fn run_id(&self) -> Option<&str> {
        self.first.as_ref().ok().map(|p| p.run_id.as_str())
    }

    fn budget(&self, search: &Search, rung: usize) -> Option<Override> {
        let unit = search.unit?;
        Some(labelled(search.rung_label(), unit.key(), &toml::Value::Integer(search.rungs()[rung] as i64)))
    }

    fn plan(&self, experiment: &Experiment, search: &Search, rung: usize) -> Result<Plan, String> {
        self.run_to(experiment, search, rung).map(|p| p.plan)
    }

    /// The run to rung `rung`: its plan and overrides, as a sweep's point.
    pub fn run_to(&self, experiment: &Experiment, search: &Search, rung: usize) -> Result<Point, String> {
        let mut given = self.given.clone();
        given.extend(self.budget(search, rung));
        let (plan, overrides) = experiment.plan_of(given)?;
        let values = self.axes.iter().chain(&self.values).cloned().collect();
        Ok(Point { dir: self.dir.clone(), name: None, values, plan, overrides })
    }

    /// What its run directory says, where the run there is this trial's (its run id).
    pub fn results(&self, run_dir: &Path, search: &Search) -> TrialTrace {
        let ours = Manifest::read(run_dir).is_ok_and(|m| Some(m.run_id.as_str()) == self.run_id());
        if !ours {
            return TrialTrace {
                outcomes: vec![None; search.scheduler.rungs()],
                steps: vec![None; search.scheduler.rungs()],
                failure: None,
            };
        }
        trace_of(run_dir, search.at(), &search.spec.metric, false)
    }

    /// Whether the run to `job` continues the run in `run_dir`: this trial's, stopped (complete at
    /// an earlier rung, interrupted, crashed, preempted or failed) with a checkpoint before the
    /// job's budget. Otherwise the job starts the trial over.
    pub fn continues(&self, run_dir: &Path, job: &Point) -> bool {
        let ours = Manifest::read(run_dir)
            .is_ok_and(|m| Some(m.run_id.as_str()) == self.run_id() && m.status != Status::Running);
        ours && crate::checkpoint::newest_unread(run_dir, &job.plan)
            .is_ok_and(|found| found.is_some_and(|f| f.record().step < job.plan.total_steps()))
    }
}
