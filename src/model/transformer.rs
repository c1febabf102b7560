//! `kind = "transformer"`: a decoder-only language model, GPT-2's block or Llama's, and every mix
//! of their parts ([`Spec`]: `family` sets the defaults, each part can be set on its own). Layer 0
//! is the token embedding (`tok.weight`, and `pos.weight` with learned positions), layers 1..=L
//! the pre-norm blocks (`blocks.{i}.ln1`, `.qkv`, `.proj`, `.ln2`, `.fc`, `.out`: causal
//! self-attention through libtorch's `scaled_dot_product_attention`, with grouped key/value heads
//! and rotary positions where set, then a GELU or SwiGLU MLP), and the last layer the final norm
//! and the output head (`ln_f`, `head.weight`, or the token embedding itself when tied). A
//! pipeline cuts between these layers: the embedding's stage takes int64 token ids, every other
//! stage float32 activations of [seq_len, d_model] per sample.
//!
//! The queries, keys and values are one matrix (`qkv`: the query heads' rows, then the key
//! heads', then the value heads'), and SwiGLU's gate and up projections one (`fc`: gate rows,
//! then up rows): one product each. The model knows no checkpoint format; `model::hf` maps
//! Hugging Face's names and layouts onto these.
//!
//! Initial weights as GPT-2's: normal(0, 0.02) for embeddings and linear weights (the residual
//! projections scaled by 1/√(2L)), zero biases, unit norms; each layer drawn from its own stream
//! of (seed, layer), so the stages of a pipeline together equal the whole model.
mod activations;
mod block;
pub mod lora;
pub mod packed;
mod spec;

use std::ops::Range;

use tch::nn::{self, ModuleT};

use super::{Activations, Architecture, BuildContext, Layer, TensorSlice};
use crate::config::schema::{FeedForward, Positions, Transformer};
pub use spec::{check, Spec, MAX_SEQ_LEN};

/// A transformer's configuration: its layers are the embedding, `layers` blocks and the head.
#[derive(Debug, Clone)]
pub struct TransformerArch {
    s: Spec,
    /// LoRA's adapters in every block (`wrap.lora`): then only they are trained.
    lora: Option<lora::Adapters>,
}

impl TransformerArch {
    pub fn new(t: &Transformer) -> TransformerArch {
        TransformerArch { s: Spec::of(t), lora: None }
    }

    pub fn from_spec(s: Spec) -> TransformerArch {
        TransformerArch { s, lora: None }
    }

    /// With LoRA's adapters in every block.
    pub fn with_lora(self, lora: Option<lora::Adapters>) -> TransformerArch {
        TransformerArch { lora, ..self }
    }

    pub fn spec(&self) -> &Spec {
        &self.s
    }

    pub fn lora(&self) -> Option<&lora::Adapters> {
        self.lora.as_ref()
    }

    fn head_layer(&self) -> usize {
        self.s.layers + 1
    }

    /// Values per sample (per window) a block keeps for its backward pass besides its output, in
    /// float32 ([`activations::block_kept`], and with LoRA [`activations::lora_kept`]).
    fn block_held(&self) -> usize {
        let lora = self.lora.as_ref().map_or(0.0, |l| activations::lora_kept(&self.s, l, 4.0));
        ((activations::block_kept(&self.s, 4.0, activations::Split::WHOLE) + lora) / 4.0) as usize
    }

    /// "LoRA of rank 8 (alpha 16) on q_proj, v_proj: 3584 parameters trained".
    fn lora_text(&self) -> Option<String> {
        let l = self.lora.as_ref()?;
        let per_block: i64 = l.targets.iter().map(|t| l.rank * (t.inputs + t.rows.end - t.rows.start)).sum();
        Some(format!(
            "LoRA of rank {} (alpha {}) on {}: {} parameters trained",
            l.rank,
            l.alpha,
            l.names().join(", "),
            per_block * self.s.layers as i64
        ))
    }

