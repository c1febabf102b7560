//! The grid: the product of the axes, each point's directory name, and `sweep.json`, the index
//! of a sweep directory that `runner report` reads.
use std::path::Path;

use crate::config::Override;
use crate::plan::Plan;
use crate::rundir::index::{Index, IndexPoint};

/// One axis of the grid, in the order of the file.
#[derive(Debug, Clone)]
pub struct Axis {
    pub key: String,
    pub values: Vec<toml::Value>,
}

/// One point of the grid: its axis values, validated plan and run directory (under the sweep's).
#[derive(Debug, Clone)]
pub struct Point {
    pub dir: String,
    /// The named point's name (`[[points]]`); none for a point of the grid alone.
    pub name: Option<String>,
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

/// The sweep directory's index (`sweep.json`) of `points` over `axes`.
pub fn index(experiment: &Path, axes: &[Axis], points: &[Point]) -> Index {
    Index {
        experiment: experiment.display().to_string(),
        axes: axes.iter().map(|a| a.key.clone()).collect(),
        points: points
            .iter()
            .map(|p| IndexPoint {
                dir: p.dir.clone(),
                point: p.name.clone(),
                values: p.values.iter().map(|(k, v)| (k.clone(), v.to_string())).collect(),
            })
            .collect(),
        // What the points compute under (each `runner run` sets it from its plan).
        numerics: points.first().map(|p| crate::numerics::of_plan(p.plan.config.run.numerics, p.plan.threads_per_rank)),
        search: None,
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
