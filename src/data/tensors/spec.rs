//! The plan's view of a tensors source: the keys it reads, the files' headers checked against
//! each other and the configuration, the classes counted from the labels.
use std::path::Path;

use super::{inspect, Arrays, TensorsInfo};
use crate::config::schema::{Config, Load};
use crate::data::split;
use crate::data::{DataSpec, SourceSpec, Task};

/// The plan's view of a tensors source; problems are reported through `bad`.
pub fn spec(c: &Config, base: &Path, bad: &mut impl FnMut(&str, String)) -> Option<DataSpec> {
    let load = &c.load;
    unread_keys(load, bad);
    let train = train_arrays(load, base, bad)?;
    let holdout = split::holdout(c, bad)?;
    let (x, labels, input) = match inspect(&train) {
        Ok(v) => v,
        Err(e) => {
            // Name the key of the file at fault.
            let key = match &train.labels {
                Some(l) if e.contains(&l.display().to_string()) => "load.labels",
                _ => "load.path",
            };
            bad(key, e);
            return None;
        }
    };
    drop(x);
    let validation = match &load.validation_path {
        None => None,
        Some(v) => Some(validation_arrays(&base.join(v), &input, bad)?),
    };
    check_features(load, &train.path, &input, bad);
    if let Some(r) = load.rows.filter(|&r| r > labels.len()) {
        bad("load.rows", format!("asks for {r} rows but {} has {}", train.path.display(), labels.len()));
    }
    let mut info = TensorsInfo {
        train,
        validation: validation.as_ref().map(|v| v.0.clone()),
        holdout,
        seed: c.run.seed,
        limit: load.rows,
        notes: Vec::new(),
    };
    let (train_rows, val_rows) = info.split_rows(&labels);
    let train_y: Vec<i64> = train_rows.iter().map(|&i| labels[i]).collect();
    let val_y: Vec<i64> = match &validation {
        Some((_, vl)) => vl.clone(),
        None => val_rows.iter().map(|&i| labels[i]).collect(),
    };
    let key = if load.labels.is_some() { "load.labels" } else { "load.path" };
    let classes = classes(load.classes, labels.iter().chain(&val_y), key, bad)?;
    if train_y.is_empty() {
        bad("validate.fraction", format!("leaves no training rows out of {}", labels.len()));
        return None;
    }
    let names: Vec<String> = (0..classes).map(|c| c.to_string()).collect();
    let as_ids = |v: &[i64]| v.iter().map(|&c| c as f64).collect::<Vec<f64>>();
    split::class_checks(&names, &as_ids(&train_y), &as_ids(&val_y), key, bad, &mut info.notes);
    Some(DataSpec {
        rows: train_y.len(),
        validation_rows: val_y.len(),
        input,
        task: Task::Classification { classes },
        source: SourceSpec::Tensors(info),
    })
}

/// The load keys a tensors source does not read: refused rather than ignored.
fn unread_keys(load: &Load, bad: &mut impl FnMut(&str, String)) {
    for (key, given) in [
        ("load.target", load.target.is_some()),
        ("load.image", load.image.is_some()),
        ("load.noise", load.noise != Load::default().noise),
    ] {
        if given {
            bad(key, "is not read by source = \"tensors\" (arrays `x` and `y`)".into());
        }
    }
    if load.validation_rows != Load::default().validation_rows {
        bad(
            "load.validation_rows",
            "is only read by source = \"synthetic\"; a tensors file's validation rows are validate.fraction (default \
             0.2), validate.rows or load.validation_path"
                .into(),
        );
    }
    if load.sampling != crate::config::schema::Sampling::Epoch {
        bad("load.sampling", "\"random\" draws windows from a token file: use source = \"tokens\" or \"text\"".into());
    }
}

/// The training file (and the labels' .npy beside an .npy `x`), each a regular file that exists.
fn train_arrays(load: &Load, base: &Path, bad: &mut impl FnMut(&str, String)) -> Option<Arrays> {
    let Some(rel) = load.path.as_ref().and_then(|p| p.single()) else {
        bad("load.path", "source = \"tensors\" needs a path to one .npz, .safetensors or .npy file".into());
        return None;
    };
    let train = Arrays { path: base.join(rel), labels: load.labels.as_ref().map(|l| base.join(l)) };
    let npy = train.path.extension().is_some_and(|e| e == "npy");
    if npy != train.labels.is_some() {
        let msg = if npy {
            "an .npy `path` holds `x` alone: name the .npy file of the labels here"
        } else {
            "is only read with an .npy `load.path` (an .npz or .safetensors file holds `y` itself)"
        };
        bad("load.labels", msg.into());
        return None;
    }
    for (key, p) in [("load.path", Some(&train.path)), ("load.labels", train.labels.as_ref())] {
        let Some(p) = p else { continue };
        if !p.exists() {
            bad(key, format!("{} does not exist (paths are relative to the pipeline file)", p.display()));
            return None;
        }
        if let Err(e) = crate::input::regular_file(p) {
            bad(key, e);
            return None;
        }
    }
    Some(train)
}

/// `load.validation_path`'s arrays and labels: `x` and `y` in one file, samples shaped as training's.
fn validation_arrays(path: &Path, input: &[usize], bad: &mut impl FnMut(&str, String)) -> Option<(Arrays, Vec<i64>)> {
    if let Err(e) = crate::input::regular_file(path) {
        bad("load.validation_path", e);
        return None;
    }
    let arrays = Arrays { path: path.to_path_buf(), labels: None };
    if arrays.path.extension().is_some_and(|e| e == "npy") {
        bad(
            "load.validation_path",
            "a tensors validation file holds `x` and `y` together: use an .npz or .safetensors file".into(),
        );
        return None;
    }
    match inspect(&arrays) {
        Ok((_, labels, shape)) if shape == input => Some((arrays, labels)),
        Ok((_, _, shape)) => {
            bad("load.validation_path", format!("its samples are {shape:?}, the training samples {input:?}"));
            None
        }
        Err(e) => {
            bad("load.validation_path", e);
            None
        }
    }
}

/// `load.features`, if given, must be a sample's size: a tensors file has no named columns.
fn check_features(load: &Load, path: &Path, input: &[usize], bad: &mut impl FnMut(&str, String)) {
    let size: usize = input.iter().product();
    match &load.features {
        Some(crate::config::schema::Features::Count(f)) if *f != size => {
            bad("load.features", format!("is {f} but a sample of {} holds {size} values ({input:?})", path.display()))
        }
        Some(crate::config::schema::Features::Columns(_)) => {
            bad("load.features", "names columns of a csv or parquet file; a tensors file has none".into())
        }
        _ => {}
    }
}

/// The number of classes: `load.classes` if given (at least the labels found), else the largest
/// label + 1. `key` names the labels' file.
fn classes<'a>(
    given: Option<usize>,
    labels: impl Iterator<Item = &'a i64>,
    key: &str,
    bad: &mut impl FnMut(&str, String),
) -> Option<usize> {
    let found = labels.max().map_or(1, |m| *m as usize + 1);
    let classes = given.unwrap_or(found);
    if classes < found {
        bad(
            "load.classes",
            format!(
                "is {classes} but the labels ({key}) go up to {}: set it to at least {found}, or remove it",
                found - 1
            ),
        );
    } else if classes > crate::data::columns::MAX_CLASSES {
        bad(
            key,
            format!(
                "holds a label of {}: more than {} classes is not a classification (labels are class ids 0, 1, 2, ...)",
                found - 1,
                crate::data::columns::MAX_CLASSES
            ),
        );
        return None;
    }
    Some(classes)
}
