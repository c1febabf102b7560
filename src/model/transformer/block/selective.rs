//! Selective activation checkpointing of a block (`wrap.activation_checkpointing.policy =
//! "selective"`), torchtitan's op-level policy: the block keeps the outputs of its matrix products
//! and of its attention, and recomputes in the backward pass only what lies between them and is
//! cheap: the two norms, the MLP's activation and the heads' merge (a copy).
//!
//! Each of the block's four products is one [`crate::dist::checkpoint_linear`]: it keeps the
//! value its segment starts from (the block's input, the attention's output, the first residual
//! sum, the MLP's first product), which the block holds anyway, and not the segment's output
//! (the product's input), which a plain block keeps for the product's weight gradient. The
//! products themselves are not run again: their gradients are computed as libtorch's backward of
//! a linear computes them, so losses and gradients are the bits of policy = "none". The attention
//! and the residual branches' dropout stay as they are (no segment draws random numbers).
use tch::Tensor;

use super::{activation, linear, merge_heads, norm, Affine, Block, Stage};
use crate::config::schema::Norm;

impl Stage {
    /// Block `block` on `h` in training, keeping only the products' and the attention's outputs
    /// (besides the block's input and first residual sum). Not under tensor parallelism, nor with
    /// LoRA's adapters (the plan refuses both with checkpointing).
    pub(super) fn selective_block(
        &self,
        block: &Block,
        h: &Tensor,
        rope: Option<&(Tensor, Tensor)>,
        train: bool,
    ) -> Tensor {
        let qkv = self.normed_product(h, &block.ln1, &block.qkv);
        let heads = self.attend(&qkv, rope, train);
        let merged = product(&heads, &[], &block.proj, |y: &Tensor| merge_heads(y));
        let h = h + self.dropout(&merged, train);
        let hidden = self.normed_product(&h, &block.ln2, &block.fc);
        let mlp = self.s.mlp;
        let out = product(&hidden, &[], &block.out, move |x: &Tensor| activation(mlp, x));
        &h + self.dropout(&out, train)
    }

    /// `linear(norm(x))`, keeping `x` and recomputing the norm where the norm is one autograd
    /// node (LayerNorm). An RMSNorm's output is kept as without checkpointing: libtorch composes
    /// it of element-wise ops (on the CPU), two of which read `x` (its square and its scaling),
    /// so with the residual stream's use `x`'s gradient is a sum of three, which autograd adds in
    /// the order they arrive, (residual + scaling) + square; a node returning the norm's two as
    /// one sum would add residual + (scaling + square): a few ulps off "none".
    fn normed_product(&self, x: &Tensor, ln: &Affine, affine: &Affine) -> Tensor {
        if self.s.norm == Norm::Rmsnorm {
            return linear(&self.norm(x, ln), affine);
        }
        let (w, b) = ln;
        let s = self.s.clone();
        let (nw, nb) = (w.shallow_clone(), b.as_ref().map(Tensor::shallow_clone));
        let params: Vec<Tensor> = std::iter::once(w).chain(b).map(Tensor::shallow_clone).collect();
        product(x, &params, affine, move |x: &Tensor| norm(&s, x, &nw, nb.as_ref()))
    }
}

/// `segment(source).linear(affine)`, the segment's output recomputed in the backward pass.
fn product<F>(source: &Tensor, params: &[Tensor], (w, b): &Affine, segment: F) -> Tensor
where
    F: Fn(&Tensor) -> Tensor + Send + 'static,
{
    // A forward pass returns no Result: a failure ends the rank, as a failed gather does.
    crate::dist::checkpoint_linear(source, params, w, b.as_ref(), segment)
        .unwrap_or_else(|e| crate::checked::fail(e.to_string()))
}
