//! The bytes each rank is predicted to send per optimizer step in its group of each mesh
//! dimension, from the model's shapes: what the trace's `sent_data_bytes`, `sent_tensor_bytes`
//! and `sent_pipeline_bytes` measure (`csrc/traffic.hpp`), counted the same way: the bytes of the
//! tensors a rank hands to a collective (an all-reduce's tensor, an all-gather's input, a
//! reduce-scatter's or an all-to-all's whole input) or sends to a peer. One short function per
//! parallelism; [`predict`] composes them over the mesh, rank by rank. The plan prints it under
//! the mesh and `plan.json` records it (`sent_per_step_predicted`), beside the trace's columns.
use std::ops::Range;

use serde::Serialize;

use super::memory::Shapes;
use super::Plan;
use crate::config::schema::{CheckpointPolicy, Config, Model, Norm, Precision, WrapStrategy};
use crate::model::Architecture;

/// Bytes of one float32 value: gradients, parameters and (in float32 training) activations
/// travel in float32; a pipeline's activations always do.
const F: f64 = 4.0;

/// Bytes one rank sends per optimizer step in its group of each mesh dimension.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Sent {
    pub data: f64,
    pub tensor: f64,
    pub pipeline: f64,
}

/// DDP's Reducer (and a pipeline's copies, and thread replicas): every trained gradient value
/// all-reduced once per optimizer step.
pub fn ddp(trained: f64) -> f64 {
    F * trained
}

/// FSDP over `data` ranks, per batch: each layer's shard all-gathered for its forward pass and,
/// under ZeRO-3, again for its backward pass, but the units the last layer reads (kept gathered
/// from its forward to its backward); and each trained layer's padded whole gradient handed to
/// the reduction. A LoRA run's frozen base has no reduction; its adapters, whole on every rank,
/// are all-reduced once per step.
pub fn fsdp(shapes: &Shapes, data: usize, zero3: bool, batches: f64) -> f64 {
    let layers = shapes.layers.len();
    let kept = |u: usize| shapes.reads.last().is_some_and(|r| r.contains(&u));
    let shards: f64 = (0..layers).map(|u| shapes.shard(u, data).0).sum();
    let again: f64 = (0..layers).filter(|&u| zero3 && !kept(u)).map(|u| shapes.shard(u, data).0).sum();
    let reduced: f64 = match shapes.frozen > 0.0 {
        true => 0.0,
        false => (0..layers).map(|u| shapes.shard(u, data).1).sum(),
    };
    F * (batches * (shards + again + reduced) + shapes.whole)
}

/// Tensor parallelism (Megatron), per step of `rows` rows through `pairs`, each a split pair's
/// (values per row entering its column-parallel layer, whether that input has a gradient,
/// values per row leaving its row-parallel layer): the leaving partial outputs all-reduced
/// forward, the entering input's gradient all-reduced backward.
pub fn tensor(pairs: &[(f64, bool, f64)], rows: f64) -> f64 {
    pairs.iter().map(|&(enter, grad, leave)| F * rows * (leave + if grad { enter } else { 0.0 })).sum()
}

/// Sequence parallelism over `t` tensor ranks, per step of `rows` windows, through `blocks`
/// blocks of `width` values per row (seq_len × d_model): each of a block's two pairs all-gathers
/// its input (this rank's part) and reduce-scatters its gradient (whole), reduce-scatters its
/// partial output (whole) and all-gathers that gradient (this rank's part); every use of a
/// replicated parameter (`replicated` values) has its gradient all-reduced in each of the step's
/// `batches` backward passes; the logits (`logits` values per row) are all-gathered for the loss.
pub fn sequence_parallel(
    blocks: f64,
    width: f64,
    t: f64,
    rows: f64,
    batches: f64,
    replicated: f64,
    logits: f64,
) -> f64 {
    F * (rows * (blocks * 4.0 * (width + width / t) + logits / t) + batches * replicated)
}

/// A pipeline stage, per step of `rows` rows: its output sent on (all but the last stage), its
/// input's gradient sent back (all but the first), `input` and `output` values per row.
pub fn pipeline(input: f64, output: f64, first: bool, last: bool, rows: f64) -> f64 {
    let forward = if last { 0.0 } else { output };
    let backward = if first { 0.0 } else { input };
    F * rows * (forward + backward)
}

