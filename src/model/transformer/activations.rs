//! What a transformer keeps for its backward pass, in bytes, as libtorch's kernels keep it: per
//! block under each activation-checkpointing policy, in float32 or under bf16 autocast (products
//! in bfloat16, the residual stream and the norms' statistics in float32), through
//! `scaled_dot_product_attention`'s fused kernel (no T × T matrix: its output and log-sum-exp)
//! or, with dropout, its plain path (the attention weights, their dropout mask and the dropped
//! weights: three T × T matrices per head), and the head's logits (B × T × vocab, often the
//! largest tensor). Checked against the measured peak in docs/memory.md. Under tensor
//! parallelism a rank keeps 1 / tensor of what the split layers compute (their heads and hidden
//! units); under sequence parallelism also 1 / tensor of what runs between them (the residual
//! stream, the norms' inputs, the residual dropout), though the gathered input of each
//! column-parallel layer is whole. With LoRA (`wrap.lora`: the plan refuses it with checkpointing
//! and tensor parallelism) the base is frozen, and a linear layer keeps its input only for an
//! adapter ([`lora_kept`]).
use super::lora::{Adapters, Site};
use super::Spec;
use crate::config::schema::{CheckpointPolicy, FeedForward, Norm, Positions};
use crate::model::Activations;

/// float32: the residual stream, the loss's log-softmax.
const F32: f64 = 4.0;

/// How a tensor rank divides a block's activations: `split`, the tensor degree (the heads and
/// hidden units); `sequence`, the share of the sequence between the split layers (1, or the
/// tensor degree under sequence parallelism).
#[derive(Debug, Clone, Copy)]
pub(super) struct Split {
    split: f64,
    sequence: f64,
}

impl Split {
    pub(super) const WHOLE: Split = Split { split: 1.0, sequence: 1.0 };

    pub(super) fn of(how: &Activations) -> Split {
        let n = how.tensor.max(1) as f64;
        Split { split: n, sequence: if how.sequence { n } else { 1.0 } }
    }
}

/// Bytes per sample (window) one block keeps from its forward to its backward on one tensor rank
/// (`p`), `a` bytes per value a product or the attention outputs (4, or 2 under bf16 autocast).
pub(super) fn block_kept(s: &Spec, a: f64, p: Split) -> f64 {
    let (d, t, heads) = (s.d as f64, s.seq_len as f64, s.heads as f64 / p.split);
    let (q, kv) = ((s.heads * s.head_dim) as f64 / p.split, (s.kv_heads * s.head_dim) as f64 / p.split);
    // The block's input and the first residual sum (what the two norms read: this rank's part
    // of the sequence under sequence parallelism), the norms' outputs as the products read them
    // (whole), and the product of the queries, keys and values.
    let mut per_token = 2.0 * F32 * d / p.sequence + 2.0 * a * d + a * (q + 2.0 * kv);
    if s.positions == Positions::Rope {
        // The rotated halves and the rotated queries and keys.
        per_token += 2.0 * a * (q + kv);
    }
    // Grouped keys and values repeated for their query heads.
    let keys = if s.kv_heads < s.heads {
        per_token += 2.0 * a * q;
        q
    } else {
        kv
    };
    let mut square = 0.0;
    if s.dropout > 0.0 {
        // The plain path: scaled copies of the queries and keys, softmax's output, the dropout
        // mask and the dropped weights (its output is not kept, its copy below is); then each
        // residual branch's dropout keeps its input and its mask.
        per_token += a * (q + keys) + 2.0 * 2.0 * a * d / p.sequence;
        square = 3.0 * a * heads * t * t;
    } else {
        // The fused kernel's output and log-sum-exp (float32).
        per_token += a * q + F32 * heads;
    }
    // The attention's output in [T, heads × head_dim] order, which the projection reads.
    per_token += a * q;
    t * per_token + mlp_kept(s, a) / p.split + square
}