    /// Per block, the names and shapes of its parameters, in module order.
    fn block_parameters(&self, b: &str) -> Vec<(String, Vec<i64>)> {
        let s = &self.s;
        let (d, qkv, q, hidden) = (s.d as i64, s.qkv_rows() as i64, (s.heads * s.head_dim) as i64, s.hidden as i64);
        let fc = hidden * if s.mlp == FeedForward::Swiglu { 2 } else { 1 };
        let norm_bias = s.norm_has_bias();
        [
            ("ln1.weight", vec![d], true),
            ("ln1.bias", vec![d], norm_bias),
            ("qkv.weight", vec![qkv, d], true),
            ("qkv.bias", vec![qkv], s.bias),
            ("proj.weight", vec![d, q], true),
            ("proj.bias", vec![d], s.bias),
            ("ln2.weight", vec![d], true),
            ("ln2.bias", vec![d], norm_bias),
            ("fc.weight", vec![fc, d], true),
            ("fc.bias", vec![fc], s.bias),
            ("out.weight", vec![d, hidden], true),
            ("out.bias", vec![d], s.bias),
        ]
        .into_iter()
        .filter(|(_, _, present)| *present)
        .map(|(name, shape, _)| (format!("{b}.{name}"), shape))
        .chain(self.lora.iter().flat_map(|l| l.targets.iter().flat_map(|t| t.parameters(b, l.rank))))
        .collect()
    }
}

impl Architecture for TransformerArch {
    fn describe(&self) -> String {
        let s = &self.s;
        let kv = if s.kv_heads < s.heads { format!(" ({} key/value)", s.kv_heads) } else { String::new() };
        format!(
            "Transformer LM (vocab {}, d_model {}, {} heads{kv}, {} blocks, context {}{}{}{})",
            s.vocab,
            s.d,
            s.heads,
            s.layers,
            s.seq_len,
            if s.tied { ", head tied to the embedding" } else { "" },
            if s.bias { "" } else { ", no biases" },
            s.parts().iter().chain(self.lora_text().as_ref()).map(|p| format!(", {p}")).collect::<String>()
        )
    }

    fn layers(&self) -> Vec<Layer> {
        let s = &self.s;
        let (d, v) = (s.d, s.vocab);
        let positions = match s.positions {
            Positions::Learned => format!(" + positions {} × {d}", s.max_positions),
            Positions::Rope => String::new(),
        };
        let mut layers = vec![Layer {
            name: format!("embedding {v} × {d}{positions}"),
            parameters: self.parameters(0..1).iter().map(|(_, shape)| shape.iter().product::<i64>() as usize).sum(),
            output: vec![s.seq_len, d],
            held: 0,
        }];
        let block: usize =
            self.block_parameters("b").iter().map(|(_, shape)| shape.iter().product::<i64>()).sum::<i64>() as usize;
        layers.extend((0..s.layers).map(|i| Layer {
            name: format!("block {i}: {}", s.block_text()),
            parameters: block,
            output: vec![s.seq_len, d],
            held: self.block_held(),
        }));
        layers.push(Layer {
            name: if s.tied { format!("norm + head {d} → {v} (tied)") } else { format!("norm + head {d} → {v}") },
            parameters: if s.norm_has_bias() { 2 * d } else { d } + if s.tied { 0 } else { v * d },
            output: vec![s.seq_len, v],
            // The final norm's output (for the head's weight gradient: none when LoRA freezes
            // it) and the log-softmax cross-entropy keeps.
            held: s.seq_len * (if self.lora.is_some() { v } else { d + v }),
        });
        layers
    }

