//! Which layers each rank holds: all of them, or a pipeline's stages (balanced by parameters or
//! given).
use std::collections::BTreeMap;
use std::ops::Range;

use crate::config::schema::*;

/// The layers of every rank, when the strategy's keys are valid.
pub fn of_ranks(
    c: &Config,
    sources: &BTreeMap<String, String>,
    layer_parameters: &[usize],
    bad: &mut impl FnMut(&str, String),
) -> Option<Vec<Range<usize>>> {
    let pipeline = c.wrap.strategy == WrapStrategy::Pipeline;
    if c.run.world_size > crate::limits::MAX_WORLD_SIZE {
        None
    } else if pipeline && matches!(c.wrap.model, Model::Torchscript(_)) {
        bad(
            "wrap.strategy",
            "a TorchScript module is one opaque graph to the runner: it cannot be cut into pipeline stages; use \"ddp\" \
             (or a built-in model kind, whose layers a pipeline can split)"
                .into(),
        );
        None
    } else if pipeline {
        pipeline_stages(c, sources, layer_parameters, bad)
    } else {
        // Compared with the defaults, not by source: a run's saved config.toml sets every key.
        let (p, default) = (&c.wrap.pipeline, Pipeline::default());
        for (key, set) in [
            ("wrap.pipeline.stages", p.stages != default.stages),
            ("wrap.pipeline.micro_batches", p.micro_batches != default.micro_batches),
            ("wrap.pipeline.schedule", p.schedule != default.schedule),
            ("wrap.pipeline.replicas", p.replicas != default.replicas),
        ] {
            if set {
                bad(key, "is only read by wrap.strategy = \"pipeline\"".into());
            }
        }
        Some(vec![0..layer_parameters.len(); c.run.world_size])
    }
}

/// The pipeline's checks; the layers of each rank, when they are valid.
fn pipeline_stages(
    c: &Config,
    sources: &BTreeMap<String, String>,
    layer_parameters: &[usize],
    bad: &mut impl FnMut(&str, String),
) -> Option<Vec<Range<usize>>> {
    let p = &c.wrap.pipeline;
    let meshed = c.wrap.mesh != Mesh::default();
    if !meshed && (p.replicas == 0 || !c.run.world_size.is_multiple_of(p.replicas)) {
        bad(
            "wrap.pipeline.replicas",
            format!(
                "{} copies of the pipeline do not split run.world_size = {} evenly; use a divisor of it",
                p.replicas, c.run.world_size
            ),
        );
        return None;
    }
    // The stages of one copy; the copies repeat them. A mesh whose product is off is mesh::check's.
    let mesh = super::mesh::Shape::of(c);
    if mesh.ranks() != c.run.world_size {
        return None;
    }
    let w = mesh.pipeline;
    pipeline_keys(c, bad);
    let layers = layer_parameters.len();
    if layers == 0 {
        return None;
    }
    let stages = match &p.stages {
        Some(stages) => explicit_stages(c, sources, stages, (layers, w), bad),
        None if w > layers => {
            bad(
                "run.world_size",
                format!(
                    "{w} ranks, but the model has {layers} layers ({} hidden + the output layer); a pipeline \
                     needs at least one layer per rank: use at most {layers} ranks, or more hidden layers",
                    layers - 1
                ),
            );
            None
        }
        None => crate::model::partition::balanced(layer_parameters, w),
    }?;
    Some((0..c.run.world_size).map(|r| stages[mesh.coords(r).pipeline].clone()).collect())
}

/// The pipeline's keys that do not depend on the model: the shard strategy, the micro-batches,
/// where validation runs.
fn pipeline_keys(c: &Config, bad: &mut impl FnMut(&str, String)) {
    let p = &c.wrap.pipeline;
    if c.shard.strategy == ShardStrategy::Batch {
        bad(
            "shard.strategy",
            "a pipeline holds one model, not replicas, so it has no batches to split: every rank walks \
             the same batches; use \"dataset\""
                .into(),
        );
    }
    if p.micro_batches == 0 {
        bad("wrap.pipeline.micro_batches", "must be at least 1".into());
    } else if p.micro_batches > c.train.batch_size && c.train.batch_size > 0 {
        bad(
            "wrap.pipeline.micro_batches",
            format!(
                "{} micro-batches of a batch of {} rows would leave some empty; use at most {}",
                p.micro_batches, c.train.batch_size, c.train.batch_size
            ),
        );
    }
    if c.validate.on == ValidateOn::Split {
        bad(
            "validate.on",
            "\"split\" shares the rows among replicas, but a pipeline is one model: its validation runs \
             through every rank already; use \"rank0\""
                .into(),
        );
    }
    if c.validate.on == ValidateOn::All {
        bad(
            "validate.on",
            "\"all\" validates every replica, but a pipeline is one model: its validation runs through \
             every rank; use \"rank0\""
                .into(),
        );
    }
}

/// `wrap.pipeline.stages` as given: its ranges over `layers` layers, one per rank of a copy (`w`).
fn explicit_stages(
    c: &Config,
    sources: &BTreeMap<String, String>,
    stages: &[Vec<usize>],
    (layers, w): (usize, usize),
    bad: &mut impl FnMut(&str, String),
) -> Option<Vec<Range<usize>>> {
    let (p, meshed) = (&c.wrap.pipeline, c.wrap.mesh != Mesh::default());
    let ranges = match crate::model::partition::explicit(stages, layers) {
        Ok(r) => r,
        Err(e) => {
            bad("wrap.pipeline.stages", e);
            return None;
        }
    };
    if ranges.len() != w {
        let from = sources.get("run.world_size").map(String::as_str).unwrap_or("default");
        let ranks = if meshed {
            format!("the mesh's pipeline dimension is {w} ([wrap.mesh])")
        } else if p.replicas == 1 {
            format!("run.world_size ({from}) is {w}")
        } else {
            format!("each of the {} copies has {w} ranks (run.world_size ({from}) / replicas)", p.replicas)
        };
        bad(
            "wrap.pipeline.stages",
            format!("lists {} stages but {ranks}; a pipeline has one stage per rank", ranges.len()),
        );
        return None;
    }
    Some(ranges)
}