/// Bytes per sample a block keeps under selective checkpointing: [`block_kept`] less the
/// products' inputs it recomputes (the two LayerNorms' outputs: an RMSNorm's stays kept, see
/// block/selective.rs; the MLP's activation; where the fused attention kernel keeps its own
/// output, the heads' merged copy of it).
pub(super) fn selective_kept(s: &Spec, a: f64, p: Split) -> f64 {
    let (d, t) = (s.d as f64, s.seq_len as f64);
    let q = (s.heads * s.head_dim) as f64 / p.split;
    let norms = if s.norm == Norm::Layernorm { 2.0 * a * d } else { 0.0 };
    let merged = if s.dropout > 0.0 { 0.0 } else { a * q };
    block_kept(s, a, p) - t * (norms + merged) - mlp_kept(s, a) / 2.0 / p.split
}

/// With LoRA, bytes per sample a block keeps besides [`block_kept`]'s, a signed sum. A frozen
/// weight has no gradient, so autograd keeps a linear layer's input only where an adapter reads
/// it: [`block_kept`] counts the input of every linear (the norms' outputs that the queries, keys
/// and values and the MLP read, the attention's merged output, the MLP's last hidden values), and
/// a linear without an adapter keeps none of it (the fused attention kernel keeps its own
/// output, which the projection reads). Each adapter keeps its rank-r product A x, which
/// B's gradient reads, and the input A's gradient reads: without dropout the linear's own input
/// (one copy, however many adapters read it), with dropout its own dropped copy and the mask.
pub(super) fn lora_kept(s: &Spec, l: &Adapters, a: f64) -> f64 {
    let dropout = l.dropout > 0.0;
    let own: f64 = l.targets.iter().map(|x| l.rank as f64 + if dropout { 2.0 * x.inputs as f64 } else { 0.0 }).sum();
    // The fused attention kernel keeps its output, and the projection's input is a view of it:
    // kept either way. The plain path's (with dropout) is a copy.
    let merged = if s.dropout > 0.0 { (s.heads * s.head_dim) as f64 } else { 0.0 };
    let inputs = [(Site::Qkv, s.d as f64), (Site::Proj, merged), (Site::Fc, s.d as f64), (Site::Out, s.hidden as f64)];
    // The inputs no adapter keeps as they are: those of linears without one, and with dropout all.
    let unkept: f64 =
        inputs.iter().filter(|(site, _)| dropout || l.targets.iter().all(|x| x.site != *site)).map(|(_, n)| n).sum();
    a * s.seq_len as f64 * (own - unkept)
}

/// With LoRA, bytes per sample the backward pass of one block holds besides: an adapter's
/// update is added in place to its rows of the linear's output, and autograd's backward of that
/// (CopySlices) copies the whole output's gradient. The widest adapted linear's output counts.
fn lora_backward(s: &Spec, l: &Adapters, a: f64) -> f64 {
    let gated = if s.mlp == FeedForward::Swiglu { 2 } else { 1 };
    let width = |site| match site {
        Site::Qkv => s.qkv_rows(),
        Site::Fc => gated * s.hidden,
        Site::Proj | Site::Out => s.d,
    };
    a * s.seq_len as f64 * l.targets.iter().map(|x| width(x.site)).max().unwrap_or(0) as f64
}

/// Bytes per sample the MLP of a block keeps: SwiGLU's gate and up product, the gate's SiLU and
/// their product; GELU's product and its GELU. Its backward pass holds gradients of that size.
fn mlp_kept(s: &Spec, a: f64) -> f64 {
    let factor = if s.mlp == FeedForward::Swiglu { 4.0 } else { 2.0 };
    a * factor * s.hidden as f64 * s.seq_len as f64
}