    fn parameters(&self, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
        let s = &self.s;
        let (d, v) = (s.d as i64, s.vocab as i64);
        let mut out = Vec::new();
        for layer in range {
            if layer == 0 {
                out.push(("tok.weight".into(), vec![v, d]));
                if s.positions == Positions::Learned {
                    out.push(("pos.weight".into(), vec![s.max_positions as i64, d]));
                }
            } else if layer == self.head_layer() {
                out.push(("ln_f.weight".into(), vec![d]));
                if s.norm_has_bias() {
                    out.push(("ln_f.bias".into(), vec![d]));
                }
                if !s.tied {
                    out.push(("head.weight".into(), vec![v, d]));
                }
            } else {
                out.extend(self.block_parameters(&format!("blocks.{}", layer - 1)));
            }
        }
        out
    }

    /// One window of T = seq_len tokens: per block the qkv, attention-projection and MLP
    /// products (2 × T × their parameters) and the attention's two T × T products per head (2 × 2
    /// T² × heads × head_dim, the half the causal mask hides counted too, as PaLM's 6 N + 12 L d
    /// T per token counts it); then the head's 2 T d V. The embeddings are lookups. Training, 3 ×
    /// this, is about 6 × parameters × T + 12 × L × d × T² per window.
    fn forward_flops(&self) -> Option<f64> {
        let s = &self.s;
        let (d, t, v, l) = (s.d as f64, s.seq_len as f64, s.vocab as f64, s.layers as f64);
        let (q, kv, hidden) = ((s.heads * s.head_dim) as f64, (s.kv_heads * s.head_dim) as f64, s.hidden as f64);
        let mlp = hidden * d * if s.mlp == FeedForward::Swiglu { 3.0 } else { 2.0 };
        // An adapter's two products: A (rank × inputs), then B (rows × rank).
        let adapters: f64 = self
            .lora
            .iter()
            .flat_map(|l| l.targets.iter().map(move |a| (l.rank * (a.inputs + a.rows.end - a.rows.start)) as f64))
            .sum();
        let matrices = d * (q + 2.0 * kv) + q * d + mlp + adapters;
        Some(l * (2.0 * t * matrices + 4.0 * t * t * q) + 2.0 * t * d * v)
    }

    fn activation_bytes(&self, batch: usize, validation: usize, how: &Activations) -> Option<f64> {
        Some(activations::peak_bytes(&self.s, self.lora.as_ref(), batch, validation, how))
    }

