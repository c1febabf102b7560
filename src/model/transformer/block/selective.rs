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

use super::{activation, linear, merge_heads, Affine, Block, Stage};
use crate::config::schema::Norm;

impl Stage {
    /// Block `block` on `h` in training, keeping only the products' and the attention's outputs
    /// (besides the block's input and first residual sum). Under tensor parallelism each
    /// column-parallel product's segment ends with the copy (or, under sequence parallelism, the
    /// all-gather) into the group, run again with it; a row-parallel product's partial output is
    /// summed over the group after the node, its bias added once, as without checkpointing. Not
    /// with LoRA's adapters (the plan refuses them with checkpointing).
    pub(super) fn selective_block(
        &self,
        block: &Block,
        h: &Tensor,
        rope: Option<&(Tensor, Tensor)>,
        train: bool,
    ) -> Tensor {
        let qkv = self.normed_product(h, &block.ln1, &block.qkv);
        let heads = self.attend(&qkv, rope, train);
        let merged = self.row_product(&heads, &block.proj, |y: &Tensor| merge_heads(y));
        let h = h + self.dropout(&merged, train);
        let hidden = self.normed_product(&h, &block.ln2, &block.fc);
        let mlp = self.s.mlp;
        let out = self.row_product(&hidden, &block.out, move |x: &Tensor| activation(mlp, x));
        &h + self.dropout(&out, train)
    }

    /// `linear(enter(norm(x)))`, keeping `x` and recomputing the norm (and the group's copy)
    /// where the norm is one autograd node (LayerNorm). An RMSNorm's output is kept as without
    /// checkpointing: libtorch composes it of element-wise ops (on the CPU), two of which read `x`
    /// (its square and its scaling), so with the residual stream's use `x`'s gradient is a sum of
    /// three, which autograd adds in the order they arrive, (residual + scaling) + square; a node
    /// returning the norm's two as one sum would add residual + (scaling + square): a few ulps
    /// off "none".
    fn normed_product(&self, x: &Tensor, ln: &Affine, affine: &Affine) -> Tensor {
        if self.s.norm == Norm::Rmsnorm {
            return linear(&self.enter(&self.norm(x, ln)), affine);
        }
        let (w, b) = ln;
        let params: Vec<Tensor> = std::iter::once(w).chain(b).map(Tensor::shallow_clone).collect();
        // The segment owns its handles on the norm's parameters, the model's shape and the group.
        let one = Stage {
            embed: None,
            blocks: Vec::new(),
            head: None,
            s: self.s.clone(),
            tensor: self.tensor.clone(),
            first_block: 0,
            checkpointing: self.checkpointing,
        };
        let ln = (w.shallow_clone(), b.as_ref().map(Tensor::shallow_clone));
        product(x, &params, affine, move |x: &Tensor| one.enter(&one.norm(x, &ln)))
    }

    /// A row-parallel product `linear(segment(source))`: under tensor parallelism this rank's
    /// columns, summed over the group, and the bias added once.
    fn row_product<F>(&self, source: &Tensor, affine: &Affine, segment: F) -> Tensor
    where
        F: Fn(&Tensor) -> Tensor + Send + 'static,
    {
        let Some(g) = &self.tensor else { return product(source, &[], affine, segment) };
        let (w, b) = affine;
        let sum = g.leave(&product(source, &[], &(w.shallow_clone(), None), segment));
        match b {
            Some(b) => sum + self.replicated(b),
            None => sum,
        }
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
