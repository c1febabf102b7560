//! `run.cuda_graphs`: what a captured step cannot hold, refused on the plan. A CUDA graph replays
//! the kernels it recorded on the memory it recorded them on, with the values they were launched
//! with, so a step is replayable only where every step launches the same kernels on tensors of
//! the same shapes and reads nothing from the host in between.
use crate::config::schema::{CheckpointPolicy, Config, Device, Model, Sampling, WrapStrategy};
use crate::data::shard::ShardLayout;

/// Eager steps before the capture (torch's docs warm up with 3 on a side stream, as the runner does).
pub const WARMUP_STEPS: usize = 3;

/// Problems of `run.cuda_graphs = true` with the rest of `c` (nothing when it is off). `layout`:
/// how the training rows divide over the ranks, where known.
pub fn refusals(c: &Config, layout: Option<&ShardLayout>, bad: &mut impl FnMut(&str, String)) {
    if !c.run.cuda_graphs {
        return;
    }
    let off = "or leave run.cuda_graphs out";
    if c.run.device != Device::Cuda {
        bad(
            "run.cuda_graphs",
            format!("captures CUDA kernels, and this run is on the CPU; set run.device = \"cuda\", {off}"),
        );
    }
    let w = &c.wrap;
    let sharded = matches!(w.strategy, WrapStrategy::Fsdp | WrapStrategy::Pipeline);
    if sharded || (c.run.world_size > 1 && w.strategy != WrapStrategy::None) {
        bad(
            "run.cuda_graphs",
            format!(
                "the step of wrap.strategy = \"{}\" at {} rank(s) holds collectives (gradient buckets launched from \
                 autograd's hooks, gathers of sharded layers, the other stages' sends), which a graph of one rank's \
                 kernels cannot replay; run one rank with wrap.strategy = \"ddp\", or any number with \"none\", {off}",
                format!("{:?}", w.strategy).to_lowercase(),
                c.run.world_size
            ),
        );
    }
    if w.threads_per_replica.is_some() {
        bad(
            "wrap.threads_per_replica",
            format!("runs replicas on host threads, which a graph cannot replay; remove it, {off}"),
        );
    }
    let dropout = match &w.model {
        Model::Mlp(m) => m.dropout,
        Model::Cnn(m) => m.dropout,
        Model::Transformer(m) => m.dropout,
        Model::Torchscript(_) => 0.0,
    };
    let lora_dropout = w.lora.as_ref().map_or(0.0, |l| l.dropout);
    for (key, p) in [("wrap.model.dropout", dropout), ("wrap.lora.dropout", lora_dropout)] {
        if p > 0.0 {
            bad(
                key,
                format!(
                    "is {p}: each step draws its dropout masks from a seed the host sets, which a replay does not \
                     read; set it to 0 under run.cuda_graphs, {off}"
                ),
            );
        }
    }
    if w.activation_checkpointing.policy != CheckpointPolicy::None {
        bad(
            "wrap.activation_checkpointing.policy",
            format!("recomputes blocks from random states the host saves and restores, which a graph cannot replay; use \"none\", {off}"),
        );
    }
    if c.train.accumulate > 1 {
        bad(
            "train.accumulate",
            format!(
                "is {}: a step of several batches adds to the gradients the graph's first batch replaces; use 1, {off}",
                c.train.accumulate
            ),
        );
    }
    short_batches(c, layout, off, bad);
}

/// A replay runs on the batch shape it was captured with: an epoch's last batch must be whole.
fn short_batches(c: &Config, layout: Option<&ShardLayout>, off: &str, bad: &mut impl FnMut(&str, String)) {
    let Some(l) = layout else { return };
    let batch = l.split_batch.unwrap_or(c.train.batch_size);
    if c.load.sampling == Sampling::Epoch && batch > 0 && l.per_rank % batch != 0 {
        bad(
            "train.batch_size",
            format!(
                "{batch} does not divide a rank's {} rows of an epoch: its last batch of {} rows has another shape \
                 than the graph's; use a batch size that divides it, {off}",
                l.per_rank,
                l.per_rank % batch
            ),
        );
    }
}