    fn build<'a>(&self, p: &nn::Path, range: Range<usize>, ctx: &BuildContext<'a>) -> Box<dyn ModuleT + 'a> {
        let slice = |name: &str, k: usize, n: usize| self.tensor_slice(name, k, n);
        let stage = block::Stage::build(&self.s, p, range, ctx.seed, ctx.tensor.clone(), &slice, self.lora.as_ref());
        Box::new(stage.with_checkpointing(ctx.checkpointing))
    }

    fn frozen(&self, name: &str) -> bool {
        self.lora.is_some() && !lora::is_adapter(name)
    }

    /// Megatron's split: each tensor rank holds whole attention heads (its query heads' rows of
    /// `qkv`, and its key/value heads', the same share of each) and the same columns of `proj`;
    /// its share of the MLP's hidden units (SwiGLU's gate and up rows alike) as rows of `fc` and
    /// columns of `out`. The norms, embeddings and head are replicated: the vocabularies the
    /// runner trains are small beside the blocks, and a replicated head keeps the loss whole on
    /// every rank (no vocabulary-parallel cross-entropy to reduce).
    fn tensor_slice(&self, name: &str, k: usize, n: usize) -> Option<TensorSlice> {
        let s = &self.s;
        let (q, kv, hidden) = ((s.heads * s.head_dim) as i64, (s.kv_heads * s.head_dim) as i64, s.hidden as i64);
        let gated = if s.mlp == FeedForward::Swiglu { vec![hidden, hidden] } else { vec![hidden] };
        let part = name.strip_prefix("blocks.")?.split_once('.')?.1;
        Some(match part {
            "qkv.weight" | "qkv.bias" => TensorSlice::of_blocks(0, &[q, kv, kv], k, n),
            "proj.weight" => TensorSlice::of_blocks(1, &[q], k, n),
            "fc.weight" | "fc.bias" => TensorSlice::of_blocks(0, &gated, k, n),
            "out.weight" => TensorSlice::of_blocks(1, &[hidden], k, n),
            _ => return None,
        })
    }

    fn reads(&self, layer: usize) -> Vec<usize> {
        if self.s.tied && layer == self.head_layer() {
            vec![layer, 0]
        } else {
            vec![layer]
        }
    }

    fn check_stages(&self, stages: &[Range<usize>]) -> Result<(), String> {
        let head = self.head_layer();
        match stages.iter().find(|r| r.contains(&head) && !r.contains(&0)) {
            Some(r) if self.s.tied => Err(format!(
                "the output head (layer {head}) is tied to the token embedding (layer 0), but a pipeline puts them \
                 on different ranks ({} without layer 0); set wrap.model.tied = false",
                super::layers_text(r)
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::{Family, Norm};
    use crate::model::{parameters_in_module_order, sorted_parameters};
    use tch::Tensor;

    fn small(tied: bool) -> Transformer {
        Transformer { vocab: 11, d_model: 8, heads: 2, layers: 3, seq_len: 5, tied: Some(tied), ..Default::default() }
    }

    fn llama() -> Transformer {
        Transformer {
            family: Family::Llama,
            vocab: 11,
            d_model: 16,
            heads: 4,
            kv_heads: Some(2),
            layers: 3,
            seq_len: 5,
            mlp_hidden: Some(24),
            ..Default::default()
        }
    }

    /// The built model's variables are the architecture's, and its counts add up.
    fn assert_consistent(t: &Transformer) -> (TransformerArch, Box<dyn ModuleT>, nn::VarStore) {
        let arch = TransformerArch::new(t);
        let n = arch.layers().len();
        assert_eq!(n, t.layers + 2);
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
        (arch, net, vs)
    }

    #[test]
    fn parameter_counts_and_shapes_match_the_built_model() {
        for (tied, bias) in [(true, true), (false, true), (true, false)] {
            let (arch, _, _) = assert_consistent(&Transformer { bias: Some(bias), ..small(tied) });
            // 3 blocks of 2 × 5 × 12 × 8² + 4 × 5² × 8, and the head's 2 × 5 × 8 × 11.
            let flops = 3.0 * (2.0 * 5.0 * 12.0 * 64.0 + 4.0 * 25.0 * 8.0) + 2.0 * 5.0 * 8.0 * 11.0;
            assert_eq!(arch.forward_flops(), Some(flops));
        }
        let (arch, _, vs) = assert_consistent(&llama());
        // Queries 4 × 4 rows, keys and values 2 × 4 rows each; gate and up 24 rows each.
        assert_eq!(vs.variables()["blocks.0.qkv.weight"].size(), [32, 16]);
        assert_eq!(vs.variables()["blocks.0.fc.weight"].size(), [48, 16]);
        assert_eq!(vs.variables()["blocks.0.out.weight"].size(), [16, 24]);
        assert!(!vs.variables().contains_key("pos.weight") && !vs.variables().contains_key("ln_f.bias"));
        assert!(vs.variables().contains_key("head.weight"), "llama's head is its own by default");
        let flops = 3.0 * (2.0 * 5.0 * (16.0 * 32.0 + 16.0 * 16.0 + 3.0 * 24.0 * 16.0) + 4.0 * 25.0 * 16.0)
            + 2.0 * 5.0 * 16.0 * 11.0;
        assert_eq!(arch.forward_flops(), Some(flops));
        assert_eq!(
            arch.describe(),
            "Transformer LM (vocab 11, d_model 16, 4 heads (2 key/value), 3 blocks, context 5, no biases, RMSNorm, \
             RoPE, SwiGLU MLP of 24)"
        );
        // Every part on its own: a GPT-2 block with RMSNorm and a wider head.
        let mixed =
            Transformer { norm: Some(Norm::Rmsnorm), head_dim: Some(8), max_positions: Some(9), ..small(false) };
        let (arch, _, vs) = assert_consistent(&mixed);
        assert_eq!(vs.variables()["blocks.0.qkv.weight"].size(), [48, 8]);
        assert_eq!(vs.variables()["pos.weight"].size(), [9, 8]);
        assert!(arch.describe().ends_with(", RMSNorm, head_dim 8)"), "{}", arch.describe());
    }

    #[test]
    fn attention_is_causal() {
        // Changing the last token leaves every earlier position's output unchanged.
        for t in [small(false), llama()] {
            let arch = TransformerArch::new(&t);
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let net = arch.build(&vs.root(), 0..5, &BuildContext::new(3));
            let a = net.forward_t(&Tensor::from_slice(&[1i64, 2, 3, 4, 5]).view([1, 5]), false);
            let b = net.forward_t(&Tensor::from_slice(&[1i64, 2, 3, 4, 9]).view([1, 5]), false);
            assert!(a.narrow(1, 0, 4).allclose(&b.narrow(1, 0, 4), 1e-6, 1e-6, false));
            assert!(!a.narrow(1, 4, 1).equal(&b.narrow(1, 4, 1)));
        }
    }

    #[test]
    fn stages_together_equal_the_whole_model() {
        let x = Tensor::from_slice(&[0i64, 3, 10, 2, 2, 7, 1, 0, 5, 9]).view([2, 5]);
        for t in [small(false), llama()] {
            crate::model::assert_stages_equal_whole(&TransformerArch::new(&t), &x, &[0..2, 2..3, 3..5]);
        }
    }

    /// A checkpointed model's loss and every gradient are the bits of the plain one, under full
    /// and selective checkpointing, for GPT-2's blocks (LayerNorm, biases, GELU; here with RoPE
    /// and grouped keys) and Llama's (RMSNorm, no biases, SwiGLU) (with dropout in
    /// tests/integration/activations.rs: the tests of this binary share one generator).
    #[test]
    fn checkpointed_blocks_give_the_same_gradients() {
        use crate::config::schema::{ActivationCheckpointing, CheckpointPolicy};
        let gpt = Transformer { positions: Some(Positions::Rope), kv_heads: Some(1), ..small(false) };
        for t in [gpt, llama()] {
            let grads = |policy: CheckpointPolicy| {
                let arch = TransformerArch::new(&t);
                let vs = nn::VarStore::new(tch::Device::Cpu);
                let checkpointing = ActivationCheckpointing { policy, every: 1 };
                let ctx = BuildContext { checkpointing, ..BuildContext::new(3) };
                let net = arch.build(&vs.root(), 0..5, &ctx);
                let x = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8, 9, 10]).view([2, 5]);
                let loss = net.forward_t(&x, true).square().mean(tch::Kind::Float);
                loss.backward();
                let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.grad())).collect();
                named.sort_by(|a, b| a.0.cmp(&b.0));
                (loss, named)
            };
            let plain = grads(CheckpointPolicy::None);
            for policy in [CheckpointPolicy::Full, CheckpointPolicy::Selective] {
                let other = grads(policy);
                assert!(plain.0.equal(&other.0), "{policy:?}: loss");
                for ((name, g), (_, h)) in plain.1.iter().zip(&other.1) {
                    assert!(g.equal(h), "{policy:?}: {name}: {}", (g - h).abs().max());
                }
            }
        }
    }

    #[test]
    fn a_tied_head_must_share_a_stage_with_the_embedding() {
        let tied = TransformerArch::new(&small(true));
        let whole = [Range { start: 0, end: 5 }];
        assert!(tied.check_stages(&whole).is_ok());
        let err = tied.check_stages(&[0..3, 3..5]).unwrap_err();
        assert!(err.contains("(layers 3-4 without layer 0); set wrap.model.tied = false"), "{err}");
        assert!(TransformerArch::new(&small(false)).check_stages(&[0..3, 3..5]).is_ok());
    }
}
