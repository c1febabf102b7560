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
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexPoint {
    pub dir: String,
    /// Each axis key with its value as TOML text, in the order of `axes`.
    pub values: Vec<(String, String)>,
}

pub const INDEX: &str = "sweep.json";

impl Index {
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_string_pretty(self)? + "\n";
        crate::rundir::atomic_write(&dir.join(INDEX), json.as_bytes())
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
