//! csv and parquet files read with polars: fitted on the plan ([`inspect`]: columns, encoding,
//! validation split, all from the training rows), read as encoded rows on each rank ([`load`]).
use std::path::{Path, PathBuf};

use polars::prelude::*;
use serde::{Deserialize, Serialize};

use super::columns::{self, Choice, Columns, Encoded};
use super::split::{self, Holdout};
use crate::config::schema::Source;

/// What the plan knows of a data file, and everything needed to read it again the same way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    pub path: PathBuf,
    pub source: Source,
    /// csv: the field separator.
    pub delimiter: u8,
    /// Only the file's first rows (`load.rows`).
    pub limit: Option<usize>,
    /// Rows in the file.
    pub file_rows: usize,
    /// Rows kept (after `load.rows` and `load.missing`), training and validation.
    pub rows: usize,
    pub columns: Columns,
    /// How validation rows are held out of the file, with `seed`; absent with `validation_path`.
    pub holdout: Option<Holdout>,
    pub seed: u64,
    pub validation_path: Option<PathBuf>,
    /// What `runner validate` and `runner run` tell the user about the data.
    pub notes: Vec<String>,
}

/// Reads a csv or parquet file: empty, NA, N/A and null cells are missing.
pub fn read(path: &Path, source: Source, delimiter: u8, limit: Option<usize>) -> Result<DataFrame, String> {
    let fail = |e: PolarsError| format!("cannot read {}: {e}", path.display());
    if !path.is_file() {
        return Err(format!("{} does not exist (paths are relative to the pipeline file)", path.display()));
    }
    let df = match source {
        Source::Parquet => {
            let file = std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            ParquetReader::new(file).finish().map_err(fail)?
        }
        _ => {
            let nulls: Vec<PlSmallStr> =
                ["", "NA", "N/A", "null", "NULL"].iter().map(|s| PlSmallStr::from(*s)).collect();
            CsvReadOptions::default()
                .with_has_header(true)
                .with_infer_schema_length(None)
                .map_parse_options(move |p| {
                    p.with_separator(delimiter).with_null_values(Some(NullValues::AllColumns(nulls.clone())))
                })
                .try_into_reader_with_file_path(Some(path.to_owned()))
                .and_then(|r| r.finish())
                .map_err(fail)?
        }
    };
    Ok(match limit {
        Some(n) => df.head(Some(n)),
        None => df,
    })
}

/// Class ids of targets that are class ids.
fn class_ids(y: &[f64], info_columns: &Columns) -> Option<Vec<usize>> {
    info_columns.classes().map(|_| y.iter().map(|&v| v as usize).collect())
}

/// Fits the file's encoding and split on the plan: returns the info and the encoded training and
/// validation rows (for the plan's checks).
#[allow(clippy::too_many_arguments)]
pub fn inspect(
    path: &Path,
    source: Source,
    delimiter: u8,
    limit: Option<usize>,
    choice: &Choice,
    holdout: Option<Holdout>,
    seed: u64,
    validation_path: Option<&Path>,
) -> Result<(FileInfo, Rows), String> {
    let df = read(path, source, delimiter, None)?;
    let file_rows = df.height();
    let df = match limit {
        Some(n) => df.head(Some(n)),
        None => df,
    };
    let classification = choice.task == crate::config::schema::TaskKind::Classification;
    let fitted = columns::fit(&df, path, choice, |y| {
        Ok(match holdout {
            Some(h) => {
                let ids: Option<Vec<usize>> = classification.then(|| y.iter().map(|&v| v as usize).collect());
                split::split(y.len(), h, seed, ids.as_deref()).0
            }
            None => (0..y.len()).collect(),
        })
    })?;
    let info = FileInfo {
        path: path.to_owned(),
        source,
        delimiter,
        limit,
        file_rows,
        rows: fitted.rows,
        columns: fitted.columns,
        holdout,
        seed,
        validation_path: validation_path.map(Path::to_owned),
        notes: fitted.notes,
    };
    let rows = load_encoded(&info, df)?;
    Ok((info, rows))
}

/// Training and validation rows, encoded: inputs row-major (`width` per row), targets as class
/// ids or values (in original units).
#[derive(Debug)]
pub struct Rows {
    pub width: usize,
    pub train_x: Vec<f32>,
    pub train_y: Vec<f64>,
    pub val_x: Vec<f32>,
    pub val_y: Vec<f64>,
    /// The file rows (0-based, header excluded) of the training and validation rows (of the
    /// validation file with `load.validation_path`).
    pub train_rows: Vec<usize>,
    pub val_rows: Vec<usize>,
}

