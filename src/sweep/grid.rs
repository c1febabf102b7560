//! The grid: the product of the axes, each point's directory name, and `sweep.json`, the index
//! of a sweep directory that `runner report` reads.
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::experiment::Axis;
use crate::config::{ConfigError, Override};
use crate::plan::Plan;

/// One point of the grid: its axis values, validated plan and run directory (under the sweep's).
#[derive(Debug, Clone)]
pub struct Point {
    pub dir: String,
    pub values: Vec<(String, toml::Value)>,
    pub plan: Plan,
    /// What `runner run` is given to resolve the same plan: [set], axis values, scaling.
    pub overrides: Vec<Override>,
}

/// Every combination of the axes' values, the first axis outermost.
pub fn product(axes: &[Axis]) -> Vec<Vec<(String, toml::Value)>> {
    let mut out = vec![vec![]];
    for axis in axes {
        out = out
            .into_iter()
            .flat_map(|prefix: Vec<(String, toml::Value)>| {
                axis.values.iter().map(move |v| {
                    let mut p = prefix.clone();
                    p.push((axis.key.clone(), v.clone()));
                    p
                })
            })
            .collect();
    }
    out
}

/// Directory names like `world_size=2,seed=0`: each axis by its last key segment (the full key
/// when two axes share one), values made safe for a path. A grid of one point is `default`.
pub fn dir_names(axes: &[Axis], grid: &[Vec<(String, toml::Value)>]) -> Vec<String> {
    let short = |key: &str| -> String {
        let last = key.rsplit('.').next().unwrap_or(key);
        let shared = axes.iter().filter(|a| a.key.rsplit('.').next() == Some(last)).count() > 1;
        if shared { key } else { last }.to_owned()
    };
    grid.iter()
        .map(|values| {
            if values.is_empty() {
                return "default".to_owned();
            }
            values.iter().map(|(k, v)| format!("{}={}", short(k), path_safe(v))).collect::<Vec<_>>().join(",")
        })
        .collect()
}

fn path_safe(v: &toml::Value) -> String {
    let text = match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Array(items) => items.iter().map(path_safe).collect::<Vec<_>>().join("x"),
        other => other.to_string(),
    };
    text.chars().map(|c| if c.is_ascii_alphanumeric() || "._-+".contains(c) { c } else { '_' }).collect()
}

/// `sweep.json`: the experiment, its axes and its points, so that the sweep directory can be
/// reported on (and checked) on its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// The experiment file, as the sweep was given it.
    pub experiment: String,
    pub axes: Vec<String>,
    pub points: Vec<IndexPoint>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexPoint {
    pub dir: String,
    /// Each axis key with its value as TOML text, in the order of `axes`.
    pub values: Vec<(String, String)>,
}

pub const INDEX: &str = "sweep.json";

impl Index {
    pub fn new(experiment: &Path, axes: &[Axis], points: &[Point]) -> Index {
        Index {
            experiment: experiment.display().to_string(),
            axes: axes.iter().map(|a| a.key.clone()).collect(),
            points: points
                .iter()
                .map(|p| IndexPoint {
                    dir: p.dir.clone(),
                    values: p.values.iter().map(|(k, v)| (k.clone(), v.to_string())).collect(),
                })
                .collect(),
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    fn axis(key: &str, values: &[toml::Value]) -> Axis {
        Axis { key: key.into(), values: values.to_vec() }
    }

    #[test]
    fn the_product_keeps_the_first_axis_outermost() {
        let axes = [axis("run.world_size", &[1.into(), 2.into()]), axis("run.seed", &[0.into(), 1.into(), 2.into()])];
        let grid = product(&axes);
        assert_eq!(grid.len(), 6);
        let names = dir_names(&axes, &grid);
        assert_eq!(names[0], "world_size=1,seed=0");
        assert_eq!(names[2], "world_size=1,seed=2");
        assert_eq!(names[3], "world_size=2,seed=0");
    }

    #[test]
    fn names_stay_unique_and_path_safe() {
        let hidden = toml::Value::Array(vec![64.into(), 32.into()]);
        let axes = [
            axis("train.lr", &[0.05.into()]),
            axis("run.lr", &[1.into()]),
            axis("wrap.model.hidden", &[hidden]),
            axis("train.optimizer", &["adam".into()]),
        ];
        let names = dir_names(&axes, &product(&axes));
        assert_eq!(names, ["train.lr=0.05,run.lr=1,hidden=64x32,optimizer=adam"]);
        assert_eq!(dir_names(&[], &product(&[])), ["default"]);
    }
}
