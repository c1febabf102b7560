//! `kind = "transformer"`: a decoder-only language model in GPT-2's shape. Layer 0 is the token
//! and position embeddings (`tok.weight`, `pos.weight`), layers 1..=L the pre-norm blocks
//! (`blocks.{i}.ln1`, `.qkv`, `.proj`, `.ln2`, `.fc`, `.out`: causal self-attention through
//! libtorch's `scaled_dot_product_attention`, then an MLP of width 4 × d_model with GELU), and the
//! last layer the final norm and the output head (`ln_f`, `head.weight`, or the token embedding
//! itself when `tied`). A pipeline cuts between these layers: the embedding's stage takes int64
//! token ids, every other stage float32 activations of [seq_len, d_model] per sample.
//!
//! Initial weights as GPT-2's: normal(0, 0.02) for embeddings and linear weights (the residual
//! projections scaled by 1/√(2L)), zero biases, unit layer norms; each layer drawn from its own
//! stream of (seed, layer), so the stages of a pipeline together equal the whole model.
use std::ops::Range;

use tch::nn::{self, ModuleT};
use tch::Tensor;

use super::{Architecture, BuildContext, Layer};
use crate::config::schema::Transformer;
use crate::rng::Rng;

/// Longest context the runner takes (attention is quadratic in it).
pub const MAX_SEQ_LEN: usize = 1 << 16;

/// The keys' own bounds; `false` when a size is too large to compute shapes from.
pub fn check(t: &Transformer, bad: &mut impl FnMut(&str, String)) -> bool {
    use crate::limits::{MAX_LAYERS, MAX_WIDTH};
    let mut ok = true;
    for (key, v, max) in [
        ("wrap.model.vocab", t.vocab, MAX_WIDTH),
        ("wrap.model.d_model", t.d_model, MAX_WIDTH / 16),
        ("wrap.model.heads", t.heads, MAX_WIDTH),
        ("wrap.model.layers", t.layers, MAX_LAYERS),
        ("wrap.model.seq_len", t.seq_len, MAX_SEQ_LEN),
    ] {
        if v == 0 {
            bad(key, "must be at least 1".into());
            ok = false;
        } else if v > max {
            bad(key, format!("{v} is more than the {max} the runner takes"));
            ok = false;
        }
    }
    if ok && !t.d_model.is_multiple_of(t.heads) {
        bad(
            "wrap.model.heads",
            format!("{} heads do not divide d_model = {} evenly; use a divisor of it", t.heads, t.d_model),
        );
    }
    if !(0.0..1.0).contains(&t.dropout) {
        bad("wrap.model.dropout", format!("must be in [0, 1), got {}", t.dropout));
    }
    ok
}

/// A transformer's configuration: its layers are the embedding, `layers` blocks and the head.
#[derive(Debug, Clone)]
pub struct TransformerArch {
    t: Transformer,
}

impl TransformerArch {
    pub fn new(t: &Transformer) -> TransformerArch {
        TransformerArch { t: t.clone() }
    }

    fn head_layer(&self) -> usize {
        self.t.layers + 1
    }

    /// Values per sample (per window) a block keeps for its backward pass besides its output:
    /// per token, the two norms (2d), q, k and v (3d), the attention's output and projection
    /// (2d), the first residual (d), the MLP's hidden layer before and after GELU (8d) and the
    /// attention's log-sum-exp per head. With dropout, libtorch's attention takes its plain path,
    /// which keeps the attention weights and their dropout mask (2 × heads × seq_len²).
    fn block_held(&self) -> usize {
        let t = &self.t;
        let (d, s) = (t.d_model, t.seq_len);
        let weights = if t.dropout > 0.0 { 2 * t.heads * s * s } else { 0 };
        s * (16 * d + t.heads) + weights
    }
}

/// Parameters of one block of width `d`: two layer norms, qkv, the attention's projection, the
/// MLP; without biases, the norms' weights alone besides the matrices.
pub fn block_parameters(d: usize, bias: bool) -> usize {
    12 * d * d + if bias { 13 * d } else { 2 * d }
}

impl Architecture for TransformerArch {
    fn describe(&self) -> String {
        let t = &self.t;
        format!(
            "Transformer LM (vocab {}, d_model {}, {} heads, {} blocks, context {}{}{})",
            t.vocab,
            t.d_model,
            t.heads,
            t.layers,
            t.seq_len,
            if t.tied { ", head tied to the embedding" } else { "" },
            if t.bias { "" } else { ", no biases" }
        )
    }

