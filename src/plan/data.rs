//! The load stage's part of the plan: each source's module makes its [`DataSpec`] (one closed
//! enum, one module a source); here only the rules that hold across sources: which model kinds
//! read which data, token ids are never normalised, sizes within bounds, `validate.batches`.
use std::path::Path;

use crate::config::schema::*;
use crate::data::shard::ShardLayout;
use crate::data::{self, DataSpec, Task};

/// The data's spec, or `None` (reported through `bad`) where it cannot be known.
pub fn spec(c: &Config, base: &Path, bad: &mut impl FnMut(&str, String)) -> Option<DataSpec> {
    let mut d = match (c.load.source, &c.wrap.model) {
        // A language model: windows of token ids, from files or synthetic.
        (Source::Synthetic | Source::Tokens | Source::Text, Model::Transformer(t)) => {
            data::tokens::spec(c, t, base, bad)
        }
        (Source::Tokens | Source::Text, _) => {
            let name = if c.load.source == Source::Text { "text" } else { "tokens" };
            bad(
                "load.source",
                format!("\"{name}\" gives token ids for a language model: use wrap.model.kind = \"transformer\""),
            );
            None
        }
        (Source::Csv | Source::Parquet | Source::Tensors, Model::Transformer(_)) => {
            bad(
                "wrap.model.kind",
                "\"transformer\" is a language model over token ids: use load.source = \"tokens\", \"text\", \
                 \"instructions\" or \"synthetic\""
                    .into(),
            );
            None
        }
        (Source::Instructions, Model::Transformer(t)) => data::instructions::spec(c, t, base, bad),
        (Source::Instructions, _) => {
            bad(
                "load.source",
                "\"instructions\" fine-tunes a language model: use wrap.model.kind = \"transformer\"".into(),
            );
            None
        }
        (Source::Synthetic, _) => data::synthetic::spec(c, bad),
        (Source::Tensors, _) => data::tensors::spec(c, base, bad),
        (source @ (Source::Csv | Source::Parquet), _) => data::file::spec(c, source, base, bad),
    };
    if c.load.source != Source::Instructions {
        for (key, given) in [
            ("load.tokenizer", c.load.tokenizer.is_some()),
            ("load.too_long", c.load.too_long != TooLong::Error),
            ("load.packing", c.load.packing),
        ] {
            if given {
                bad(key, "is only read by source = \"instructions\"".into());
            }
        }
    }
    if d.as_ref().is_some_and(|d| d.task.is_language_model()) && c.normalize.method != NormalizeMethod::None {
        bad(
            "normalize.method",
            "a language model's inputs are token ids, which are never scaled: set it to \"none\"".into(),
        );
    }
    // Out-of-bounds sizes leave no data: nothing below computes a shape from them.
    if d.as_ref().is_some_and(|d| !crate::limits::sizes(c, d, bad)) || c.run.world_size > crate::limits::MAX_WORLD_SIZE
    {
        return None;
    }
    let d_ref = d.as_mut()?;
    if let Task::Classification { classes: classes @ 0..=1 } = d_ref.task {
        bad("load.classes", format!("must be at least 2 for classification, got {classes}"));
    }
    if d_ref.rows == 0 {
        bad("load.rows", "must be at least 1".into());
    }
    // The same first rows every validation (a token source draws its own windows).
    let own_validation = d_ref.tokens().is_some() || c.load.source == Source::Instructions;
    if let (Some(b), false) = (c.validate.batches, own_validation) {
        if let Some(why) = crate::data::batches_beyond(b, c.train.batch_size, d_ref.validation_rows, "rows") {
            bad("validate.batches", why);
        }
        d_ref.validation_rows = d_ref.validation_rows.min(b.saturating_mul(c.train.batch_size));
    }
    d
}

/// How the training rows divide across ranks (DistributedSampler, or each global batch split).
pub(super) fn shard_layout(c: &Config, d: &DataSpec, bad: &mut impl FnMut(&str, String)) -> Option<ShardLayout> {
    let (w, t) = (c.run.world_size, &c.train);
    if w == 0 {
        return None;
    }
    // The ranks of a pipeline and of a tensor group share one copy of the model: each copy (the
    // mesh's data dimension) walks its own shard.
    let replicas = super::mesh::Shape::of(c).data;
    let layout = match (c.shard.strategy, t.global_batch_size) {
        (ShardStrategy::Dataset, None) => ShardLayout::new(d.rows, replicas, c.shard.drop_last),
        (ShardStrategy::Dataset, Some(_)) => {
            bad(
                "train.global_batch_size",
                "is only used by shard.strategy = \"batch\"; use train.batch_size (per rank)".into(),
            );
            return None;
        }
        (ShardStrategy::Batch, None) => {
            bad("train.global_batch_size", "shard.strategy = \"batch\" needs the global batch size to split".into());
            return None;
        }
        (ShardStrategy::Batch, Some(g)) => {
            // Compared with the default, not by source: a run's saved config.toml sets every key.
            if t.batch_size != Train::default().batch_size {
                bad("train.batch_size", "is not used with shard.strategy = \"batch\": each rank takes global_batch_size / world_size; remove it".into());
            }
            if g == 0 || g % w != 0 {
                bad(
                    "train.global_batch_size",
                    format!("{g} does not split evenly over {w} ranks; use a multiple of {w}"),
                );
                return None;
            }
            if g > d.rows {
                bad("train.global_batch_size", format!("{g} is larger than the {} training rows", d.rows));
                return None;
            }
            return Some(ShardLayout::split(d.rows, w, g, c.shard.drop_last));
        }
    };
    if layout.per_rank == 0 {
        bad("run.world_size", format!("{} ranks leave no training row for some rank (rows: {})", w, layout.rows));
    } else if t.batch_size > layout.per_rank && !d.random_windows() {
        bad(
            "train.batch_size",
            format!(
                "{} per rank is larger than a rank's shard of {} rows ({} rows / {} ranks); use at most {}",
                t.batch_size, layout.per_rank, layout.rows, layout.world_size, layout.per_rank
            ),
        );
    }
    Some(layout)
}