/// The run's rows, read and encoded as the plan fitted them.
pub fn load(info: &FileInfo) -> Result<Rows, String> {
    let df = read(&info.path, info.source, info.delimiter, info.limit)?;
    load_encoded(info, df)
}

fn load_encoded(info: &FileInfo, df: DataFrame) -> Result<Rows, String> {
    let main = columns::encode(&df, &info.path, &info.columns)?;
    let y = main.y.clone().unwrap_or_default();
    let pick = |e: &Encoded, idx: &[usize]| -> (Vec<f32>, Vec<f64>) {
        let w = e.width;
        let ys = e.y.as_deref().unwrap_or_default();
        (
            idx.iter().flat_map(|&i| e.x[i * w..(i + 1) * w].iter().copied()).collect(),
            idx.iter().map(|&i| ys[i]).collect(),
        )
    };
    match (&info.holdout, &info.validation_path) {
        (Some(h), _) => {
            let ids = class_ids(&y, &info.columns);
            let (train, val) = split::split(y.len(), *h, info.seed, ids.as_deref());
            let (train_x, train_y) = pick(&main, &train);
            let (val_x, val_y) = pick(&main, &val);
            let (train_rows, val_rows) =
                (train.iter().map(|&i| main.rows[i]).collect(), val.iter().map(|&i| main.rows[i]).collect());
            Ok(Rows { width: main.width, train_x, train_y, val_x, val_y, train_rows, val_rows })
        }
        (None, Some(vpath)) => {
            let vdf = read(vpath, info.source, info.delimiter, None)?;
            let v = columns::encode(&vdf, vpath, &info.columns)?;
            if v.y.is_none() {
                return Err(format!("{} has no column `{}`, the target", vpath.display(), info.columns.target));
            }
            Ok(Rows {
                width: main.width,
                train_x: main.x,
                train_y: y,
                val_x: v.x,
                val_y: v.y.unwrap_or_default(),
                train_rows: main.rows,
                val_rows: v.rows,
            })
        }
        (None, None) => Ok(Rows {
            width: main.width,
            train_x: main.x,
            train_y: y,
            val_x: Vec::new(),
            val_y: Vec::new(),
            train_rows: main.rows,
            val_rows: Vec::new(),
        }),
    }
}

/// The plan's view of a csv or parquet file: the columns fitted, the split made and checked.
pub fn spec(
    c: &crate::config::schema::Config,
    source: Source,
    base: &Path,
    bad: &mut impl FnMut(&str, String),
) -> Option<super::DataSpec> {
    use crate::config::schema::Features;
    let load = &c.load;
    let name = if source == Source::Csv { "csv" } else { "parquet" };
    let Some(rel) = load.path.as_ref().and_then(|p| p.single()) else {
        bad("load.path", format!("source = \"{name}\" needs a path to one file"));
        return None;
    };
    let Some(target) = &load.target else {
        bad("load.target", "names the column to predict; it is required for files".into());
        return None;
    };
    unread_keys(load, bad);
    let delimiter = delimiter(load.delimiter.as_deref(), source, bad);
    let holdout = split::holdout(c, bad)?;
    let path = base.join(rel);
    if let Err(e) = path.exists().then(|| crate::input::regular_file(&path)).transpose() {
        bad("load.path", e);
        return None;
    }
    let vpath = load.validation_path.as_ref().map(|p| base.join(p));
    if let Some(vp) = &vpath {
        if let Err(e) = crate::input::regular_file(vp) {
            bad("load.validation_path", e);
            return None;
        }
    }
    let names = match &load.features {
        Some(Features::Columns(names)) => Some(names.as_slice()),
        _ => None,
    };
    let choice = Choice { target, features: names, exclude: &load.exclude, missing: load.missing, task: c.train.task };
    let limit = load.rows;
    let (mut info, rows) =
        match inspect(&path, source, delimiter, limit, &choice, holdout, c.run.seed, vpath.as_deref()) {
            Ok(found) => found,
            Err(e) => {
                let key = if vpath.as_ref().is_some_and(|v| e.contains(&v.display().to_string())) {
                    "load.validation_path"
                } else {
                    "load.path"
                };
                bad(key, e);
                return None;
            }
        };
    let width = rows.width;
    if let Some(asked) = limit.filter(|&r| r > info.file_rows) {
        bad("load.rows", format!("asks for {asked} rows but {} has {}", path.display(), info.file_rows));
    }
    if let Some(Features::Count(f)) = load.features {
        if f != width {
            bad("load.features", format!("is {f} but {} gives {width} inputs besides `{target}`", path.display()));
        }
    }
    let task = task(load.classes, target, &rows, &mut info, bad);
    let constant = constant_inputs(&rows.train_x, width, &info.columns.input_names());
    if !constant.is_empty() {
        info.notes.push(format!("constant over the training rows (normalised with scale 1): {}", constant.join(", ")));
    }
    if rows.train_y.is_empty() {
        bad("validate.fraction", format!("leaves no training rows out of {}", info.rows));
        return None;
    }
    Some(super::DataSpec {
        rows: rows.train_y.len(),
        input: vec![width],
        task,
        validation_rows: rows.val_y.len(),
        source: super::SourceSpec::Table(FileInfo { path, ..info }),
    })
}

