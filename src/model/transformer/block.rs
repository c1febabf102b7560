//! The layers one process holds of a transformer (the whole model, or a pipeline stage's
//! contiguous part of it), their initial weights and their forward pass.
use std::ops::Range;

use tch::nn::{self, ModuleT};
use tch::{Kind, Tensor};

use super::lora::{Adapters, BlockAdapters, Site};
use super::Spec;
use crate::config::schema::{FeedForward, Norm, Positions};
use crate::rng::Rng;

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
}

impl Stage {
    /// Layers `range` of the model `s`, under `p`, each drawn from its own stream of (`seed`,
    /// layer) in a fixed order; each block with `lora`'s adapters.
    pub fn build(s: &Spec, p: &nn::Path, range: Range<usize>, seed: u64, lora: Option<&Adapters>) -> Stage {
        let mut stage = Stage { embed: None, blocks: Vec::new(), head: None, s: s.clone() };
        // Residual projections: GPT-2's scaled initialisation.
        let residual_std = 0.02 / ((2 * s.layers) as f64).sqrt();
        let gated = if s.mlp == FeedForward::Swiglu { 2 } else { 1 };
        for layer in range {
            let mut init = Init { rng: Rng::new(seed, LAYER_STREAM + layer as u64), bias: s.bias };
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
                let b = p / "blocks" / (layer - 1).to_string();
                let q = s.heads * s.head_dim;
                stage.blocks.push(Block {
                    ln1: init.norm(&(&b / "ln1"), s),
                    qkv: init.linear(&(&b / "qkv"), s.d, s.qkv_rows(), 0.02),
                    proj: init.linear(&(&b / "proj"), q, s.d, residual_std),
                    ln2: init.norm(&(&b / "ln2"), s),
                    fc: init.linear(&(&b / "fc"), s.d, gated * s.hidden, 0.02),
                    out: init.linear(&(&b / "out"), s.hidden, s.d, residual_std),
                    adapters: BlockAdapters::build(&b, lora, seed, layer),
                });
            }
        }
        stage
    }

    fn norm(&self, x: &Tensor, (w, b): &Affine) -> Tensor {
        let d = [self.s.d as i64];
        match self.s.norm {
            Norm::Layernorm => x.layer_norm(d.as_slice(), Some(w), b.as_ref(), self.s.eps, true),
            Norm::Rmsnorm => x.rms_norm(d.as_slice(), Some(w), self.s.eps),
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

    fn attention(&self, block: &Block, x: &Tensor, rope: Option<&(Tensor, Tensor)>, train: bool) -> Tensor {
        let s = &self.s;
        let (b, t) = (x.size()[0], x.size()[1]);
        let (hd, heads, kv) = (s.head_dim as i64, s.heads as i64, s.kv_heads as i64);
        let qkv = self.linear(block, Site::Qkv, x, train).split_with_sizes([heads * hd, kv * hd, kv * hd], -1);
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
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, p, true, None, false);
        self.linear(block, Site::Proj, &y.transpose(1, 2).contiguous().view([b, t, heads * hd]), train)
    }

    /// The block's linear `site` on `x`, with its LoRA adapters' updates.
    fn linear(&self, block: &Block, site: Site, x: &Tensor, train: bool) -> Tensor {
        let weights = match site {
            Site::Qkv => &block.qkv,
            Site::Proj => &block.proj,
            Site::Fc => &block.fc,
            Site::Out => &block.out,
        };
        block.adapters.apply(site, x, linear(x, weights), train)
    }

    fn mlp(&self, block: &Block, x: &Tensor, train: bool) -> Tensor {
        let h = self.linear(block, Site::Fc, x, train);
        let h = match self.s.mlp {
            FeedForward::Gelu => h.gelu("none"),
            FeedForward::GeluTanh => h.gelu("tanh"),
            FeedForward::Swiglu => {
                let gate_up = h.chunk(2, -1);
                gate_up[0].silu() * &gate_up[1]
            }
        };
        self.linear(block, Site::Out, &h, train)
    }
}

/// `x` [B, heads, T, head_dim] rotated by its positions' angles: x cos + rotate_half(x) sin, with
/// rotate_half(x) = (-x₂, x₁) for x's halves x₁, x₂.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let halves = x.chunk(2, -1);
    let rotated = Tensor::cat(&[-&halves[1], halves[0].shallow_clone()], -1);
    x * cos + rotated * sin
}

fn linear(x: &Tensor, (w, b): &Affine) -> Tensor {
    x.linear(w, b.as_ref())
}

impl ModuleT for Stage {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let dropout = self.s.dropout;
        let t = x.size()[1];
        let mut h = match &self.embed {
            Some((tok, pos)) => {
                let e = Tensor::embedding(tok, x, -1, false, false);
                let e = match pos {
                    Some(pos) => e + pos.narrow(0, 0, t),
                    None => e,
                };
                e.dropout(dropout, train)
            }
            None => x.shallow_clone(),
        };
        let rope =
            (self.s.positions == Positions::Rope && !self.blocks.is_empty()).then(|| self.rope_tables(t, h.device()));
        for block in &self.blocks {
            h = &h + self.attention(block, &self.norm(&h, &block.ln1), rope.as_ref(), train).dropout(dropout, train);
            h = &h + self.mlp(block, &self.norm(&h, &block.ln2), train).dropout(dropout, train);
        }
        if let Some(head) = &self.head {
            h = self.norm(&h, &head.ln).linear(&head.weight, None::<Tensor>);
        }
        h
    }
}

/// Draws one layer's initial values from its stream, in a fixed order.
struct Init {
    rng: Rng,
    /// Whether linear layers (and LayerNorms) have biases (zeros).
    bias: bool,
}

impl Init {
    fn normal(&mut self, shape: &[usize], std: f64) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (self.rng.normal() * std) as f32).collect();
        let shape: Vec<i64> = shape.iter().map(|&s| s as i64).collect();
        Tensor::from_slice(&v).view(shape.as_slice())
    }

    fn linear(&mut self, p: &nn::Path, inputs: usize, outputs: usize, std: f64) -> Affine {
        let w = p.var_copy("weight", &self.normal(&[outputs, inputs], std));
        (w, self.bias(p, outputs, self.bias))
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
