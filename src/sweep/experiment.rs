//! Experiment files: which pipeline, fixed overrides (`[set]`), the grid (`[sweep]`), how the
//! batch and learning rate follow the world size (`[scaling]`) and a search run at every point
//! of the grid (`[search]`, [`super::search`]). [`Experiment::load`] checks the file and every
//! key; [`Experiment::points`] resolves and validates every point of the grid, reporting every
//! bad one before anything runs.
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::grid::{self, Axis, Point};
use super::points;
pub use super::scaling::{BatchScaling, LrScaling, Scaling};
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
    /// Named points, each a name and the keys it sets ([`points`]).
    points: Option<Vec<toml::Table>>,
}

/// A checked experiment file.
#[derive(Debug, Clone)]
pub struct Experiment {
    pub file: PathBuf,
    pub pipeline: PathBuf,
    pub fixed: Vec<(String, toml::Value)>,
    pub axes: Vec<Axis>,
    /// The named points (`[[points]]`), in the file's order; none for a grid alone.
    pub named: Vec<points::Named>,
    pub scaling: Scaling,
    pub slurm: super::slurm::Resources,
    pub search: Option<crate::search::spec::Spec>,
}

impl Experiment {
    /// Reads and checks the file: its keys, the pipeline it names, and that every `[set]` key,
    /// every axis value and every named point's key resolves against that pipeline. Reports every
    /// problem found.
    pub fn load(file: &Path) -> Result<Experiment, ConfigError> {
        let layers = Layers::read(file, FileKind::Experiment, "the experiment file")?;
        let raw: ExperimentFile = parse_layers(&layers)?;
        let mut found = Problems { layers: &layers, file, errors: Vec::new() };
        let pipeline = pipeline_of(&raw, &layers, file, &mut found)?;
        let fixed = leaves(&raw.set);
        for (key, value) in &fixed {
            if let Err(e) = resolve_one(&pipeline, SET_LABEL, key, value) {
                found.bad("set", key, e.message);
            }
        }
        let axes = check_axes(&raw.sweep, &fixed, &pipeline, &mut found);
        let fixed_keys: Vec<String> = fixed.iter().map(|(k, _)| k.clone()).collect();
        let swept: Vec<String> = axes.iter().map(|(_, a)| a.key.clone()).collect();
        let named = match &raw.points {
            None => Vec::new(),
            Some(entries) => {
                let taken = points::Taken { fixed: &fixed_keys, swept: &swept };
                let resolves = |label: &str, key: &str, value: &toml::Value| {
                    resolve_one(&pipeline, label, key, value).map_err(|e| e.message)
                };
                let (named, problems) = points::check(entries, &layers, &taken, &resolves);
                found.errors.extend(problems);
                named
            }
        };
        let taken: Vec<String> = fixed_keys.into_iter().chain(swept).collect();
        let search = raw.search.as_ref().and_then(|table| check_search(table, &taken, &pipeline, &mut found));
        if search.is_some() && !named.is_empty() {
            // A search's trials and its report follow the grid's axes; named points are not built there.
            found.bad("", "search", "[search] and [[points]] cannot be combined yet: search over a [sweep] grid, or run the named points without [search]".into());
        }
        found.into_result()?;
        let mut axes = axes;
        // The grid follows the file's order of axes, whatever order the TOML map keeps.
        axes.sort_by_key(|(at, _)| *at);
        Ok(Experiment {
            file: file.to_owned(),
            pipeline,
            fixed,
            axes: axes.into_iter().map(|(_, a)| a).collect(),
            named,
            scaling: raw.scaling,
            slurm: raw.slurm,
            search,
        })
    }