/// Bytes of activations a rank holds at its peak: a training step of `batch` windows through
/// the whole model, or a validation forward pass of `validation` windows at once, whichever is
/// more.
pub(super) fn peak_bytes(s: &Spec, lora: Option<&Adapters>, batch: usize, validation: usize, how: &Activations) -> f64 {
    let a = if how.bf16 { 2.0 } else { F32 };
    let (d, t, v) = (s.d as f64, s.seq_len as f64, s.vocab as f64);
    let p = Split::of(how);
    let kept = block_kept(s, a, p) + lora.map_or(0.0, |l| lora_kept(s, l, a));
    let checkpointed = (0..s.layers).filter(|&i| how.checkpointing.applies(i)).count() as f64;
    // A fully checkpointed block keeps only its input; a selective one its products' outputs.
    let (each, recomputed) = match how.checkpointing.policy {
        CheckpointPolicy::None => (kept, 0.0),
        CheckpointPolicy::Full => (F32 * t * d / p.sequence, block_kept(s, F32, p)),
        CheckpointPolicy::Selective => (selective_kept(s, a, p), mlp_kept(s, a) / 2.0 / p.split),
    };
    let blocks = checkpointed * each + (s.layers as f64 - checkpointed) * kept;
    let embedding = if s.dropout > 0.0 { 2.0 * F32 * t * d / p.sequence } else { 0.0 };
    // The logits (kept by the step, for its accuracy) and log-softmax's output (float32), and at
    // the start of the backward pass the gradients of both; the final norm's output, for the
    // head's weight gradient (none where LoRA freezes the head).
    // Under sequence parallelism each rank computes its part of the logits, then gathers them.
    let logits = a * t * v;
    let part = if how.sequence { logits / p.sequence } else { 0.0 };
    let norm = if lora.is_some() { 0.0 } else { a * t * d / p.sequence };
    let head = norm + part + logits + 3.0 * F32 * t * v;
    // A block's backward pass holds its MLP's gradients at once, and a checkpointed block's
    // recomputed values besides: under full checkpointing about their float32 size under bf16
    // too (the kernels' float32 gradients and buffers; measured: docs/memory.md); under
    // selective, the largest recomputed input of a product (the MLP's activation).
    let backward = mlp_kept(s, a) / p.split
        + if checkpointed > 0.0 { recomputed } else { 0.0 }
        + lora.map_or(0.0, |l| lora_backward(s, l, a));
    let train = batch as f64 * (embedding + blocks + head.max(logits + backward));
    // Without gradients, a block's largest values at a time, and the logits with log-softmax's.
    let gated = if s.mlp == FeedForward::Swiglu { 2.0 } else { 1.0 };
    let hidden = s.hidden as f64 * gated / p.split;
    let forward = validation as f64 * t * (2.0 * F32 * d + 2.0 * a * hidden + (a + 2.0 * F32) * v);
    train.max(forward)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::{ActivationCheckpointing, CheckpointPolicy, Transformer};

    fn spec(dropout: f64) -> Spec {
        let t =
            Transformer { vocab: 512, d_model: 128, heads: 4, layers: 6, seq_len: 2048, dropout, ..Default::default() };
        Spec::of(&t)
    }

    fn how(policy: CheckpointPolicy, every: usize, bf16: bool) -> Activations {
        Activations { checkpointing: ActivationCheckpointing { policy, every }, bf16, ..Default::default() }
    }

    #[test]
    fn checkpointing_bf16_and_the_attention_kernel_change_what_is_kept() {
        let s = spec(0.0);
        let none = peak_bytes(&s, None, 4, 4, &how(CheckpointPolicy::None, 1, false));
        let full = peak_bytes(&s, None, 4, 4, &how(CheckpointPolicy::Full, 1, false));
        let every2 = peak_bytes(&s, None, 4, 4, &how(CheckpointPolicy::Full, 2, false));
        assert!(full < every2 && every2 < none, "{full} {every2} {none}");
        // docs/memory.md's model at context 2048: measured 461 MiB without and 137 MiB with.
        let mib = |b: f64| b / 1048576.0;
        assert!((mib(none) - 461.0).abs() / 461.0 < 0.15, "{}", mib(none));
        assert!((mib(full) - 137.0).abs() / 137.0 < 0.2, "{}", mib(full));
        // bfloat16 products: less kept, though the residual stream stays float32.
        let bf16 = peak_bytes(&s, None, 4, 4, &how(CheckpointPolicy::None, 1, true));
        assert!(bf16 < 0.8 * none && bf16 > 0.5 * none, "{bf16} {none}");
        // With dropout the plain attention path keeps three T × T matrices per head.
        let square = 3.0 * 4.0 * 4.0 * 2048.0 * 2048.0;
        assert!(block_kept(&spec(0.1), 4.0, Split::WHOLE) - block_kept(&s, 4.0, Split::WHOLE) > square);
    }

    #[test]
    fn a_tensor_rank_keeps_its_share_and_sequence_parallelism_shards_what_runs_between() {
        let s = spec(0.1);
        let whole = peak_bytes(&s, None, 4, 4, &how(CheckpointPolicy::None, 1, false));
        let at = |tensor, sequence| {
            let tp = Activations { tensor, sequence, ..how(CheckpointPolicy::None, 1, false) };
            peak_bytes(&s, None, 4, 4, &tp)
        };
        let (tp, sp) = (at(2, false), at(2, true));
        // The attention's T × T matrices, its heads and the MLP's units are halved; the residual
        // stream and the norms' inputs stay whole until the sequence is split too.
        assert!(tp < 0.6 * whole && tp > 0.4 * whole, "{tp} {whole}");
        let (d, t) = (128.0, 2048.0);
        // Per block: the input and the residual sum (float32), and the two residual dropouts'
        // inputs and masks, halved; the embedding's dropout too; the logits' part kept besides.
        let halved = 6.0 * (2.0 * F32 * d + 2.0 * 2.0 * F32 * d) / 2.0 + 2.0 * F32 * d / 2.0 + F32 * d / 2.0;
        let part = F32 * 512.0 / 2.0;
        assert!((4.0 * t * (halved - part) - (tp - sp)).abs() < 1.0, "{} {}", tp - sp, 4.0 * t * (halved - part));
    }

    #[test]
    fn a_frozen_linear_keeps_no_input_and_an_adapter_keeps_its_own() {
        use crate::config::schema::{Family, Lora};
        let t = Transformer {
            family: Family::Llama,
            vocab: 512,
            d_model: 128,
            heads: 4,
            layers: 4,
            seq_len: 128,
            mlp_hidden: Some(1024),
            ..Default::default()
        };
        let s = Spec::of(&t);
        let lora = |targets: &[&str], dropout| {
            let l =
                Lora { rank: 8, dropout, targets: targets.iter().map(|t| t.to_string()).collect(), ..Lora::default() };
            super::super::lora::resolve(&s, &l).unwrap()
        };
        let none = how(CheckpointPolicy::None, 1, false);
        let full = peak_bytes(&s, None, 2, 0, &none);
        let at = |l: &Adapters| peak_bytes(&s, Some(l), 2, 0, &none);
        let (t, blocks, batch) = (128.0, 4.0, 2.0);
        // q and v: the input of the MLP's product and the MLP's last hidden values are not kept;
        // each adapter's 8 values of A x are; the attention's output is (the fused kernel's).
        // (The final norm's output, not kept either, is below the MLP's gradients that the
        // backward pass holds.)
        let qv = lora(&["q_proj", "v_proj"], 0.0);
        // Its backward pass copies the gradient of the queries', keys' and values' product.
        let fewer = F32 * t * (blocks * (128.0 + 1024.0 - 2.0 * 8.0) - 3.0 * 128.0);
        assert_eq!(full - at(&qv), batch * fewer);
        // Every linear adapted: every input kept, and 7 adapters' A x.
        let all = lora(&["all-linear"], 0.0);
        // And the widest adapted output's gradient copied: the MLP's gate and up product.
        assert_eq!(at(&all) - full, batch * F32 * t * (blocks * 7.0 * 8.0 + 2.0 * 1024.0));
        // With dropout on the adapters, no linear's input is kept, but each adapter's dropped input
        // and its mask.
        let dropped = lora(&["q_proj", "v_proj"], 0.1);
        let own = 2.0 * (8.0 + 2.0 * 128.0);
        let fewer = F32 * t * (blocks * (128.0 + 128.0 + 1024.0 - own) - 3.0 * 128.0);
        assert_eq!(full - at(&dropped), batch * fewer);
    }
}
