//! Experiment files: which pipeline, fixed overrides (`[set]`), the grid (`[sweep]`), how the
//! batch and learning rate follow the world size (`[scaling]`) and a search run at every point
//! of the grid (`[search]`, [`super::search`]). [`Experiment::load`] checks the file and every
//! key; [`Experiment::points`] resolves and validates every point of the grid, reporting every
//! bad one before anything runs.
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::grid::{self, Axis, Point};
use crate::config::extends::{normalize, FileKind, Layers};
use crate::config::resolve::{flatten, parse_layers};
use crate::config::{self, ConfigError, Override};
use crate::plan::Plan;

pub use crate::config::resolve::{AXIS_LABEL, SCALING_LABEL, SET_LABEL};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExperimentFile {
    /// The pipeline file, relative to the experiment file that names it (required in the chain).
    pipeline: Option<PathBuf>,
    /// Fixed overrides, the same keys as `--set`.
    #[serde(default)]
    set: toml::Table,
    /// Axes: a dotted key and the list of its values.
    #[serde(default)]
    sweep: toml::Table,
    #[serde(default)]
    scaling: Scaling,
    /// The resources of each point's job under `runner sweep --launcher slurm`.
    #[serde(default)]
    slurm: super::slurm::Resources,
    /// A search at every point of the grid.
    search: Option<crate::search::spec::SearchTable>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scaling {
    pub batch: BatchScaling,
    pub lr: LrScaling,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchScaling {
    /// `train.batch_size` is each rank's batch: the global batch grows with the world size.
    #[default]
    PerRank,
    /// `train.batch_size` is the global batch, split evenly over the ranks.
    Global,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    #[default]
    None,
    /// `train.lr` is the rate for a global batch of `train.batch_size`; each point's rate is
    /// multiplied by its global batch ÷ `train.batch_size` (the linear scaling rule).
    Linear,
}

/// A checked experiment file.
#[derive(Debug, Clone)]
pub struct Experiment {
    pub file: PathBuf,
    pub pipeline: PathBuf,
    pub fixed: Vec<(String, toml::Value)>,
    pub axes: Vec<Axis>,
    pub scaling: Scaling,
    pub slurm: super::slurm::Resources,
    pub search: Option<crate::search::spec::Spec>,
}

impl Experiment {
    /// Reads and checks the file: its keys, the pipeline it names, and that every `[set]` key and
    /// every axis value resolves against that pipeline. Reports every problem found.
    pub fn load(file: &Path) -> Result<Experiment, ConfigError> {
        let layers = Layers::read(file, FileKind::Experiment, "the experiment file")?;
        let raw: ExperimentFile = parse_layers(&layers)?;
        // Problems are reported in the chain's and the files' order.
        let mut errors: Vec<((usize, usize), String)> = Vec::new();
        let mut bad = |section: &str, key: &str, message: String| {
            let dotted = if section.is_empty() { key.to_owned() } else { format!("{section}.{key}") };
            let at = match layers.origin(&dotted).or_else(|| layers.origin_of_quoted(section, key)) {
                Some((f, Some(line))) => format!("{}:{line}", f.display()),
                Some((f, None)) => f.display().to_string(),
                None => file.display().to_string(),
            };
            errors.push((layers.position(&dotted), format!("{at}: {message}")));
        };
        let Some(named) = &raw.pipeline else {
            return Err(ConfigError::new(format!(
                "{}: no `pipeline`: name the pipeline file the experiment runs, e.g. pipeline = \"../pipelines/ddp.toml\"",
                file.display()
            )));
        };
        let (named_in, _) = layers.origin("pipeline").expect("the chain sets `pipeline`");
        let base = named_in.parent().unwrap_or(Path::new(""));
        let pipeline = normalize(&base.join(named));
        if !pipeline.is_file() {
            bad(
                "",
                "pipeline",
                format!(
                    "`pipeline` names {}, which is not a file (the path is relative to the experiment file)",
                    pipeline.display()
                ),
            );
            return Err(ConfigError::new(errors.remove(0).1));
        }

        let fixed = leaves(&raw.set);
        for (key, value) in &fixed {
            if let Err(e) = resolve_one(&pipeline, SET_LABEL, key, value) {
                bad("set", key, e.message);
            }
        }
        let mut axes = Vec::new();
        for (key, value) in leaves(&raw.sweep) {
            if fixed.iter().any(|(k, _)| *k == key) {
                let message = format!("`{key}` is both fixed in [set] and swept in [sweep]; keep one");
                bad("sweep", &key, message);
                continue;
            }
            let values = match value {
                toml::Value::Array(values) if values.is_empty() => {
                    let message = format!("the axis `{key}` is empty; give it at least one value");
                    bad("sweep", &key, message);
                    continue;
                }
                toml::Value::Array(values) => values,
                other => {
                    let message = format!("the axis `{key}` must be a list of values, e.g. [{other}]");
                    bad("sweep", &key, message);
                    continue;
                }
            };
            // A bad key fails on the first value; report it once, not once per value.
            for value in &values {
                if let Err(e) = resolve_one(&pipeline, AXIS_LABEL, &key, value) {
                    bad("sweep", &key, e.message);
                    if value == &values[0] {
                        break;
                    }
                }
            }
            axes.push((layers.position(&format!("sweep.{key}")), Axis { key, values }));
        }
        let search = raw.search.as_ref().and_then(|table| {
            let taken: Vec<String> =
                fixed.iter().map(|(k, _)| k.clone()).chain(axes.iter().map(|(_, a)| a.key.clone())).collect();
            let spec = crate::search::spec::Spec::check(table, &taken);
            if let Ok(spec) = &spec {
                for p in &spec.space.0 {
                    if let Err(e) = check_values(&pipeline, p) {
                        bad("search.space", &p.key, e);
                    }
                }
            }
            spec.map_err(|problems| {
                for (key, message) in problems {
                    match key.strip_prefix("space.") {
                        Some(k) => bad("search.space", k, message),
                        None => bad("search", &key, message),
                    }
                }
            })
            .ok()
        });
        if !errors.is_empty() {
            errors.sort_by_key(|(at, _)| *at);
            let lines: Vec<String> = errors.into_iter().map(|(_, m)| m).collect();
            return Err(ConfigError::new(lines.join("\n")));
        }
        // The grid follows the file's order of axes, whatever order the TOML map keeps.
        axes.sort_by_key(|(at, _)| *at);
        Ok(Experiment {
            file: file.to_owned(),
            pipeline,
            fixed,
            axes: axes.into_iter().map(|(_, a)| a).collect(),
            scaling: raw.scaling,
            slurm: raw.slurm,
            search,
        })
    }

    /// The sweep's name: the experiment file's stem (`results/<name>/` by default).
    pub fn name(&self) -> String {
        self.file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "sweep".into())
    }

    /// Every point of the grid, resolved and validated; every bad point is reported.
    pub fn points(&self) -> Result<Vec<Point>, ConfigError> {
        let grid = grid::product(&self.axes);
        let dirs = grid::dir_names(&self.axes, &grid);
        for (i, dir) in dirs.iter().enumerate() {
            if dirs[..i].contains(dir) {
                return Err(ConfigError::new(format!(
                    "{}: two points would share the directory `{dir}`: an axis repeats a value, \
                     or two values differ only in characters a path cannot hold",
                    self.file.display()
                )));
            }
        }
        let mut points = Vec::with_capacity(grid.len());
        let mut errors = Vec::new();
        for (values, dir) in grid.into_iter().zip(dirs) {
            match self.plan(&values) {
                Ok((plan, overrides)) => points.push(Point { dir, values, plan, overrides }),
                Err(e) => errors.push(format!("point {dir}:\n    {}", e.replace('\n', "\n    "))),
            }
        }
        if errors.is_empty() {
            return Ok(points);
        }
        Err(ConfigError::new(format!(
            "{}: {} of {} points are invalid; nothing was run:\n  {}",
            self.file.display(),
            errors.len(),
            errors.len() + points.len(),
            errors.join("\n  ")
        )))
    }

    /// One point's plan and the overrides (in order) that produce it.
    fn plan(&self, values: &[(String, toml::Value)]) -> Result<(Plan, Vec<Override>), String> {
        self.plan_of(values.iter().map(|(k, v)| labelled(AXIS_LABEL, k, v)).collect())
    }

    /// The plan of [set], then `given` (a point's axis values, a search trial's values), then
    /// [scaling]; and the overrides (in order) that produce it.
    pub fn plan_of(&self, given: Vec<Override>) -> Result<(Plan, Vec<Override>), String> {
        let mut overrides: Vec<Override> =
            self.fixed.iter().map(|(k, v)| labelled(SET_LABEL, k, v)).chain(given).collect();
        let resolved = config::resolve(&self.pipeline, &overrides).map_err(|e| e.message)?;
        let scaled = scale(self.scaling, &resolved.config)?;
        let resolved = if scaled.is_empty() {
            resolved
        } else {
            overrides.extend(scaled);
            config::resolve(&self.pipeline, &overrides).map_err(|e| e.message)?
        };
        let plan = Plan::new(resolved).map_err(|e| e.message)?;
        Ok((plan, overrides))
    }
}

/// The overrides `[scaling]` adds to a point whose configuration (before scaling) is `c`.
fn scale(s: Scaling, c: &config::Config) -> Result<Vec<Override>, String> {
    let (world, batch) = (c.run.world_size, c.train.batch_size);
    if world == 0 || batch == 0 {
        return Ok(vec![]); // Plan::new names these.
    }
    let mut out = Vec::new();
    let per_rank = match s.batch {
        BatchScaling::PerRank => batch,
        BatchScaling::Global if batch % world != 0 => {
            return Err(format!(
                "[scaling] batch = \"global\": the global batch train.batch_size = {batch} does not \
                 split evenly over {world} ranks; use a multiple of {world}"
            ))
        }
        BatchScaling::Global => {
            let per_rank = batch / world;
            out.push(text_override("train.batch_size", per_rank.to_string()));
            per_rank
        }
    };
    if s.lr == LrScaling::Linear {
        let lr = c.train.lr * (per_rank * world) as f64 / batch as f64;
        out.push(text_override("train.lr", format!("{lr:?}")));
    }
    Ok(out)
}

fn text_override(key: &str, value: String) -> Override {
    Override { label: SCALING_LABEL.into(), text: format!("{key}={value}") }
}

pub fn labelled(label: &str, key: &str, value: &toml::Value) -> Override {
    Override { label: label.into(), text: format!("{key}={value}") }
}

fn resolve_one(pipeline: &Path, label: &str, key: &str, value: &toml::Value) -> Result<(), ConfigError> {
    config::resolve(pipeline, &[labelled(label, key, value)]).map(|_| ())
}

/// The dotted keys and values of a table's leaves, so that `"run.seed" = [0]` and
/// `[sweep.run] seed = [0]` mean the same.
fn leaves(table: &toml::Table) -> Vec<(String, toml::Value)> {
    let mut out = Vec::new();
    flatten("", &toml::Value::Table(table.clone()), &mut out);
    out
}

/// Where a value a search gives comes from, in a trial's config.toml.
pub const SEARCH_LABEL: &str = "search [search.space]";

/// The values of `param` a check tries, each with what it is ("a choice", "its low end").
pub(super) fn bounds(param: &crate::search::Param) -> Vec<(toml::Value, &'static str)> {
    use crate::search::Distribution::*;
    let ends = |low: toml::Value, high: toml::Value| vec![(low, "its low end"), (high, "its high end")];
    match &param.dist {
        Uniform { low, high } | LogUniform { low, high } => ends((*low).into(), (*high).into()),
        Int { low, high } | LogInt { low, high } => ends((*low).into(), (*high).into()),
        Choice(values) => values.iter().map(|v| (v.clone(), "one of its choices")).collect(),
    }
}

/// Whether every value `param` can take resolves against the pipeline (its key exists and takes
/// values of that type). The first problem, as the resolver says it.
pub fn check_values(pipeline: &Path, param: &crate::search::Param) -> Result<(), String> {
    for (v, _) in bounds(param) {
        crate::config::resolve(pipeline, &[labelled(SEARCH_LABEL, &param.key, &v)]).map_err(|e| e.message)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(world: usize, batch: usize, lr: f64) -> config::Config {
        let mut c = config::Config::default();
        c.run.world_size = world;
        c.train.batch_size = batch;
        c.train.lr = lr;
        c
    }

    fn texts(o: Vec<Override>) -> Vec<String> {
        o.into_iter().map(|o| o.text).collect()
    }

    #[test]
    fn scaling_splits_the_global_batch_and_scales_the_rate_linearly() {
        let s = |batch, lr| Scaling { batch, lr };
        use {BatchScaling::*, LrScaling as L};
        assert!(scale(s(PerRank, L::None), &config(4, 32, 0.1)).unwrap().is_empty());
        // Per-rank batch 32 on 4 ranks: global 128 = 4 × 32, so lr × 4.
        assert_eq!(texts(scale(s(PerRank, L::Linear), &config(4, 32, 0.05)).unwrap()), ["train.lr=0.2"]);
        // Global batch 32 over 4 ranks: 8 each; the global batch stays 32, so lr stays.
        assert_eq!(
            texts(scale(s(Global, L::Linear), &config(4, 32, 0.05)).unwrap()),
            ["train.batch_size=8", "train.lr=0.05"]
        );
        let e = scale(s(Global, L::None), &config(3, 32, 0.05)).unwrap_err();
        assert!(e.contains("does not split evenly over 3 ranks"), "{e}");
    }
}
