//! Successive halving's keys in `[search]`: the scheduler, what its budgets count, the first
//! rung's and the full budget, the reduction factor; each checked on its own (against the
//! pipeline: [`super::prepare`]).
use serde::Deserialize;

use super::spec::SearchTable;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulerKind {
    #[default]
    None,
    /// Asynchronous successive halving: a rung promotes after each prefix of its entrants.
    Asha,
    /// Synchronous successive halving: a rung promotes once it is whole.
    Sha,
}

impl SchedulerKind {
    /// As the file writes it.
    pub fn key(self) -> &'static str {
        match self {
            SchedulerKind::None => "none",
            SchedulerKind::Asha => "asha",
            SchedulerKind::Sha => "sha",
        }
    }
}

/// What successive halving's budgets count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Steps,
    Epochs,
}

impl Unit {
    /// The pipeline key that sets a run's length in this unit.
    pub fn key(self) -> &'static str {
        match self {
            Unit::Steps => "train.steps",
            Unit::Epochs => "train.epochs",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Unit::Steps => "steps",
            Unit::Epochs => "epochs",
        }
    }

    /// `1 epoch`, `600 steps`.
    pub fn amount(self, n: u64) -> String {
        let name = self.name();
        if n == 1 {
            format!("1 {}", &name[..name.len() - 1])
        } else {
            format!("{n} {name}")
        }
    }
}

/// Successive halving's budget as the file gives it: the unit, the first rung, the full budget
/// (absent: the pipeline's), the reduction factor, and whether a rung waits until it is whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub unit: Unit,
    pub min: u64,
    pub max: Option<u64>,
    pub eta: u64,
    pub synchronous: bool,
}

impl Budget {
    /// The scheduler's name in messages.
    pub fn scheduler(&self) -> &'static str {
        if self.synchronous {
            "successive halving"
        } else {
            "ASHA"
        }
    }
}

/// Successive halving's keys, or their absence without it.
pub(super) fn budget(raw: &SearchTable, bad: &mut impl FnMut(&str, String)) -> Option<Budget> {
    let given = [
        ("min_steps", raw.min_steps),
        ("max_steps", raw.max_steps),
        ("min_epochs", raw.min_epochs),
        ("max_epochs", raw.max_epochs),
        ("reduction_factor", raw.reduction_factor),
    ];
    if raw.scheduler == SchedulerKind::None {
        for (key, v) in given {
            if v.is_some() {
                bad(
                    key,
                    format!(
                        "{key} is for scheduler = \"asha\" or \"sha\" (without one every trial runs the pipeline's length)"
                    ),
                );
            }
        }
        return None;
    }
    let eta = raw.reduction_factor.unwrap_or(3);
    if eta < 2 {
        bad(
            "reduction_factor",
            format!(
                "reduction_factor = {eta}: must be at least 2 (each rung promotes 1/reduction_factor of its trials)"
            ),
        );
    }
    let (unit, min, max) = match (raw.min_steps, raw.min_epochs) {
        (Some(_), Some(_)) => {
            bad("min_epochs", "give the budget in steps (min_steps) or in epochs (min_epochs), not both".into());
            return None;
        }
        (Some(min), None) => (Unit::Steps, min, raw.max_steps),
        (None, Some(min)) => (Unit::Epochs, min, raw.max_epochs),
        (None, None) => {
            bad(
                "scheduler",
                format!(
                    "scheduler = \"{}\" needs a budget: min_steps (optimizer steps) or min_epochs, the first rung's, \
                     and max_steps or max_epochs, the full one (default: the pipeline's train.steps or train.epochs)",
                    raw.scheduler.key()
                ),
            );
            return None;
        }
    };
    let other = match unit {
        Unit::Steps => ("max_epochs", raw.max_epochs),
        Unit::Epochs => ("max_steps", raw.max_steps),
    };
    if other.1.is_some() {
        bad(other.0, format!("{} counts another unit than min_{}: give both in {}", other.0, unit.name(), unit.name()));
    }
    let min_key = format!("min_{}", unit.name());
    if min == 0 {
        bad(&min_key, format!("{min_key} = 0: the first rung needs at least 1"));
    }
    if let Some(max) = max.filter(|max| *max <= min) {
        bad(
            &format!("max_{}", unit.name()),
            format!("max_{0} = {max} must be above min_{0} = {min}, or there is nothing to stop early", unit.name()),
        );
    }
    let synchronous = raw.scheduler == SchedulerKind::Sha;
    (eta >= 2 && min > 0).then_some(Budget { unit, min, max, eta, synchronous })
}
