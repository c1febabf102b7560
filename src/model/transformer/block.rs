//! The layers one process holds of a transformer (the whole model, or a pipeline stage's
//! contiguous part of it), their initial weights and their forward pass.
use std::ops::Range;

use tch::nn::{self, ModuleT};
use tch::{Kind, Tensor};

use super::lora::{Adapters, BlockAdapters, Site};
use std::sync::Arc;

use super::Spec;
use crate::config::schema::{ActivationCheckpointing, CheckpointPolicy, FeedForward, Norm, Positions};
use crate::model::tensor_group::TensorGroup;
use crate::model::TensorSlice;
use crate::rng::Rng;

mod selective;

/// Separates the layers' streams from other uses of the run's seed.
const LAYER_STREAM: u64 = 0x7F0A_0000;

/// A weight and its bias (absent without biases).
type Affine = (Tensor, Option<Tensor>);

#[derive(Debug)]
struct Block {
    ln1: Affine,
    qkv: Affine,
    proj: Affine,
    ln2: Affine,
    fc: Affine,
    out: Affine,
    /// LoRA's adapters on its linears (`wrap.lora`; none without).
    adapters: BlockAdapters,
}

impl Block {
    fn affines(&self) -> [&Affine; 6] {
        [&self.ln1, &self.qkv, &self.proj, &self.ln2, &self.fc, &self.out]
    }

    /// Its parameters, in module order.
    fn parameters(&self) -> Vec<Tensor> {
        let each = |(w, b): &Affine| [Some(w.shallow_clone()), b.as_ref().map(Tensor::shallow_clone)];
        self.affines().into_iter().flat_map(each).flatten().collect()
    }

    /// The same parameters under another handle (what a checkpointed block's recomputation owns;
    /// the plan refuses checkpointing with LoRA's adapters).
    fn shallow_clone(&self) -> Block {
        let each = |(w, b): &Affine| (w.shallow_clone(), b.as_ref().map(Tensor::shallow_clone));
        let [ln1, qkv, proj, ln2, fc, out] = self.affines().map(each);
        Block { ln1, qkv, proj, ln2, fc, out, adapters: BlockAdapters::default() }
    }
}

#[derive(Debug)]
struct Head {
    ln: Affine,
    /// [vocab, d_model]: its own, or the token embedding.
    weight: Tensor,
}

#[derive(Debug)]
pub struct Stage {
    /// The token embedding, and the position table with learned positions.
    embed: Option<(Tensor, Option<Tensor>)>,
    blocks: Vec<Block>,
    head: Option<Head>,
    s: Spec,
    /// Under tensor parallelism, the group the blocks' heads and hidden units are split across:
    /// this rank holds 1 / its size of each block's `qkv`, `proj`, `fc` and `out`.
    tensor: Option<Arc<TensorGroup>>,
    /// The model's index of the first block here (a pipeline stage or an FSDP layer holds a part).
    first_block: usize,
    /// Which blocks recompute their activations in the backward pass.
    checkpointing: ActivationCheckpointing,
}

/// What a tensor rank holds of a parameter, by its name in the whole model (`None`: whole).
pub type Slicer<'s> = &'s dyn Fn(&str, usize, usize) -> Option<TensorSlice>;