/// The load keys a csv or parquet source does not read: refused rather than ignored.
fn unread_keys(load: &crate::config::schema::Load, bad: &mut impl FnMut(&str, String)) {
    use crate::config::schema::{Load, Sampling};
    for (key, given, why) in [
        ("load.noise", load.noise != Load::default().noise, "is only read by source = \"synthetic\""),
        ("load.image", load.image.is_some(), "is only read by source = \"synthetic\"; a file's columns are features"),
        ("load.labels", load.labels.is_some(), "is only read by source = \"tensors\""),
        (
            "load.sampling",
            load.sampling != Sampling::Epoch,
            "\"random\" draws windows from a token file: use source = \"tokens\" or \"text\"",
        ),
        // Compared with the default, not by source: a run's saved config.toml sets every key.
        (
            "load.validation_rows",
            load.validation_rows != Load::default().validation_rows,
            "is only read by source = \"synthetic\"; a file's validation rows are validate.fraction (default 0.2), \
             validate.rows or load.validation_path",
        ),
    ] {
        if given {
            bad(key, why.into());
        }
    }
}

/// `load.delimiter`: one ASCII character, read by csv files only (a comma otherwise).
fn delimiter(given: Option<&str>, source: Source, bad: &mut impl FnMut(&str, String)) -> u8 {
    match given {
        None => b',',
        Some(d) if d.len() == 1 && source == Source::Csv => d.as_bytes()[0],
        Some(d) if source != Source::Csv => {
            bad("load.delimiter", format!("{d:?} is only read by source = \"csv\""));
            b','
        }
        Some(d) => {
            bad("load.delimiter", format!("{d:?} is not one ASCII character; use e.g. \";\" or \"\\t\""));
            b','
        }
    }
}

/// The task the target's column gives, `load.classes` checked against the classes found.
fn task(
    given_classes: Option<usize>,
    target: &str,
    rows: &Rows,
    info: &mut FileInfo,
    bad: &mut impl FnMut(&str, String),
) -> super::Task {
    match info.columns.classes() {
        Some(names) => {
            let k = names.len();
            if let Some(classes) = given_classes.filter(|&n| n != k) {
                bad("load.classes", format!("is {classes} but `{target}` holds {k} classes ({})", names.join(", ")));
            }
            split::class_checks(names, &rows.train_y, &rows.val_y, "load.path", bad, &mut info.notes);
            super::Task::Classification { classes: k }
        }
        None => {
            if given_classes.is_some() {
                bad("load.classes", "is only read by train.task = \"classification\"".into());
            }
            super::Task::Regression
        }
    }
}

/// Inputs whose training values are constant, or nearly: the normalizer gives them scale 1.
fn constant_inputs(x: &[f32], width: usize, names: &[String]) -> Vec<String> {
    (0..width)
        .filter(|&j| {
            let (lo, hi) = x
                .iter()
                .skip(j)
                .step_by(width)
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            super::normalize::is_constant((hi - lo) as f64, lo.abs().max(hi.abs()) as f64)
        })
        .map(|j| names[j].clone())
        .collect()
}

impl FileInfo {
    pub fn inputs(&self) -> Vec<(&'static str, PathBuf)> {
        let mut v = vec![("load.path", self.path.clone())];
        v.extend(self.validation_path.iter().map(|p| ("load.validation_path", p.clone())));
        v
    }
}