    /// The sweep's name: the experiment file's stem (`results/<name>/` by default).
    pub fn name(&self) -> String {
        self.file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "sweep".into())
    }

    /// Every point, resolved and validated; every bad point is reported. Without named points,
    /// the grid's; with them, each named point at each combination of the axes.
    pub fn points(&self) -> Result<Vec<Point>, ConfigError> {
        let grid = grid::product(&self.axes);
        let names: Vec<Option<&points::Named>> =
            if self.named.is_empty() { vec![None] } else { self.named.iter().map(Some).collect() };
        let mut combos = Vec::with_capacity(names.len() * grid.len());
        for named in names {
            let dirs = grid::dir_names(&self.axes, &grid);
            for (values, dir) in grid.iter().zip(dirs) {
                let dir = match (named, dir.as_str()) {
                    (None, _) => dir,
                    (Some(n), "default") => n.name.clone(),
                    (Some(n), _) => format!("{},{dir}", n.name),
                };
                combos.push((named, values.clone(), dir));
            }
        }
        for (i, (_, _, dir)) in combos.iter().enumerate() {
            if combos[..i].iter().any(|(_, _, d)| d == dir) {
                return Err(ConfigError::new(format!(
                    "{}: two points would share the directory `{dir}`: an axis repeats a value, \
                     or two values differ only in characters a path cannot hold",
                    self.file.display()
                )));
            }
        }
        let mut points = Vec::with_capacity(combos.len());
        let mut errors = Vec::new();
        for (named, values, dir) in combos {
            match self.plan(named, &values) {
                Ok((plan, overrides)) => {
                    let name = named.map(|n| n.name.clone());
                    points.push(Point { dir, name, values, plan, overrides })
                }
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

    /// One point's plan and the overrides (in order) that produce it: its named point's keys,
    /// then its axis values.
    fn plan(
        &self,
        named: Option<&points::Named>,
        values: &[(String, toml::Value)],
    ) -> Result<(Plan, Vec<Override>), String> {
        let set = named
            .map(|n| (n.label(), &n.set[..]))
            .into_iter()
            .flat_map(|(label, set)| set.iter().map(move |(k, v)| labelled(&label, k, v)));
        self.plan_of(set.chain(values.iter().map(|(k, v)| labelled(AXIS_LABEL, k, v))).collect())
    }

    /// The plan of [set], then `given` (a point's axis values, a search trial's values), then
    /// [scaling]; and the overrides (in order) that produce it.
    pub fn plan_of(&self, given: Vec<Override>) -> Result<(Plan, Vec<Override>), String> {
        let mut overrides: Vec<Override> =
            self.fixed.iter().map(|(k, v)| labelled(SET_LABEL, k, v)).chain(given).collect();
        let resolved = config::resolve(&self.pipeline, &overrides).map_err(|e| e.message)?;
        let scaled = super::scaling::scale(self.scaling, &resolved.config)?;
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

/// The problems found in an experiment file, each with where it is, reported together in the
/// chain's and the files' order.
struct Problems<'a> {
    layers: &'a Layers,
    file: &'a Path,
    errors: Vec<points::Problem>,
}

impl Problems<'_> {
    fn bad(&mut self, section: &str, key: &str, message: String) {
        let dotted = if section.is_empty() { key.to_owned() } else { format!("{section}.{key}") };
        let at = match self.layers.origin(&dotted).or_else(|| self.layers.origin_of_quoted(section, key)) {
            Some((f, Some(line))) => format!("{}:{line}", f.display()),
            Some((f, None)) => f.display().to_string(),
            None => self.file.display().to_string(),
        };
        self.errors.push((self.layers.position(&dotted), format!("{at}: {message}")));
    }

    fn into_result(mut self) -> Result<(), ConfigError> {
        if self.errors.is_empty() {
            return Ok(());
        }
        self.errors.sort_by_key(|(at, _)| *at);
        let lines: Vec<String> = self.errors.into_iter().map(|(_, m)| m).collect();
        Err(ConfigError::new(lines.join("\n")))
    }
}

/// The pipeline file the experiment names, relative to the file of the chain that names it.
fn pipeline_of(
    raw: &ExperimentFile,
    layers: &Layers,
    file: &Path,
    found: &mut Problems,
) -> Result<PathBuf, ConfigError> {
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
        let why = format!(
            "`pipeline` names {}, which is not a file (the path is relative to the experiment file)",
            pipeline.display()
        );
        found.bad("", "pipeline", why);
        return Err(ConfigError::new(found.errors.remove(0).1));
    }
    Ok(pipeline)
}

/// The `[sweep]` axes, each with where it is in the chain; a bad axis is reported and left out.
fn check_axes(
    sweep: &toml::Table,
    fixed: &[(String, toml::Value)],
    pipeline: &Path,
    found: &mut Problems,
) -> Vec<((usize, usize), Axis)> {
    let mut axes = Vec::new();
    for (key, value) in leaves(sweep) {
        if fixed.iter().any(|(k, _)| *k == key) {
            let message = format!("`{key}` is both fixed in [set] and swept in [sweep]; keep one");
            found.bad("sweep", &key, message);
            continue;
        }
        let values = match value {
            toml::Value::Array(values) if values.is_empty() => {
                let message = format!("the axis `{key}` is empty; give it at least one value");
                found.bad("sweep", &key, message);
                continue;
            }
            toml::Value::Array(values) => values,
            other => {
                let message = format!("the axis `{key}` must be a list of values, e.g. [{other}]");
                found.bad("sweep", &key, message);
                continue;
            }
        };
        // A bad key fails on the first value; report it once, not once per value.
        for value in &values {
            if let Err(e) = resolve_one(pipeline, AXIS_LABEL, &key, value) {
                found.bad("sweep", &key, e.message);
                if value == &values[0] {
                    break;
                }
            }
        }
        axes.push((found.layers.position(&format!("sweep.{key}")), Axis { key, values }));
    }
    axes
}

/// The `[search]` table checked, with every value of its space resolved against the pipeline;
/// none (and the problems reported) where it is bad.
fn check_search(
    table: &crate::search::spec::SearchTable,
    taken: &[String],
    pipeline: &Path,
    found: &mut Problems,
) -> Option<crate::search::spec::Spec> {
    let spec = crate::search::spec::Spec::check(table, taken);
    if let Ok(spec) = &spec {
        for p in &spec.space.0 {
            if let Err(e) = check_values(pipeline, p) {
                found.bad("search.space", &p.key, e);
            }
        }
    }
    spec.map_err(|problems| {
        for (key, message) in problems {
            match key.strip_prefix("space.") {
                Some(k) => found.bad("search.space", k, message),
                None => found.bad("search", &key, message),
            }
        }
    })
    .ok()
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
