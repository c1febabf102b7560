//! The validation split of a data file: a seeded shuffle, stratified by class for classification
//! (each class keeps its share on both sides), the same on the plan, on every rank and in
//! `runner predict`.
use serde::{Deserialize, Serialize};

use crate::rng::Rng;

/// How many rows go to validation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Holdout {
    Fraction(f64),
    Rows(usize),
}

/// The validation split the configuration asks for, the same for every source with rows:
/// `Some(None)` with `load.validation_path` (a file holds the validation rows), `Some(Some(h))`
/// for `validate.rows` or `validate.fraction` (default 0.2), `None` (reported) for a conflict.
pub fn holdout(c: &crate::config::schema::Config, bad: &mut impl FnMut(&str, String)) -> Option<Option<Holdout>> {
    let v = &c.validate;
    match (&c.load.validation_path, v.fraction, v.rows) {
        (Some(_), None, None) => Some(None),
        (Some(_), _, _) => {
            bad("load.validation_path", "holds the validation rows: remove validate.fraction and validate.rows".into());
            None
        }
        (None, Some(_), Some(_)) => {
            bad("validate.rows", "and validate.fraction both set the validation rows: keep one".into());
            None
        }
        (None, _, Some(r)) => Some(Some(Holdout::Rows(r))),
        (None, f, None) => {
            let f = f.unwrap_or(0.2);
            if !(0.0..1.0).contains(&f) {
                bad("validate.fraction", format!("must be in [0, 1), got {f}"));
                return None;
            }
            Some(Some(Holdout::Fraction(f)))
        }
    }
}

/// The class checks of a split, the same for every source of labelled rows: a class the training
/// rows lack is refused (naming `key`, the file's key); a class under 1% of either side is noted.
pub fn class_checks(
    names: &[String],
    train_y: &[f64],
    val_y: &[f64],
    key: &str,
    bad: &mut impl FnMut(&str, String),
    notes: &mut Vec<String>,
) {
    let k = names.len();
    let count = |y: &[f64]| {
        let mut n = vec![0usize; k];
        y.iter().for_each(|&c| n[(c as usize).min(k - 1)] += 1);
        n
    };
    let (train, val) = (count(train_y), count(val_y));
    let lacking: Vec<&str> = (0..k).filter(|&c| train[c] == 0).map(|c| names[c].as_str()).collect();
    if !lacking.is_empty() {
        bad(
            key,
            format!(
                "the training rows hold no row of class {}: the model could never learn it (a separate validation \
                 file with classes the training file lacks, or too few rows?)",
                lacking.join(", ")
            ),
        );
    }
    for (side, n, total) in [("training", &train, train_y.len()), ("validation", &val, val_y.len())] {
        let rare: Vec<String> = (0..k)
            .filter(|&c| total > 0 && (n[c] as f64) < 0.01 * total as f64)
            .map(|c| format!("{} ({} of {total})", names[c], n[c]))
            .collect();
        if !rare.is_empty() {
            notes.push(format!("warning: classes under 1% of the {side} rows: {}", rare.join(", ")));
        }
    }
}

/// Training and validation positions (ascending) among `n` rows; `classes` holds each row's
/// class id to stratify by.
pub fn split(n: usize, holdout: Holdout, seed: u64, classes: Option<&[usize]>) -> (Vec<usize>, Vec<usize>) {
    let v = match holdout {
        Holdout::Fraction(f) => ((n as f64) * f).round() as usize,
        Holdout::Rows(r) => r,
    }
    .min(n);
    let mut rng = Rng::new(seed, 0x5B11);
    let mut val = Vec::with_capacity(v);
    match classes {
        None => {
            let p = rng.permutation(n);
            val.extend(p[..v].iter().map(|&i| i as usize));
        }
        Some(ids) => {
            let k = ids.iter().copied().max().map_or(0, |m| m + 1);
            let mut members = vec![Vec::new(); k];
            for (i, &c) in ids.iter().enumerate() {
                members[c].push(i);
            }
            // Largest remainder: each class's share of v, rounded so that the shares sum to v.
            let exact: Vec<f64> = members.iter().map(|m| v as f64 * m.len() as f64 / n.max(1) as f64).collect();
            let mut quota: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
            let mut order: Vec<usize> = (0..k).collect();
            order.sort_by(|&a, &b| {
                (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b))
            });
            let mut left = v - quota.iter().sum::<usize>();
            for c in order {
                if left == 0 {
                    break;
                }
                if quota[c] < members[c].len() {
                    quota[c] += 1;
                    left -= 1;
                }
            }
            for (c, m) in members.iter().enumerate() {
                let p = rng.permutation(m.len());
                val.extend(p[..quota[c]].iter().map(|&j| m[j as usize]));
            }
        }
    }
    val.sort_unstable();
    let mut is_val = vec![false; n];
    for &i in &val {
        is_val[i] = true;
    }
    ((0..n).filter(|&i| !is_val[i]).collect(), val)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stratified_split_keeps_each_class_share_and_covers_every_row() {
        // A file sorted by label: 50 of each of 3 classes.
        let ids: Vec<usize> = (0..150).map(|i| i / 50).collect();
        let (train, val) = split(150, Holdout::Fraction(0.2), 7, Some(&ids));
        assert_eq!((train.len(), val.len()), (120, 30));
        for c in 0..3 {
            assert_eq!(val.iter().filter(|&&i| ids[i] == c).count(), 10);
        }
        let mut all: Vec<usize> = train.iter().chain(&val).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..150).collect::<Vec<_>>());
        assert_eq!(split(150, Holdout::Fraction(0.2), 7, Some(&ids)), (train, val), "seeded");
    }

    #[test]
    fn rows_holdout_without_classes_is_a_seeded_shuffle() {
        let (train, val) = split(10, Holdout::Rows(3), 1, None);
        assert_eq!((train.len(), val.len()), (7, 3));
        assert_ne!(val, vec![7, 8, 9]);
    }
}
