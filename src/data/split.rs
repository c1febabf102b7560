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
