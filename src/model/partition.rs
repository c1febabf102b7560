//! Splitting a model's layers into pipeline stages: contiguous, non-empty, in order, balanced by
//! parameter count (the largest stage as small as it can be).
use std::ops::Range;

/// The contiguous split of layers (with `params[i]` parameters each) into `stages` non-empty
/// stages whose largest stage has the fewest parameters; among equally good splits, the one with
/// the earliest stages largest. `None` when there are fewer layers than stages.
pub fn balanced(params: &[usize], stages: usize) -> Option<Vec<Range<usize>>> {
    let n = params.len();
    if stages == 0 || stages > n {
        return None;
    }
    let prefix: Vec<usize> = std::iter::once(0)
        .chain(params.iter().scan(0, |s, p| {
            *s += p;
            Some(*s)
        }))
        .collect();
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][j]: the smallest largest stage when the last j layers form k stages; cut[k][j]:
    // where the first of those stages ends.
    let mut best = vec![vec![usize::MAX; n + 1]; stages + 1];
    let mut cut = vec![vec![0; n + 1]; stages + 1];
    for j in 1..=n {
        best[1][j] = sum(n - j, n);
        cut[1][j] = n;
    }
    for k in 2..=stages {
        for j in k..=n {
            let start = n - j;
            // The first stage takes layers start..end, at least one, leaving k - 1 for the rest.
            for end in start + 1..=n - (k - 1) {
                let cost = sum(start, end).max(best[k - 1][n - end]);
                if cost <= best[k][j] {
                    best[k][j] = cost;
                    cut[k][j] = end;
                }
            }
        }
    }
    let mut out = Vec::with_capacity(stages);
    let mut start = 0;
    for k in (1..=stages).rev() {
        let end = cut[k][n - start];
        out.push(start..end);
        start = end;
    }
    Some(out)
}

/// The layers of each stage as a range, if `stages` lists every layer of `0..layers` exactly
/// once, in order, each stage contiguous and non-empty; otherwise what is wrong.
pub fn explicit(stages: &[Vec<usize>], layers: usize) -> Result<Vec<Range<usize>>, String> {
    let mut next = 0;
    let mut out = Vec::with_capacity(stages.len());
    for (r, stage) in stages.iter().enumerate() {
        let (Some(&first), Some(&last)) = (stage.first(), stage.last()) else {
            return Err(format!("stage {r} is empty; every rank needs at least one layer"));
        };
        if let Some(&bad) = stage.iter().find(|&&l| l >= layers) {
            return Err(format!("stage {r} names layer {bad}, but the model has layers 0 to {}", layers - 1));
        }
        if first != next || stage.windows(2).any(|w| w[1] != w[0] + 1) {
            return Err(format!(
                "stage {r} is {stage:?}, but the layers must come in order, each exactly once: \
                 stage {r} must start with layer {next} and list consecutive layers"
            ));
        }
        next = last + 1;
        out.push(first..last + 1);
    }
    if next != layers {
        let missing = if next + 1 == layers {
            format!("layer {next} is")
        } else {
            format!("layers {next} to {} are", layers - 1)
        };
        return Err(format!("{missing} in no stage; the stages must cover all {layers} layers"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every contiguous split into `k` non-empty stages, by brute force.
    fn splits(n: usize, k: usize) -> Vec<Vec<Range<usize>>> {
        if k == 1 {
            return vec![vec![0..n]];
        }
        (1..n)
            .flat_map(|end| {
                splits(n - end, k - 1).into_iter().map(move |rest| {
                    std::iter::once(0..end).chain(rest.into_iter().map(|r| r.start + end..r.end + end)).collect()
                })
            })
            .collect()
    }

    fn largest(params: &[usize], split: &[Range<usize>]) -> usize {
        split.iter().map(|r| params[r.clone()].iter().sum()).max().unwrap()
    }

    #[test]
    fn balanced_is_as_good_as_the_best_split() {
        let cases: &[&[usize]] =
            &[&[5], &[1, 1, 1, 1], &[1010, 65792, 65792, 65792, 2570], &[9, 1, 1, 1, 9, 2, 7], &[3, 3, 3, 10, 1]];
        for params in cases {
            for k in 1..=params.len() {
                let got = balanced(params, k).unwrap();
                assert_eq!(got.len(), k);
                assert_eq!(got.first().unwrap().start, 0);
                assert_eq!(got.last().unwrap().end, params.len());
                assert!(got.iter().all(|r| !r.is_empty()) && got.windows(2).all(|w| w[0].end == w[1].start));
                let best = splits(params.len(), k).iter().map(|s| largest(params, s)).min().unwrap();
                assert_eq!(largest(params, &got), best, "{params:?} into {k}");
            }
        }
        assert_eq!(balanced(&[1, 1], 3), None);
        assert_eq!(balanced(&[4, 4, 4, 4], 2).unwrap(), vec![0..2, 2..4]);
    }

    #[test]
    fn explicit_stages_must_cover_every_layer_in_order() {
        assert_eq!(explicit(&[vec![0, 1], vec![2], vec![3]], 4).unwrap(), vec![0..2, 2..3, 3..4]);
        let err = |s: &[Vec<usize>]| explicit(s, 4).unwrap_err();
        assert_eq!(err(&[vec![0, 1], vec![]]), "stage 1 is empty; every rank needs at least one layer");
        assert_eq!(err(&[vec![0, 1], vec![2, 7]]), "stage 1 names layer 7, but the model has layers 0 to 3");
        assert!(err(&[vec![0, 2], vec![1, 3]]).starts_with("stage 0 is [0, 2], but the layers must come in order"));
        assert!(err(&[vec![1, 2], vec![0, 3]]).contains("stage 0 must start with layer 0"));
        assert_eq!(err(&[vec![0, 1], vec![2]]), "layer 3 is in no stage; the stages must cover all 4 layers");
        assert_eq!(err(&[vec![0, 1]]), "layers 2 to 3 are in no stage; the stages must cover all 4 layers");
    }
}
