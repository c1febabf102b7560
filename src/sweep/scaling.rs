//! `[scaling]`: how each point's batch and learning rate follow its world size. A global batch
//! is split over the copies of the model (the mesh's data dimension), not over every rank: a
//! tensor group's ranks, and a pipeline's, all pass their copy's batch.
use serde::Deserialize;

use super::experiment::SCALING_LABEL;
use crate::config::{self, Override};

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

/// The overrides `[scaling]` adds to a point whose configuration (before scaling) is `c`.
pub(super) fn scale(s: Scaling, c: &config::Config) -> Result<Vec<Override>, String> {
    let (world, batch) = (c.run.world_size, c.train.batch_size);
    if world == 0 || batch == 0 {
        return Ok(vec![]); // Plan::new names these.
    }
    // The global batch is split over the copies of the model (the mesh's data dimension): the
    // ranks of a tensor group, or of a pipeline, all pass their copy's batch.
    let copies = crate::plan::mesh::Shape::of(c).data;
    let over = if copies == world {
        format!("{world} ranks")
    } else {
        format!("{copies} copies of the model (the mesh's data dimension of {world} ranks)")
    };
    let mut out = Vec::new();
    let per_copy = match s.batch {
        BatchScaling::PerRank => batch,
        BatchScaling::Global if batch % copies != 0 => {
            return Err(format!(
                "[scaling] batch = \"global\": the global batch train.batch_size = {batch} does not \
                 split evenly over {over}; use a multiple of {copies}"
            ))
        }
        BatchScaling::Global => {
            let per_copy = batch / copies;
            out.push(text_override("train.batch_size", per_copy.to_string()));
            per_copy
        }
    };
    if s.lr == LrScaling::Linear {
        let lr = c.train.lr * (per_copy * copies) as f64 / batch as f64;
        out.push(text_override("train.lr", format!("{lr:?}")));
    }
    Ok(out)
}

fn text_override(key: &str, value: String) -> Override {
    Override { label: SCALING_LABEL.into(), text: format!("{key}={value}") }
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

    #[test]
    fn a_global_batch_splits_over_the_copies_of_the_model_not_every_rank() {
        let s = Scaling { batch: BatchScaling::Global, lr: LrScaling::Linear };
        let mesh = |strategy, data, tensor, pipeline| {
            let mut c = config(4, 32, 0.05);
            c.wrap.strategy = strategy;
            c.wrap.mesh = config::schema::Mesh { data, tensor, pipeline, sequence_parallel: false };
            c
        };
        use config::schema::WrapStrategy::{Ddp, Fsdp, Pipeline};
        // Tensor 4: one copy, the whole batch on each of its ranks.
        assert_eq!(texts(scale(s, &mesh(Ddp, None, Some(4), None)).unwrap()), ["train.batch_size=32", "train.lr=0.05"]);
        // Data 2 × tensor 2, and 2 copies of a 2-stage pipeline: half each.
        assert_eq!(texts(scale(s, &mesh(Fsdp, None, Some(2), None)).unwrap())[0], "train.batch_size=16");
        assert_eq!(texts(scale(s, &mesh(Pipeline, Some(2), None, None)).unwrap())[0], "train.batch_size=16");
        // A pipeline of 2 stages × tensor 2: one copy.
        assert_eq!(texts(scale(s, &mesh(Pipeline, None, Some(2), Some(2))).unwrap())[0], "train.batch_size=32");
        let mut odd = mesh(Fsdp, None, Some(2), None);
        odd.train.batch_size = 3;
        let e = scale(s, &odd).unwrap_err();
        assert!(
            e.ends_with("does not split evenly over 2 copies of the model (the mesh's data dimension of 4 ranks); use a multiple of 2"),
            "{e}"
        );
    }
}
