//! Shard:  DistributedSampler's semantics. Each epoch has one permutation of the
//! training rows, from (seed, epoch) alone, so it is the same at every world size; rank r takes
//! positions r, r+W, r+2W, ... Without `drop_last` the permutation is padded by repeating its
//! start so every rank gets as many rows (padded rows are trained on, as torch does, but are
//! never counted in a metric); with it, the tail that does not divide is dropped.
//!
//! `strategy = "batch"` (seed 002) walks the same permutation one global batch at a time and
//! splits each global batch evenly: at step k rank r takes positions kG + rb .. kG + (r+1)b of
//! it, with b = G / W. Its last global batch is padded (or dropped) the same way.
use tch::{Device, Kind, Tensor};

use crate::rng::Rng;

/// How the training rows divide across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardLayout {
    pub rows: usize,
    pub world_size: usize,
    /// Rows per rank per epoch (padding included).
    pub per_rank: usize,
    pub drop_last: bool,
    /// Batch split: each rank's share of every global batch; `None` for dataset sharding.
    pub split_batch: Option<usize>,
}

impl ShardLayout {
    /// DistributedSampler sharding.
    pub fn new(rows: usize, world_size: usize, drop_last: bool) -> ShardLayout {
        let per_rank = if drop_last { rows / world_size } else { rows.div_ceil(world_size) };
        ShardLayout { rows, world_size, per_rank, drop_last, split_batch: None }
    }

    /// Batch split: every global batch of `global_batch` rows split into `world_size` equal parts.
    pub fn split(rows: usize, world_size: usize, global_batch: usize, drop_last: bool) -> ShardLayout {
        let steps = if drop_last { rows / global_batch } else { rows.div_ceil(global_batch) };
        let share = global_batch / world_size;
        ShardLayout { rows, world_size, per_rank: steps * share, drop_last, split_batch: Some(share) }
    }

    /// Rows that are padding on some rank (repeats), 0 with drop_last.
    pub fn padding(&self) -> usize {
        (self.per_rank * self.world_size).saturating_sub(self.rows)
    }

    /// Rows left out of every epoch by drop_last.
    pub fn dropped(&self) -> usize {
        self.rows.saturating_sub(self.per_rank * self.world_size)
    }
}

/// The order of the training rows in `epoch` (1-based); the file order when not shuffling.
pub fn permutation(seed: u64, epoch: usize, rows: usize, shuffle: bool) -> Vec<i64> {
    if shuffle {
        Rng::new(seed.wrapping_add(epoch as u64), 0x53_4841_5244).permutation(rows)
    } else {
        (0..rows as i64).collect()
    }
}

/// One rank's rows for an epoch: their indices, and 1.0 for a real row / 0.0 for padding.
#[derive(Debug)]
pub struct RankShard {
    pub indices: Vec<i64>,
    pub weights: Vec<f32>,
}

impl RankShard {
    pub fn take(layout: &ShardLayout, perm: &[i64], rank: usize) -> RankShard {
        let mut indices = Vec::with_capacity(layout.per_rank);
        let mut weights = Vec::with_capacity(layout.per_rank);
        for i in 0..layout.per_rank {
            let pos = match layout.split_batch {
                None => rank + i * layout.world_size,
                Some(b) => (i / b) * b * layout.world_size + rank * b + i % b,
            };
            // Positions past the end wrap to the permutation's start: torch's padding.
            indices.push(perm[pos % layout.rows]);
            weights.push(if pos < layout.rows { 1.0 } else { 0.0 });
        }
        RankShard { indices, weights }
    }

    pub fn index_tensor(&self) -> Tensor {
        Tensor::from_slice(&self.indices).to_kind(Kind::Int64).to_device(Device::Cpu)
    }

    pub fn weight_tensor(&self) -> Tensor {
        Tensor::from_slice(&self.weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_row_once_counting_only_real_rows() {
        for rows in [1usize, 2, 7, 10, 33, 100, 101] {
            for world in 1..=5 {
                for drop_last in [false, true] {
                    let l = ShardLayout::new(rows, world, drop_last);
                    if l.per_rank == 0 {
                        continue;
                    }
                    let perm = permutation(3, 1, rows, true);
                    let mut seen = vec![0usize; rows];
                    for r in 0..world {
                        let s = RankShard::take(&l, &perm, r);
                        assert_eq!(s.indices.len(), l.per_rank);
                        for (i, w) in s.indices.iter().zip(&s.weights) {
                            seen[*i as usize] += *w as usize;
                        }
                    }
                    let counted: usize = seen.iter().sum();
                    assert_eq!(counted, rows - l.dropped(), "rows {rows} world {world} drop_last {drop_last}");
                    assert!(seen.iter().all(|&c| c <= 1), "a row counted twice");
                }
            }
        }
    }

    #[test]
    fn rank_batches_interleave_to_the_single_process_batches() {
        // Step s of W ranks × batch B covers exactly step s of one rank × batch W·B.
        let (rows, world, b) = (64, 2, 4);
        let perm = permutation(9, 2, rows, true);
        let one = RankShard::take(&ShardLayout::new(rows, 1, true), &perm, 0);
        let l = ShardLayout::new(rows, world, true);
        let shards: Vec<RankShard> = (0..world).map(|r| RankShard::take(&l, &perm, r)).collect();
        for step in 0..rows / (world * b) {
            let mut mine: Vec<i64> = shards.iter().flat_map(|s| s.indices[step * b..(step + 1) * b].to_vec()).collect();
            let mut single = one.indices[step * world * b..(step + 1) * world * b].to_vec();
            mine.sort();
            single.sort();
            assert_eq!(mine, single, "step {step}");
        }
    }

    #[test]
    fn batch_split_covers_each_global_batch_evenly() {
        for (rows, world, global, drop_last) in
            [(100, 2, 20, false), (101, 2, 20, false), (101, 2, 20, true), (90, 3, 30, false)]
        {
            let l = ShardLayout::split(rows, world, global, drop_last);
            let perm = permutation(4, 1, rows, true);
            let single = RankShard::take(&ShardLayout::split(rows, 1, global, drop_last), &perm, 0);
            let shards: Vec<RankShard> = (0..world).map(|r| RankShard::take(&l, &perm, r)).collect();
            let b = global / world;
            for step in 0..l.per_rank / b {
                let mut ranks: Vec<(i64, u32)> = shards
                    .iter()
                    .flat_map(|s| (step * b..(step + 1) * b).map(|i| (s.indices[i], s.weights[i] as u32)))
                    .collect();
                let mut one: Vec<(i64, u32)> = (step * global..(step + 1) * global)
                    .map(|i| (single.indices[i], single.weights[i] as u32))
                    .collect();
                ranks.sort();
                one.sort();
                assert_eq!(ranks, one, "rows {rows} world {world} step {step}");
            }
            let counted: f32 = shards.iter().flat_map(|s| &s.weights).sum();
            assert_eq!(counted as usize, if drop_last { rows / global * global } else { rows });
        }
    }

    #[test]
    fn permutation_depends_on_epoch_not_world_size() {
        assert_eq!(permutation(1, 1, 50, true), permutation(1, 1, 50, true));
        assert_ne!(permutation(1, 1, 50, true), permutation(1, 2, 50, true));
        assert_eq!(permutation(1, 4, 5, false), vec![0, 1, 2, 3, 4]);
    }
}