impl Stage {
    /// Layers `range` of the model `s`, under `p`, each drawn from its own stream of (`seed`,
    /// layer) in a fixed order; under `tensor`, each parameter drawn whole and this rank's slice
    /// of it (`slice`) kept, so the tensor ranks together hold the one-process model; each block
    /// with `lora`'s adapters (refused on the plan under tensor parallelism).
    pub fn build(
        s: &Spec,
        p: &nn::Path,
        range: Range<usize>,
        seed: u64,
        tensor: Option<Arc<TensorGroup>>,
        slice: Slicer,
        lora: Option<&Adapters>,
    ) -> Stage {
        let at = tensor.as_ref().map(|g| (g.rank(), g.size()));
        let cut = |name: &str| at.and_then(|(k, n)| slice(name, k, n));
        let (first_block, checkpointing) = (range.start.max(1) - 1, ActivationCheckpointing::default());
        let mut stage =
            Stage { embed: None, blocks: Vec::new(), head: None, s: s.clone(), tensor, first_block, checkpointing };
        // Residual projections: GPT-2's scaled initialisation.
        let residual_std = 0.02 / ((2 * s.layers) as f64).sqrt();
        let gated = if s.mlp == FeedForward::Swiglu { 2 } else { 1 };
        for layer in range {
            let rng = Rng::new(seed, LAYER_STREAM + layer as u64);
            let mut init = Init { rng, bias: s.bias, cut: &cut };
            if layer == 0 {
                let tok = (p / "tok").var_copy("weight", &init.normal(&[s.vocab, s.d], 0.02));
                let pos = (s.positions == Positions::Learned)
                    .then(|| (p / "pos").var_copy("weight", &init.normal(&[s.max_positions, s.d], 0.02)));
                stage.embed = Some((tok, pos));
            } else if layer == s.layers + 1 {
                let ln = init.norm(&(p / "ln_f"), s);
                let weight = if s.tied {
                    // The embedding built in this stage, or built before into the same variables
                    // (sharding builds each layer on its own); the plan refuses a pipeline whose
                    // head's stage lacks it.
                    match &stage.embed {
                        Some((tok, _)) => tok.shallow_clone(),
                        None => (p / "tok").get("weight").expect("a tied head is built after the embedding"),
                    }
                } else {
                    (p / "head").var_copy("weight", &init.normal(&[s.vocab, s.d], 0.02))
                };
                stage.head = Some(Head { ln, weight });
            } else {
                let name = format!("blocks.{}", layer - 1);
                let b = p / "blocks" / (layer - 1).to_string();
                let q = s.heads * s.head_dim;
                let linear = |init: &mut Init, part: &str, inputs, outputs, std| {
                    init.linear(&(&b / part), &format!("{name}.{part}"), inputs, outputs, std)
                };
                stage.blocks.push(Block {
                    ln1: init.norm(&(&b / "ln1"), s),
                    qkv: linear(&mut init, "qkv", s.d, s.qkv_rows(), 0.02),
                    proj: linear(&mut init, "proj", q, s.d, residual_std),
                    ln2: init.norm(&(&b / "ln2"), s),
                    fc: linear(&mut init, "fc", s.d, gated * s.hidden, 0.02),
                    out: linear(&mut init, "out", s.hidden, s.d, residual_std),
                    adapters: BlockAdapters::build(&b, lora, seed, layer),
                });
            }
        }
        stage
    }

    /// The stage with its blocks checkpointed as `checkpointing` says.
    pub fn with_checkpointing(self, checkpointing: ActivationCheckpointing) -> Stage {
        Stage { checkpointing, ..self }
    }

    /// Block `i` of this stage on `h`; under checkpointing, computed without keeping its
    /// activations, and again in the backward pass (crate::dist::checkpoint: the same bits).
    fn block(&self, i: usize, h: &Tensor, rope: Option<&(Tensor, Tensor)>, train: bool) -> Tensor {
        let block = &self.blocks[i];
        if !(train && self.checkpointing.applies(self.first_block + i)) {
            return self.block_forward(block, h, rope, train);
        }
        if self.checkpointing.policy == CheckpointPolicy::Selective {
            return self.selective_block(block, h, rope, train);
        }
        // The recomputation owns its block's parameters, the model's shape, the positions and,
        // under tensor parallelism, the group whose collectives it runs again.
        let one = Stage {
            embed: None,
            blocks: vec![block.shallow_clone()],
            head: None,
            s: self.s.clone(),
            tensor: self.tensor.clone(),
            first_block: 0,
            checkpointing: ActivationCheckpointing::default(),
        };
        let rope = rope.map(|(cos, sin)| (cos.shallow_clone(), sin.shallow_clone()));
        let recompute = move |x: &Tensor| one.block_forward(&one.blocks[0], x, rope.as_ref(), train);
        // A forward pass returns no Result: a failure ends the rank, as a failed gather does.
        crate::dist::checkpoint(h, &block.parameters(), recompute)
            .unwrap_or_else(|e| crate::checked::fail(e.to_string()))
    }

