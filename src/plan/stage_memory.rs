//! A pipeline rank's activations: its stage's share of the model's, for the micro-batches its
//! schedule keeps in flight, and the activations that cross its boundaries. Without these every
//! stage was estimated to hold the whole model's activations: a stage of the embedding alone
//! measured 195 MiB against an estimate of 499 MiB. [`memory_of_ranks`] gives every rank's.
use std::ops::Range;

use crate::config::schema::{Config, Schedule, WrapStrategy};
use crate::data::shard::ShardLayout;
use crate::data::DataSpec;
use crate::model::Architecture;

/// Bytes of one float32 value: a pipeline's activations cross its boundaries in float32.
const F: f64 = 4.0;

/// The share of a training batch's activations a stage keeps at once: GPipe runs every
/// micro-batch forward before the first backward (all of them); 1F1B keeps at most
/// `stages - stage` micro-batches of `micro_batches`.
pub fn in_flight(c: &Config, stage: usize, stages: usize) -> f64 {
    let m = c.wrap.pipeline.micro_batches.max(1);
    match c.wrap.pipeline.schedule {
        Schedule::Gpipe => 1.0,
        Schedule::OneFOneB => stages.saturating_sub(stage).clamp(1, m) as f64 / m as f64,
    }
}

/// The share of the model's activations that layers `range` hold: their values per sample (each
/// layer's output and what it keeps inside for the backward pass) over every layer's.
pub fn share(arch: &dyn Architecture, range: &Range<usize>) -> f64 {
    let layers = arch.layers();
    let values = |l: &crate::model::Layer| (l.output.iter().product::<usize>() + l.held) as f64;
    let all: f64 = layers.iter().map(values).sum();
    let part: f64 = layers[range.clone()].iter().map(values).sum();
    if all > 0.0 {
        part / all
    } else {
        1.0
    }
}

/// Bytes at the stage's boundaries for a batch of `batch` rows in `micro_batches`: the inputs it
/// received from the stage before (kept for the backward pass, `held` of the batch at once) and
/// one micro-batch's gradient of its output arriving from the stage after.
pub fn boundary(arch: &dyn Architecture, range: &Range<usize>, batch: usize, micro_batches: usize, held: f64) -> f64 {
    let layers = arch.layers();
    let values = |l: usize| layers[l].output.iter().product::<usize>() as f64;
    let received = if range.start > 0 { held * batch as f64 * values(range.start - 1) } else { 0.0 };
    let last = range.end >= layers.len();
    let gradient = if last { 0.0 } else { (batch as f64 / micro_batches.max(1) as f64).ceil() * values(range.end - 1) };
    F * (received + gradient)
}

/// Of `stages` (the stage of every rank, as the plan holds them), each distinct stage once, in
/// order: a pipeline's stages without their copies and tensor ranks.
pub fn distinct(stages: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for s in stages {
        if !out.contains(s) {
            out.push(s.clone());
        }
    }
    out.sort_by_key(|s| s.start);
    out
}

/// What a rank needs: under a pipeline each stage's own state and activations, every rank's
/// (with the heaviest, checked against this machine); otherwise one estimate for every rank.
pub(super) fn memory_of_ranks(
    c: &Config,
    (d, l, arch): (&DataSpec, &ShardLayout, &dyn Architecture),
    planner: &super::memory::Planner,
    stages: &[Range<usize>],
    state: &super::memory::State,
    machine: super::Machine,
    bad: &mut impl FnMut(&str, String),
) -> (crate::limits::Estimate, Vec<crate::limits::Estimate>) {
    if c.wrap.strategy != WrapStrategy::Pipeline {
        return (super::strategy::memory_estimate(c, d, l, arch, (state.total(), None), machine, bad), Vec::new());
    }
    let distinct = distinct(stages);
    let estimate_of = |s: usize, machine, bad: &mut dyn FnMut(&str, String)| {
        let own =
            planner.state(super::memory::Layout::Pipeline, c.run.world_size, Some(std::slice::from_ref(&distinct[s])));
        let own = own.map_or(state.total(), |o| o.total());
        super::strategy::memory_estimate(c, d, l, arch, (own, Some((&distinct, s))), machine, &mut |k: &str, m| {
            bad(k, m)
        })
    };
    let by_stage: Vec<_> =
        (0..distinct.len()).map(|s| estimate_of(s, super::Machine::Another, &mut |_, _| {})).collect();
    let heaviest = (0..by_stage.len()).max_by(|&a, &b| by_stage[a].per_rank().total_cmp(&by_stage[b].per_rank()));
    let heaviest = estimate_of(heaviest.unwrap_or(0), machine, &mut |k: &str, m| bad(k, m));
    let stage_of = |r: &Range<usize>| distinct.iter().position(|s| s == r).unwrap_or(0);
    (heaviest, stages.iter().map(|r| by_stage[stage_of(r)]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_keeps_fewer_micro_batches_on_the_earlier_stages() {
        let mut c = Config::default();
        c.wrap.pipeline.micro_batches = 4;
        assert_eq!(in_flight(&c, 0, 2), 1.0);
        c.wrap.pipeline.schedule = Schedule::OneFOneB;
        assert_eq!((in_flight(&c, 0, 2), in_flight(&c, 1, 2)), (0.5, 0.25));
        assert_eq!(distinct(&[2..4, 0..2, 2..4, 0..2]), [0..2, 2..4]);
    }
}