/// Each rank's predicted bytes per step (the mean over an epoch's steps, as the trace's rows
/// hold it), or why the plan does not predict them.
pub fn predict(plan: &Plan) -> Result<Vec<Sent>, String> {
    let (c, mesh) = (&plan.config, plan.mesh());
    let arch = plan.model();
    let n = arch.layers().len();
    if matches!(c.wrap.model, Model::Torchscript(_)) {
        return Err("a TorchScript module's frozen parameters and buffers are broadcast each step".into());
    }
    if !arch.buffers(0..n).is_empty() && plan.world_size() > 1 {
        return Err("batch norm's running statistics are broadcast each step (not counted here)".into());
    }
    if mesh.tensor > 1 && c.train.precision != Precision::Fp32 {
        return Err("tensor parallelism's activations travel in the autocast dtype".into());
    }
    let steps = plan.optimizer_steps_per_epoch().max(1) as f64;
    // A copy's rows and batches per optimizer step, as an epoch's mean.
    let (rows, batches) = (plan.layout.per_rank as f64 / steps, plan.steps_per_epoch() as f64 / steps);
    let clipped = if c.train.clip_grad_norm.is_some() { F } else { 0.0 };
    let shapes = Shapes::of(arch.as_ref(), mesh.tensor);
    Ok((0..plan.world_size())
        .map(|rank| {
            let stage = plan.stages[rank].clone();
            // A pipeline runs a backward pass per micro-batch.
            let passes = match c.wrap.strategy {
                WrapStrategy::Pipeline => batches * c.wrap.pipeline.micro_batches as f64,
                _ => batches,
            };
            let tensor = tensor_bytes(c, mesh.tensor, arch.as_ref(), &plan.data.input, &stage, rows, passes);
            let mut sent = Sent { tensor, ..Sent::default() };
            let (data, t) = (mesh.data, mesh.tensor);
            match c.wrap.strategy {
                WrapStrategy::Pipeline => {
                    let (input, output) = plan.stage_shapes(&stage);
                    let values = |s: Vec<i64>| s.iter().product::<i64>() as f64;
                    let (first, last) = (stage.start == 0, stage.end == n);
                    sent.pipeline = pipeline(values(input), values(output), first, last, rows);
                    if data > 1 {
                        sent.data = ddp(trained(arch.as_ref(), stage, t));
                    }
                }
                // Clipping's norm is summed over every rank: the data group when it is all of them.
                WrapStrategy::Fsdp if data > 1 => {
                    sent.data = fsdp(&shapes, data, c.wrap.fsdp.reshard_after_forward, batches);
                    sent.data += if t == 1 { clipped } else { 0.0 };
                }
                WrapStrategy::Fsdp => {}
                // A replica's norm sums its tensor group's slices.
                _ => {
                    if data > 1 && c.wrap.strategy == WrapStrategy::Ddp {
                        sent.data = ddp(trained(arch.as_ref(), 0..n, t));
                    }
                    sent.tensor += if t > 1 { clipped } else { 0.0 };
                }
            }
            sent
        })
        .collect())
}

/// What one rank of `c`'s mesh (data copies of the model, each split over a tensor group) sends
/// per step in both dimensions, under DDP or FSDP over the data dimension: the sum
/// `wrap.strategy = "auto"` weighs mesh shapes by. `rows` and `batches`: a copy's per step.
pub fn split_copies(c: &Config, arch: &dyn Architecture, input: &[usize], rows: f64, batches: f64) -> f64 {
    let super::mesh::Shape { data, tensor: t, pipeline } = super::mesh::Shape::of(c);
    if c.wrap.strategy == WrapStrategy::Pipeline {
        return stages_of_copies(c, arch, input, pipeline, rows, batches);
    }
    let zero3 = (c.wrap.strategy == WrapStrategy::Fsdp).then_some(c.wrap.fsdp.reshard_after_forward);
    let n = arch.layers().len();
    let data_bytes = match (data > 1, zero3) {
        (false, _) => 0.0,
        (true, None) => ddp(trained(arch, 0..n, t)),
        (true, Some(zero3)) => fsdp(&Shapes::of(arch, t), data, zero3, batches),
    };
    data_bytes + tensor_bytes(c, t, arch, input, &(0..n), rows, batches)
}

/// What the busiest rank of a pipeline of `stages` stages (balanced by parameters) sends per
/// step: its activations and their gradients to its neighbours, its tensor group's traffic and,
/// with copies of the pipeline, its stage's gradients averaged over them.
fn stages_of_copies(
    c: &Config,
    arch: &dyn Architecture,
    input: &[usize],
    stages: usize,
    rows: f64,
    batches: f64,
) -> f64 {
    let super::mesh::Shape { data, tensor: t, .. } = super::mesh::Shape::of(c);
    let layers = arch.layers();
    let Some(stages) = crate::model::partition::balanced(&crate::model::layer_parameters(arch), stages) else {
        return 0.0;
    };
    let values = |v: &[usize]| v.iter().product::<usize>() as f64;
    stages
        .iter()
        .map(|r| {
            let entering = if r.start == 0 { values(input) } else { values(&layers[r.start - 1].output) };
            let (first, last) = (r.start == 0, r.end == layers.len());
            let copies = if data > 1 { ddp(trained(arch, r.clone(), t)) } else { 0.0 };
            pipeline(entering, values(&layers[r.end - 1].output), first, last, rows)
                + copies
                + tensor_bytes(c, t, arch, input, r, rows, batches)
        })
        .fold(0.0, f64::max)
}