    fn layers(&self) -> Vec<Layer> {
        let t = &self.t;
        let (d, v, s) = (t.d_model, t.vocab, t.seq_len);
        let mut layers = vec![Layer {
            name: format!("embedding {v} × {d} + positions {s} × {d}"),
            parameters: v * d + s * d,
            output: vec![s, d],
            held: 0,
        }];
        layers.extend((0..t.layers).map(|i| Layer {
            name: format!("block {i}: attention ({} heads) + MLP {d}-{}-{d}", t.heads, 4 * d),
            parameters: block_parameters(d, t.bias),
            output: vec![s, d],
            held: self.block_held(),
        }));
        layers.push(Layer {
            name: if t.tied { format!("norm + head {d} → {v} (tied)") } else { format!("norm + head {d} → {v}") },
            parameters: if t.bias { 2 * d } else { d } + if t.tied { 0 } else { v * d },
            output: vec![s, v],
            // The final norm's output and the log-softmax cross-entropy keeps.
            held: s * (d + v),
        });
        layers
    }

    fn parameters(&self, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
        let t = &self.t;
        let (d, v, s) = (t.d_model as i64, t.vocab as i64, t.seq_len as i64);
        let mut out = Vec::new();
        for layer in range {
            if layer == 0 {
                out.push(("tok.weight".into(), vec![v, d]));
                out.push(("pos.weight".into(), vec![s, d]));
            } else if layer == self.head_layer() {
                out.push(("ln_f.weight".into(), vec![d]));
                if t.bias {
                    out.push(("ln_f.bias".into(), vec![d]));
                }
                if !t.tied {
                    out.push(("head.weight".into(), vec![v, d]));
                }
            } else {
                let b = format!("blocks.{}", layer - 1);
                for (name, shape) in [
                    ("ln1.weight", vec![d]),
                    ("ln1.bias", vec![d]),
                    ("qkv.weight", vec![3 * d, d]),
                    ("qkv.bias", vec![3 * d]),
                    ("proj.weight", vec![d, d]),
                    ("proj.bias", vec![d]),
                    ("ln2.weight", vec![d]),
                    ("ln2.bias", vec![d]),
                    ("fc.weight", vec![4 * d, d]),
                    ("fc.bias", vec![4 * d]),
                    ("out.weight", vec![d, 4 * d]),
                    ("out.bias", vec![d]),
                ] {
                    if !t.bias && name.ends_with(".bias") {
                        continue;
                    }
                    out.push((format!("{b}.{name}"), shape));
                }
            }
        }
        out
    }

    /// One window of T = seq_len tokens: per block the qkv, attention-projection and MLP
    /// products (2 × T × 12 d², d = d_model) and the attention's two T × T products (2 × 2 T² d,
    /// the half the causal mask hides counted too, as PaLM's 6 N + 12 L d T per token counts it);
    /// then the head's 2 T d V. The embeddings are lookups. Training, 3 × this, is about
    /// 6 × parameters × T + 12 × L × d × T² per window.
    fn forward_flops(&self) -> Option<f64> {
        let t = &self.t;
        let (d, s, v, l) = (t.d_model as f64, t.seq_len as f64, t.vocab as f64, t.layers as f64);
        Some(l * (2.0 * s * 12.0 * d * d + 4.0 * s * s * d) + 2.0 * s * d * v)
    }

