//! A fitted encoding applied to a file: the ranks' training file, a validation file, and
//! `runner predict`'s input.
use std::collections::HashMap;
use std::path::Path;

use polars::prelude::*;

use super::{cells, finite, keep, targets, Cells, Columns, Feature};

/// Rows of a file encoded with a fitted encoding.
#[derive(Debug)]
pub struct Encoded {
    /// Row-major, `width` values per row.
    pub x: Vec<f32>,
    pub width: usize,
    /// Targets (class ids or values) when the file has the target column.
    pub y: Option<Vec<f64>>,
    /// The file's row (0-based, header excluded) of each encoded row.
    pub rows: Vec<usize>,
    /// Cells of one-hot columns holding a value the training rows did not.
    pub unseen: usize,
}

/// Encodes `df` with `columns`; the target is read when the file has it.
pub fn encode(df: &DataFrame, path: &Path, columns: &Columns) -> Result<Encoded, String> {
    let names: Vec<String> = df.get_column_names().iter().map(|s| s.to_string()).collect();
    for f in &columns.features {
        if !names.iter().any(|n| n == f.name()) {
            return Err(format!("{} has no column `{}`, a feature of the run", path.display(), f.name()));
        }
    }
    let has_target = names.contains(&columns.target);
    let classification = columns.classes().is_some();
    let mut fcells = Vec::new();
    for f in &columns.features {
        let c = cells(df, f.name(), path, matches!(f, Feature::OneHot { .. }))?;
        if let (Feature::Numeric { .. }, Cells::Text(_)) = (f, &c) {
            return Err(format!("column `{}` of {} holds text; the run read numbers there", f.name(), path.display()));
        }
        fcells.push(c);
    }
    let tcells = if has_target {
        cells(df, &columns.target, path, classification)?
    } else {
        Cells::Num(vec![Some(0.0); df.height()])
    };
    let (kept, _) = keep(df.height(), &tcells, &fcells, columns, path)?;
    let y = has_target.then(|| targets(&tcells, &kept, columns, path)).transpose()?;
    let width = columns.input_names().len();
    let mut x = vec![0f32; kept.len() * width];
    let mut unseen = 0;
    let mut at = 0;
    for (f, c) in columns.features.iter().zip(&fcells) {
        match (f, c) {
            (Feature::Numeric { name, fill }, Cells::Num(v)) => {
                finite(name, v, path)?;
                for (r, &i) in kept.iter().enumerate() {
                    x[r * width + at] = v[i].or(*fill).unwrap_or(0.0) as f32;
                }
                at += 1;
            }
            (Feature::OneHot { values, .. }, Cells::Text(v)) => {
                let index: HashMap<&str, usize> = values.iter().enumerate().map(|(i, s)| (s.as_str(), i)).collect();
                for (r, &i) in kept.iter().enumerate() {
                    match v[i].as_deref().map(|s| index.get(s)) {
                        Some(Some(&k)) => x[r * width + at + k] = 1.0,
                        Some(None) => unseen += 1,
                        None => {}
                    }
                }
                at += values.len();
            }
            _ => unreachable!("checked above"),
        }
    }
    Ok(Encoded { x, width, y, rows: kept, unseen })
}