/// Values of the trained parameters of layers `range` one of `t` tensor ranks holds.
fn trained(arch: &dyn Architecture, range: Range<usize>, t: usize) -> f64 {
    arch.parameters(range)
        .into_iter()
        .filter(|(name, _)| !arch.frozen(name))
        .map(|(name, s)| {
            let v = s.iter().product::<i64>() as f64;
            if t > 1 && arch.tensor_slice(&name, 0, t).is_some() {
                v / t as f64
            } else {
                v
            }
        })
        .sum()
}

/// What a rank holding layers `stage` sends in its tensor group per step of `rows` rows in
/// `batches` backward passes (a pipeline's micro-batches each run one).
fn tensor_bytes(
    c: &Config,
    t: usize,
    arch: &dyn Architecture,
    data_input: &[usize],
    stage: &Range<usize>,
    rows: f64,
    batches: f64,
) -> f64 {
    if t < 2 {
        return 0.0;
    }
    let layers = arch.layers();
    let values = |l: usize| layers[l].output.iter().product::<usize>() as f64;
    // A checkpointed block (a transformer's layer l, an MLP's hidden layer l: block l - 1) runs
    // its forward collectives again in the backward pass.
    let recomputed = |l: usize| l > 0 && c.wrap.activation_checkpointing.applies(l - 1);
    // The values per row entering layer l (the data's, or the layer before's output).
    let input = |l: usize| if l == 0 { data_input.iter().product::<usize>() as f64 } else { values(l - 1) };
    match &c.wrap.model {
        // Blocks are the layers between the embedding and the head; each is two split pairs
        // whose input is the residual stream (the embeddings have a gradient).
        Model::Transformer(m) => {
            let blocks = stage.clone().filter(|&l| l > 0 && l + 1 < layers.len()).count() as f64;
            let again = stage.clone().filter(|&l| l + 1 < layers.len() && recomputed(l)).count() as f64;
            let (width, sp, s) = (values(0), c.wrap.mesh.sequence_parallel, crate::model::transformer::Spec::of(m));
            let recomputation = F * rows * again * recomputed_per_row(c, &s, width, t as f64);
            if sp {
                // A tied head uses the token embedding a second time.
                let tied = if s.tied { (s.vocab * s.d) as f64 } else { 0.0 };
                let whole =
                    arch.parameters(stage.clone()).into_iter().filter(|(n, _)| arch.tensor_slice(n, 0, t).is_none());
                let replicated = whole.map(|(_, s)| s.iter().product::<i64>() as f64).sum::<f64>() + tied;
                // The last stage's logits (all of them without a pipeline).
                let logits = if stage.end == layers.len() { values(layers.len() - 1) } else { 0.0 };
                return sequence_parallel(blocks, width, t as f64, rows, batches, replicated, logits) + recomputation;
            }
            tensor(&vec![(width, true, width); 2 * blocks as usize], rows) + recomputation
        }
        // Layers 0, 2, ... are column-parallel where a row-parallel partner follows; the first
        // layer's input (the data, or a stage's received activations) has a gradient past stage 0.
        Model::Mlp(_) => {
            let columns = || stage.clone().filter(|&l| l % 2 == 0 && l + 1 < stage.end);
            let pairs: Vec<(f64, bool, f64)> = columns().map(|l| (input(l), l > 0, values(l + 1))).collect();
            // A recomputed row-parallel layer's partial outputs all-reduced again (a
            // column-parallel layer's input is copied into the group: nothing sent forward).
            let again: f64 = columns().map(|l| l + 1).filter(|&l| recomputed(l)).map(values).sum();
            tensor(&pairs, rows) + F * rows * again
        }
        _ => 0.0,
    }
}

