//! `sweep.json`: a sweep directory's index, written by `runner sweep` and read by `runner report`
//! and `--check`.
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// `sweep.json`: the experiment, its axes and its points, so that the sweep directory can be
/// reported on (and checked) on its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// The experiment file, as the sweep was given it.
    pub experiment: String,
    pub axes: Vec<String>,
    pub points: Vec<IndexPoint>,
    /// The CPU and numerical settings (`MKL_CBWR`) the sweep ran under: `--check` reruns under
    /// the same settings and names both CPUs when values differ. Older sweeps lack it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numerics: Option<crate::numerics::Numerics>,
    /// A search's settings and its trials' configurations (`points` are then its trials, each
    /// with its grid values and searched values). Grids lack it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub search: Option<SearchIndex>,
}

/// What `runner report` needs to decide a search's promotions again from its trials' traces, and
/// to write its best trial as a pipeline file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchIndex {
    /// "random" or "tpe".
    pub method: String,
    pub seed: u64,
    /// The trials planned at each point of the grid.
    pub trials: usize,
    /// The trace column compared, and whether lower is better.
    pub metric: String,
    pub minimize: bool,
    /// Successive halving's reduction factor; 1 without it.
    pub reduction_factor: usize,
    /// Whether a rung promotes only once it is whole (`scheduler = "sha"`) rather than as ASHA
    /// does (absent in sweeps written before "sha" existed: ASHA).
    #[serde(default)]
    pub synchronous: bool,
    /// What `rungs` count, "steps" or "epochs"; absent without ASHA (each trial runs its
    /// pipeline's length, compared at its end).
    pub unit: Option<String>,
    pub rungs: Vec<u64>,
    /// The searched keys with their distributions, as the experiment file writes them.
    pub space: Vec<(String, String)>,
    /// The pipeline file, relative to the sweep directory.
    pub pipeline: String,
    /// Each trial's overrides at its full budget (`key=value`), in the order of `points`.
    pub overrides: Vec<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexPoint {
    pub dir: String,
    /// The named point's name (`[[points]]`); grids without them lack it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point: Option<String>,
    /// Each axis key with its value as TOML text, in the order of `axes`.
    pub values: Vec<(String, String)>,
}

pub const INDEX: &str = "sweep.json";

impl Index {
    /// Writes `sweep.json` in `dir`. `ran`: whether a run of the sweep ran on this machine now.
    /// Until one has, a stored index keeps its `numerics`: they name the machine its stored runs
    /// ran on, and a sweep that runs nothing must leave a committed result byte for byte as it
    /// was (a file that would not change is not written again).
    pub fn write(mut self, dir: &Path, ran: bool) -> anyhow::Result<()> {
        let path = dir.join(INDEX);
        if !ran {
            if let Ok(stored) = Index::read(dir) {
                self.numerics = stored.numerics;
            }
        }
        let json = serde_json::to_string_pretty(&self)? + "\n";
        if std::fs::read(&path).is_ok_and(|old| old == json.as_bytes()) {
            return Ok(());
        }
        crate::rundir::atomic_write(&path, json.as_bytes())
    }

    /// A missing or unreadable index is the user's mistake (the wrong directory): exit code 2.
    pub fn read(dir: &Path) -> Result<Index, ConfigError> {
        let path = dir.join(INDEX);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            ConfigError::new(format!(
                "cannot read {}: {e}; is {} a sweep directory (written by `runner sweep`)?",
                path.display(),
                dir.display()
            ))
        })?;
        serde_json::from_str(&text)
            .map_err(|e| ConfigError::new(format!("{} is not a sweep index: {e}", path.display())))
    }
}