    fn build<'a>(&self, p: &nn::Path, range: Range<usize>, ctx: &BuildContext<'a>) -> Box<dyn ModuleT + 'a> {
        let (t, seed) = (&self.t, ctx.seed);
        let mut stage = TransformerStage {
            embed: None,
            blocks: Vec::new(),
            head: None,
            d: t.d_model as i64,
            heads: t.heads as i64,
            dropout: t.dropout,
        };
        // Residual projections: GPT-2's scaled initialisation.
        let residual_std = 0.02 / ((2 * t.layers) as f64).sqrt();
        for layer in range {
            let mut init = Init { rng: Rng::new(seed, LAYER_STREAM + layer as u64), bias: t.bias };
            if layer == 0 {
                let tok = (p / "tok").var_copy("weight", &init.normal(&[t.vocab, t.d_model], 0.02));
                let pos = (p / "pos").var_copy("weight", &init.normal(&[t.seq_len, t.d_model], 0.02));
                stage.embed = Some((tok, pos));
            } else if layer == self.head_layer() {
                let (w, b) = init.norm(&(p / "ln_f"), t.d_model);
                let head = if t.tied {
                    // The embedding built in this stage, or built before into the same variables
                    // (sharding builds each layer on its own); the plan refuses a pipeline whose
                    // head's stage lacks it.
                    match &stage.embed {
                        Some((tok, _)) => tok.shallow_clone(),
                        None => (p / "tok").get("weight").expect("a tied head is built after the embedding"),
                    }
                } else {
                    (p / "head").var_copy("weight", &init.normal(&[t.vocab, t.d_model], 0.02))
                };
                stage.head = Some(Head { ln: (w, b), weight: head });
            } else {
                let b = p / "blocks" / (layer - 1).to_string();
                let d = t.d_model;
                stage.blocks.push(Block {
                    ln1: init.norm(&(&b / "ln1"), d),
                    qkv: init.linear(&(&b / "qkv"), d, 3 * d, 0.02),
                    proj: init.linear(&(&b / "proj"), d, d, residual_std),
                    ln2: init.norm(&(&b / "ln2"), d),
                    fc: init.linear(&(&b / "fc"), d, 4 * d, 0.02),
                    out: init.linear(&(&b / "out"), 4 * d, d, residual_std),
                });
            }
        }
        Box::new(stage)
    }

    fn reads(&self, layer: usize) -> Vec<usize> {
        if self.t.tied && layer == self.head_layer() {
            vec![layer, 0]
        } else {
            vec![layer]
        }
    }

    fn check_stages(&self, stages: &[Range<usize>]) -> Result<(), String> {
        let head = self.head_layer();
        match stages.iter().find(|r| r.contains(&head) && !r.contains(&0)) {
            Some(r) if self.t.tied => Err(format!(
                "the output head (layer {head}) is tied to the token embedding (layer 0), but a pipeline puts them \
                 on different ranks ({} without layer 0); set wrap.model.tied = false",
                super::layers_text(r)
            )),
            _ => Ok(()),
        }
    }
}

/// Separates the layers' streams from other uses of the run's seed.
const LAYER_STREAM: u64 = 0x7F0A_0000;

/// Draws one layer's initial values from its stream, in a fixed order.
struct Init {
    rng: Rng,
    /// Whether linear layers and norms have biases (zeros).
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
        (w, self.bias(p, outputs))
    }

    fn norm(&mut self, p: &nn::Path, d: usize) -> Affine {
        let opts = (tch::Kind::Float, tch::Device::Cpu);
        (p.var_copy("weight", &Tensor::ones([d as i64], opts)), self.bias(p, d))
    }

    fn bias(&self, p: &nn::Path, n: usize) -> Option<Tensor> {
        let zeros = Tensor::zeros([n as i64], (tch::Kind::Float, tch::Device::Cpu));
        self.bias.then(|| p.var_copy("bias", &zeros))
    }
}

/// A weight and its bias (absent with `bias = false`).
type Affine = (Tensor, Option<Tensor>);

#[derive(Debug)]
struct Block {
    ln1: Affine,
    qkv: Affine,
    proj: Affine,
    ln2: Affine,
    fc: Affine,
    out: Affine,
}

#[derive(Debug)]
struct Head {
    ln: Affine,
    /// [vocab, d_model]: its own, or the token embedding.
    weight: Tensor,
}

/// The layers one process holds: the whole model, or a pipeline stage's contiguous part of it.
#[derive(Debug)]
struct TransformerStage {
    /// Token and position embeddings.
    embed: Option<(Tensor, Tensor)>,
    blocks: Vec<Block>,
    head: Option<Head>,
    d: i64,
    heads: i64,
    dropout: f64,
}

fn layer_norm(x: &Tensor, (w, b): &Affine) -> Tensor {
    let d = w.size()[0];
    x.layer_norm([d].as_slice(), Some(w), b.as_ref(), 1e-5, true)
}

fn linear(x: &Tensor, (w, b): &Affine) -> Tensor {
    x.linear(w, b.as_ref())
}

impl TransformerStage {
    fn attention(&self, block: &Block, x: &Tensor, train: bool) -> Tensor {
        let (b, t) = (x.size()[0], x.size()[1]);
        let hd = self.d / self.heads;
        let qkv = linear(x, &block.qkv).split(self.d, -1);
        let split = |h: &Tensor| h.view([b, t, self.heads, hd]).transpose(1, 2);
        let p = if train { self.dropout } else { 0.0 };
        let y = Tensor::scaled_dot_product_attention(
            &split(&qkv[0]),
            &split(&qkv[1]),
            &split(&qkv[2]),
            None::<Tensor>,
            p,
            true,
            None,
            false,
        );
        linear(&y.transpose(1, 2).contiguous().view([b, t, self.d]), &block.proj)
    }
}