/// Values per row a checkpointed transformer block of `width` values per row sends again over
/// `t` tensor ranks in its recomputation: under full checkpointing its forward (each pair's
/// partial outputs all-reduced, or under sequence parallelism each pair's all-gather and
/// reduce-scatter); under selective, with sequence parallelism and LayerNorm, each pair's
/// all-gather (what a product's segment recomputes after the norm; an RMSNorm's output is kept).
fn recomputed_per_row(c: &Config, s: &crate::model::transformer::Spec, width: f64, t: f64) -> f64 {
    let sp = c.wrap.mesh.sequence_parallel;
    match c.wrap.activation_checkpointing.policy {
        CheckpointPolicy::Full if sp => 2.0 * (width / t + width),
        CheckpointPolicy::Full => 2.0 * width,
        CheckpointPolicy::Selective if sp && s.norm == Norm::Layernorm => 2.0 * width / t,
        _ => 0.0,
    }
}

/// Under the mesh: each rank's predicted bytes per step, ranks that send alike together.
pub(super) fn note(plan: &Plan) -> String {
    let head = "    bytes sent per step per rank, predicted (the trace measures them: sent_data_bytes, \
                sent_tensor_bytes, sent_pipeline_bytes)";
    let sent = match predict(plan) {
        Ok(sent) => sent,
        Err(why) => return format!("{head}: not predicted, {why}\n"),
    };
    let mut alike: Vec<(Sent, Vec<usize>)> = Vec::new();
    for (rank, s) in sent.into_iter().enumerate() {
        match alike.iter_mut().find(|(t, _)| *t == s) {
            Some((_, ranks)) => ranks.push(rank),
            None => alike.push((s, vec![rank])),
        }
    }
    let mut note = format!("{head}:\n");
    for (s, ranks) in alike {
        let ranks: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        let label = if ranks.len() == 1 { "rank" } else { "ranks" };
        note += &format!(
            "      {label} {}: data {}, tensor {}, pipeline {}\n",
            ranks.join(", "),
            bytes(s.data),
            bytes(s.tensor),
            bytes(s.pipeline)
        );
    }
    note
}

/// "0 B", "1.5 KiB", "12.0 MiB".
fn bytes(b: f64) -> String {
    match b {
        b if b < 1024.0 => format!("{b:.0} B"),
        b if b < 1048576.0 => format!("{:.1} KiB", b / 1024.0),
        b => format!("{:.1} MiB", b / 1048576.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsdp_gathers_twice_but_the_last_layer_and_reduces_the_padded_whole() {
        // Three layers of 5 × 3, 4 × 4 and 2 × 2 values over 2 ranks: 5 rows pad to 6.
        let shapes = Shapes {
            layers: vec![vec![(5, 3)], vec![(4, 4)], vec![(2, 2)]],
            reads: vec![vec![0], vec![1], vec![2]],
            frozen: 0.0,
            whole: 0.0,
        };
        let (shards, padded) = (9.0 + 8.0 + 2.0, 18.0 + 16.0 + 4.0);
        assert_eq!(fsdp(&shapes, 2, true, 1.0), 4.0 * (shards + (shards - 2.0) + padded));
        // ZeRO-2 keeps every layer gathered; two batches a step gather and reduce twice.
        assert_eq!(fsdp(&shapes, 2, false, 2.0), 4.0 * 2.0 * (shards + padded));
        // A tied head reads layer 0 last: it is kept gathered too.
        let tied = Shapes { reads: vec![vec![0], vec![1], vec![2, 0]], ..shapes };
        assert_eq!(fsdp(&tied, 2, true, 1.0), 4.0 * (shards + 8.0 + padded));
    }

    #[test]
    fn a_split_pair_all_reduces_its_output_and_its_input_s_gradient() {
        // An MLP's first pair: the data has no gradient, so only the output is summed.
        assert_eq!(tensor(&[(10.0, false, 64.0)], 8.0), 4.0 * 8.0 * 64.0);
        assert_eq!(tensor(&[(10.0, true, 64.0); 2], 8.0), 2.0 * 4.0 * 8.0 * 74.0);
        // Sequence parallelism: the same 4 collectives per pair, plus the parts gathered.
        let (width, rows) = (128.0, 16.0);
        let tp = tensor(&[(width, true, width); 2], rows);
        assert_eq!(sequence_parallel(1.0, width, 2.0, rows, 1.0, 0.0, 0.0), tp + 4.0 * rows * 4.0 * width / 2.0);
    }

    #[test]
    fn a_pipeline_stage_sends_on_and_back_except_at_the_ends() {
        assert_eq!(pipeline(10.0, 16.0, true, false, 8.0), 4.0 * 8.0 * 16.0);
        assert_eq!(pipeline(16.0, 4.0, false, true, 8.0), 4.0 * 8.0 * 16.0);
        assert_eq!(pipeline(16.0, 16.0, false, false, 8.0), 4.0 * 8.0 * 32.0);
    }
}