    /// A pre-norm block: attention, then the MLP, each added to the residual stream.
    fn block_forward(&self, block: &Block, h: &Tensor, rope: Option<&(Tensor, Tensor)>, train: bool) -> Tensor {
        let h = h + self.dropout(&self.attention(block, &self.norm(h, &block.ln1), rope, train), train);
        &h + self.dropout(&self.mlp(block, &self.norm(&h, &block.ln2), train), train)
    }

    fn norm(&self, x: &Tensor, (w, b): &Affine) -> Tensor {
        let (w, b) = (self.replicated(w), b.as_ref().map(|b| self.replicated(b)));
        norm(&self.s, x, &w, b.as_ref())
    }

    /// Under sequence parallelism, the tensor group the activations between the split layers are
    /// split across along the sequence.
    fn sequence(&self) -> Option<&TensorGroup> {
        self.tensor.as_deref().filter(|g| g.sequence_parallel())
    }

    /// A replicated parameter (a norm's, the embeddings, the head, a row-parallel bias) as this
    /// rank's part of the sequence uses it: under sequence parallelism, its gradient summed over
    /// the tensor group.
    fn replicated(&self, w: &Tensor) -> Tensor {
        match self.sequence() {
            Some(g) => g.replicated(w),
            None => w.shallow_clone(),
        }
    }

    /// Dropout of an activation between the split layers: under sequence parallelism, of this
    /// rank's part of the sequence, with its part of the mask one process draws.
    fn dropout(&self, x: &Tensor, train: bool) -> Tensor {
        match self.sequence() {
            Some(g) => g.dropout(x, self.s.dropout, 1, train),
            None => x.dropout(self.s.dropout, train),
        }
    }

    /// cos and sin of each position's angles, [T, head_dim], in the rotate-half layout (each
    /// frequency twice: for the first and the second half of a head's values), as Hugging Face's
    /// Llama computes them (float32).
    fn rope_tables(&self, t: i64, device: tch::Device) -> (Tensor, Tensor) {
        let hd = self.s.head_dim as i64;
        let opts = (Kind::Float, device);
        let exponents = Tensor::arange_start_step(0, hd, 2, (Kind::Int64, device)).to_kind(Kind::Float) / hd as f64;
        let inv_freq = Tensor::full([1], self.s.rope_theta, opts).pow(&exponents).reciprocal();
        let freqs = Tensor::arange(t, opts).unsqueeze(1) * inv_freq.unsqueeze(0);
        let angles = Tensor::cat(&[&freqs, &freqs], -1);
        (angles.cos(), angles.sin())
    }

    /// How many ranks split each block (1 without tensor parallelism).
    fn parts(&self) -> i64 {
        self.tensor.as_ref().map_or(1, |g| g.size() as i64)
    }

    /// `x` as the input of a column-parallel layer.
    fn enter(&self, x: &Tensor) -> Tensor {
        match &self.tensor {
            Some(g) => g.enter(x),
            None => x.shallow_clone(),
        }
    }

    /// A row-parallel layer: this rank's columns of `w` on its part of the input, summed over the
    /// tensor ranks, and the bias added once.
    fn leave(&self, x: &Tensor, (w, b): &Affine) -> Tensor {
        let Some(g) = &self.tensor else { return x.linear(w, b.as_ref()) };
        let sum = g.leave(&x.linear(w, None::<Tensor>));
        match b {
            Some(b) => sum + self.replicated(b),
            None => sum,
        }
    }

    fn attention(&self, block: &Block, x: &Tensor, rope: Option<&(Tensor, Tensor)>, train: bool) -> Tensor {
        // Under sequence parallelism, the whole sequence from the ranks' parts.
        let x = self.enter(x);
        let qkv = block.adapters.apply(Site::Qkv, &x, linear(&x, &block.qkv), train);
        let y = merge_heads(&self.attend(&qkv, rope, train));
        block.adapters.apply(Site::Proj, &y, self.leave(&y, &block.proj), train)
    }