impl ModuleT for TransformerStage {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let mut h = match &self.embed {
            Some((tok, pos)) => {
                let t = x.size()[1];
                let e = Tensor::embedding(tok, x, -1, false, false) + pos.narrow(0, 0, t);
                e.dropout(self.dropout, train)
            }
            None => x.shallow_clone(),
        };
        for block in &self.blocks {
            h = &h + self.attention(block, &layer_norm(&h, &block.ln1), train).dropout(self.dropout, train);
            let m = linear(&linear(&layer_norm(&h, &block.ln2), &block.fc).gelu("none"), &block.out);
            h = &h + m.dropout(self.dropout, train);
        }
        if let Some(head) = &self.head {
            h = layer_norm(&h, &head.ln).linear(&head.weight, None::<Tensor>);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{parameters_in_module_order, sorted_parameters};

    fn small(tied: bool) -> Transformer {
        Transformer { vocab: 11, d_model: 8, heads: 2, layers: 3, seq_len: 5, dropout: 0.0, tied, bias: true }
    }

    #[test]
    fn parameter_counts_and_shapes_match_the_built_model() {
        for (tied, bias) in [(true, true), (false, true), (true, false)] {
            let arch = TransformerArch::new(&Transformer { bias, ..small(tied) });
            let n = arch.layers().len();
            assert_eq!(n, 5);
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let net = arch.build(&vs.root(), 0..n, &BuildContext::new(0));
            let built: usize = vs.trainable_variables().iter().map(|t| t.numel()).sum();
            assert_eq!(built, arch.layers().iter().map(|l| l.parameters).sum::<usize>());
            let mut named: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
            named.sort();
            assert_eq!(named, sorted_parameters(&arch));
            assert_eq!(parameters_in_module_order(&arch, 0..n, &vs).len(), named.len());
            let x = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8, 9, 10]).view([2, 5]);
            assert_eq!(net.forward_t(&x, false).size(), [2, 5, 11]);
            // 3 blocks of 2 × 5 × 12 × 8² + 4 × 5² × 8, and the head's 2 × 5 × 8 × 11.
            let flops = 3.0 * (2.0 * 5.0 * 12.0 * 64.0 + 4.0 * 25.0 * 8.0) + 2.0 * 5.0 * 8.0 * 11.0;
            assert_eq!(arch.forward_flops(), Some(flops));
        }
    }

    #[test]
    fn attention_is_causal() {
        // Changing the last token leaves every earlier position's output unchanged.
        let arch = TransformerArch::new(&small(false));
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let net = arch.build(&vs.root(), 0..5, &BuildContext::new(3));
        let a = net.forward_t(&Tensor::from_slice(&[1i64, 2, 3, 4, 5]).view([1, 5]), false);
        let b = net.forward_t(&Tensor::from_slice(&[1i64, 2, 3, 4, 9]).view([1, 5]), false);
        assert!(a.narrow(1, 0, 4).equal(&b.narrow(1, 0, 4)));
        assert!(!a.narrow(1, 4, 1).equal(&b.narrow(1, 4, 1)));
    }

    #[test]
    fn stages_together_equal_the_whole_model() {
        let arch = TransformerArch::new(&small(false));
        let x = Tensor::from_slice(&[0i64, 3, 10, 2, 2, 7, 1, 0, 5, 9]).view([2, 5]);
        crate::model::assert_stages_equal_whole(&arch, &x, &[0..2, 2..3, 3..5]);
    }

    #[test]
    fn a_tied_head_must_share_a_stage_with_the_embedding() {
        let tied = TransformerArch::new(&small(true));
        let whole = [Range { start: 0, end: 5 }];
        assert!(tied.check_stages(&whole).is_ok());
        let err = tied.check_stages(&[0..3, 3..5]).unwrap_err();
        assert!(err.contains("(layers 3-4 without layer 0); set wrap.model.tied = false"), "{err}");
        assert!(TransformerArch::new(&small(false)).check_stages(&[0..3, 3..5]).is_ok());
        let mut bad = Vec::new();
        check(&Transformer { heads: 3, ..small(false) }, &mut |k, m| bad.push(format!("{k}: {m}")));
        assert_eq!(bad, ["wrap.model.heads: 3 heads do not divide d_model = 8 evenly; use a divisor of it"]);
    }
}