    /// The attention's heads [B, heads, T, head_dim] from the product of the queries, keys and
    /// values [B, T, ...].
    fn attend(&self, qkv: &Tensor, rope: Option<&(Tensor, Tensor)>, train: bool) -> Tensor {
        let s = &self.s;
        let n = self.parts();
        let (hd, heads, kv) = (s.head_dim as i64, s.heads as i64 / n, s.kv_heads as i64 / n);
        let (b, t) = (qkv.size()[0], qkv.size()[1]);
        let qkv = qkv.split_with_sizes([heads * hd, kv * hd, kv * hd], -1);
        let split = |h: &Tensor, n: i64| h.view([b, t, n, hd]).transpose(1, 2);
        let (mut q, mut k, mut v) = (split(&qkv[0], heads), split(&qkv[1], kv), split(&qkv[2], kv));
        if let Some((cos, sin)) = rope {
            let (cos, sin) = (cos.to_kind(q.kind()), sin.to_kind(q.kind()));
            q = rotate(&q, &cos, &sin);
            k = rotate(&k, &cos, &sin);
        }
        if kv < heads {
            // Each key and value head serves heads / kv consecutive query heads.
            let repeat =
                |h: &Tensor| h.unsqueeze(2).expand([b, kv, heads / kv, t, hd], false).reshape([b, heads, t, hd]);
            (k, v) = (repeat(&k), repeat(&v));
        }
        let p = if train { s.dropout } else { 0.0 };
        // A packed batch: each example attends within itself (the block-diagonal causal mask).
        super::packed::with(|packed| match (&self.tensor, packed) {
            // libtorch's attention draws its mask for this rank's heads alone; one process
            // draws it for all of them.
            (Some(g), packed) if p > 0.0 => {
                let scores = q.matmul(&k.transpose(-2, -1)) / (hd as f64).sqrt();
                let allowed = match packed {
                    Some(pk) => pk.mask.shallow_clone(),
                    None => Tensor::ones([t, t], (Kind::Bool, q.device())).tril(0),
                };
                let weights = scores.masked_fill(&allowed.logical_not(), f64::NEG_INFINITY).softmax(-1, scores.kind());
                g.dropout(&weights, p, 1, train).matmul(&v)
            }
            (_, Some(pk)) => Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&pk.mask), p, false, None, false),
            (_, None) => Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, p, true, None, false),
        })
    }

    fn mlp(&self, block: &Block, x: &Tensor, train: bool) -> Tensor {
        let x = self.enter(x);
        let h = activation(self.s.mlp, &block.adapters.apply(Site::Fc, &x, linear(&x, &block.fc), train));
        block.adapters.apply(Site::Out, &h, self.leave(&h, &block.out), train)
    }
}

/// `x` [B, heads, T, head_dim] rotated by its positions' angles: x cos + rotate_half(x) sin, with
/// rotate_half(x) = (-x₂, x₁) for x's halves x₁, x₂.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let halves = x.chunk(2, -1);
    let rotated = Tensor::cat(&[-&halves[1], halves[0].shallow_clone()], -1);
    x * cos + rotated * sin
}

/// A norm of `s`'s kind over the model's width.
fn norm(s: &Spec, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let d = [s.d as i64];
    match s.norm {
        Norm::Layernorm => x.layer_norm(d.as_slice(), Some(w), b, s.eps, true),
        Norm::Rmsnorm => x.rms_norm(d.as_slice(), Some(w), s.eps),
    }
}

/// The MLP's activation of its first product.
fn activation(mlp: FeedForward, h: &Tensor) -> Tensor {
    match mlp {
        FeedForward::Gelu => h.gelu("none"),
        FeedForward::GeluTanh => h.gelu("tanh"),
        FeedForward::Swiglu => {
            let gate_up = h.chunk(2, -1);
            gate_up[0].silu() * &gate_up[1]
        }
    }
}

/// The attention's heads [B, heads, T, head_dim] as the projection reads them: [B, T, heads × head_dim].
fn merge_heads(y: &Tensor) -> Tensor {
    let (b, heads, t, hd) = y.size4().expect("the attention's heads are [B, heads, T, head_dim]");
    y.transpose(1, 2).contiguous().view([b, t, heads * hd])
}

fn linear(x: &Tensor, (w, b): &Affine) -> Tensor {
    x.linear(w, b.as_ref())
}

impl ModuleT for Stage {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        // The whole sequence's length: under sequence parallelism, a block's input is this rank's part.
        let parts = if self.embed.is_none() && self.sequence().is_some() { self.parts() } else { 1 };
        let t = x.size()[1] * parts;
        let mut h = match &self.embed {
            Some((tok, pos)) => {
                let (ids, packed) = super::packed::split(x, self.s.vocab);
                let e = Tensor::embedding(&self.replicated(tok), &ids, -1, false, false);
                let e = match (pos.as_ref().map(|p| self.replicated(p)), &packed) {
                    (Some(pos), None) => e + pos.narrow(0, 0, t),
                    (Some(pos), Some(pk)) => &e + pos.index_select(0, &pk.positions.view([-1])).view_as(&e),
                    (None, _) => e,
                };
                super::packed::set(packed);
                let e = match self.sequence() {
                    Some(g) => g.shard(&e),
                    None => e,
                };
                self.dropout(&e, train)
            }
            None => x.shallow_clone(),
        };
        let rope = (self.s.positions == Positions::Rope && !self.blocks.is_empty()).then(|| {
            let (cos, sin) = self.rope_tables(t, h.device());
            // A packed batch's positions restart with each example: [B, 1, T, head_dim].
            super::packed::with(|packed| match packed {
                Some(pk) => {
                    let at = |table: &Tensor| {
                        let rows = table.index_select(0, &pk.positions.view([-1]));
                        rows.view([pk.positions.size()[0], 1, t, -1])
                    };
                    (at(&cos), at(&sin))
                }
                None => (cos, sin),
            })
        });
        for i in 0..self.blocks.len() {
            h = self.block(i, &h, rope.as_ref(), train);
        }
        if let Some(head) = &self.head {
            h = self.norm(&h, &head.ln).linear(&self.replicated(&head.weight), None::<Tensor>);
            // Every rank computes the loss of the whole sequence.
            if let Some(g) = self.sequence() {
                h = g.unshard(&h);
            }
        }
        h
    }
}

/// Draws one layer's initial values from its stream, in a fixed order.
struct Init<'c> {
    rng: Rng,
    /// Whether linear layers (and LayerNorms) have biases (zeros).
    bias: bool,
    /// This tensor rank's slice of a parameter, by its name (`None`: whole).
    cut: &'c dyn Fn(&str) -> Option<TensorSlice>,
}

impl Init<'_> {
    fn normal(&mut self, shape: &[usize], std: f64) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (self.rng.normal() * std) as f32).collect();
        let shape: Vec<i64> = shape.iter().map(|&s| s as i64).collect();
        Tensor::from_slice(&v).view(shape.as_slice())
    }

    /// The linear layer `name` (its name in the whole model), drawn whole; this rank's slice kept.
    fn linear(&mut self, p: &nn::Path, name: &str, inputs: usize, outputs: usize, std: f64) -> Affine {
        let cut = self.cut;
        let keep = |leaf: &str, whole: Tensor| match cut(&format!("{name}.{leaf}")) {
            Some(slice) => slice.cut(&whole),
            None => whole,
        };
        let w = p.var_copy("weight", &keep("weight", self.normal(&[outputs, inputs], std)));
        let zeros = Tensor::zeros([outputs as i64], (Kind::Float, tch::Device::Cpu));
        (w, self.bias.then(|| p.var_copy("bias", &keep("bias", zeros))))
    }

    fn norm(&mut self, p: &nn::Path, s: &Spec) -> Affine {
        let w = p.var_copy("weight", &Tensor::ones([s.d as i64], (Kind::Float, tch::Device::Cpu)));
        (w, self.bias(p, s.d, s.norm_has_bias()))
    }

    fn bias(&self, p: &nn::Path, n: usize, present: bool) -> Option<Tensor> {
        let zeros = Tensor::zeros([n as i64], (Kind::Float, tch::Device::Cpu));
        present.then(|| p.var_copy("bias", &zeros))
    }
}
