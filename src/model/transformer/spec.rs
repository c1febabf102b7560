//! A transformer's configuration with its family's defaults filled in ([`Spec`]), and the checks
//! of its keys.
use crate::config::schema::{Family, FeedForward, Norm, Positions, Transformer};

/// Longest context the runner takes (attention is quadratic in it).
pub const MAX_SEQ_LEN: usize = 1 << 16;

/// What a transformer is: every part resolved, the family's default where the key is unset.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub family: Family,
    pub vocab: usize,
    /// d_model.
    pub d: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub layers: usize,
    pub seq_len: usize,
    /// Rows of the learned position table; the longest context an export records.
    pub max_positions: usize,
    /// The MLP's hidden width.
    pub hidden: usize,
    pub dropout: f64,
    pub tied: bool,
    pub bias: bool,
    pub norm: Norm,
    pub eps: f64,
    pub positions: Positions,
    pub rope_theta: f64,
    pub mlp: FeedForward,
}

/// The SwiGLU hidden width Llama's reference code gives a width `d`: 2/3 of 4d, rounded up to a
/// multiple of 256.
pub fn swiglu_hidden(d: usize) -> usize {
    (2 * 4 * d / 3).div_ceil(256) * 256
}

impl Spec {
    pub fn of(t: &Transformer) -> Spec {
        let llama = t.family == Family::Llama;
        let mlp = t.mlp.unwrap_or(if llama { FeedForward::Swiglu } else { FeedForward::Gelu });
        let hidden = t.mlp_hidden.unwrap_or(match mlp {
            FeedForward::Swiglu => swiglu_hidden(t.d_model),
            FeedForward::Gelu | FeedForward::GeluTanh => 4 * t.d_model,
        });
        let positions = t.positions.unwrap_or(if llama { Positions::Rope } else { Positions::Learned });
        Spec {
            family: t.family,
            vocab: t.vocab,
            d: t.d_model,
            heads: t.heads,
            kv_heads: t.kv_heads.unwrap_or(t.heads),
            head_dim: t.head_dim.unwrap_or(t.d_model / t.heads.max(1)),
            layers: t.layers,
            seq_len: t.seq_len,
            max_positions: t.max_positions.unwrap_or(t.seq_len),
            hidden,
            dropout: t.dropout,
            tied: t.tied.unwrap_or(!llama),
            bias: t.bias.unwrap_or(!llama),
            norm: t.norm.unwrap_or(if llama { Norm::Rmsnorm } else { Norm::Layernorm }),
            eps: t.norm_eps.unwrap_or(if llama { 1e-6 } else { 1e-5 }),
            positions,
            rope_theta: t.rope_theta.unwrap_or(10000.0),
            mlp,
        }
    }

    /// Rows of the fused query, key and value matrix.
    pub fn qkv_rows(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Whether the norms have a bias: LayerNorm with biases on.
    pub fn norm_has_bias(&self) -> bool {
        self.bias && self.norm == Norm::Layernorm
    }

    /// "attention (4 heads) + MLP 64-256-64", "attention (4 heads, 2 key/value) + SwiGLU MLP
    /// 64-172-64".
    pub fn block_text(&self) -> String {
        let kv = if self.kv_heads < self.heads { format!(", {} key/value", self.kv_heads) } else { String::new() };
        let mlp = match self.mlp {
            FeedForward::Gelu => "MLP",
            FeedForward::GeluTanh => "GELU (tanh) MLP",
            FeedForward::Swiglu => "SwiGLU MLP",
        };
        format!("attention ({} heads{kv}) + {mlp} {}-{}-{}", self.heads, self.d, self.hidden, self.d)
    }

    /// The parts that differ from GPT-2's block, for the model's description.
    pub fn parts(&self) -> Vec<String> {
        let mut parts = Vec::new();
        if self.norm == Norm::Rmsnorm {
            parts.push("RMSNorm".to_owned());
        }
        if self.positions == Positions::Rope {
            parts.push(if self.rope_theta == 10000.0 {
                "RoPE".to_owned()
            } else {
                format!("RoPE θ {}", self.rope_theta)
            });
        }
        match self.mlp {
            FeedForward::Swiglu => parts.push(format!("SwiGLU MLP of {}", self.hidden)),
            FeedForward::GeluTanh => parts.push(format!("GELU (tanh) MLP of {}", self.hidden)),
            FeedForward::Gelu if self.hidden != 4 * self.d => parts.push(format!("MLP of {}", self.hidden)),
            FeedForward::Gelu => {}
        }
        if self.head_dim * self.heads != self.d {
            parts.push(format!("head_dim {}", self.head_dim));
        }
        parts
    }
}

/// The keys' own bounds and relations; `false` when a size is too large (or zero) to compute
/// shapes from.
pub fn check(t: &Transformer, bad: &mut impl FnMut(&str, String)) -> bool {
    use crate::limits::{MAX_LAYERS, MAX_WIDTH};
    let mut ok = true;
    let optional = |v: Option<usize>| v.unwrap_or(1);
    for (key, v, max) in [
        ("wrap.model.vocab", t.vocab, MAX_WIDTH),
        ("wrap.model.d_model", t.d_model, MAX_WIDTH / 16),
        ("wrap.model.heads", t.heads, MAX_WIDTH),
        ("wrap.model.kv_heads", optional(t.kv_heads), MAX_WIDTH),
        ("wrap.model.head_dim", optional(t.head_dim), MAX_WIDTH / 16),
        ("wrap.model.layers", t.layers, MAX_LAYERS),
        ("wrap.model.seq_len", t.seq_len, MAX_SEQ_LEN),
        ("wrap.model.max_positions", optional(t.max_positions), MAX_SEQ_LEN),
        ("wrap.model.mlp_hidden", optional(t.mlp_hidden), MAX_WIDTH),
    ] {
        if v == 0 {
            bad(key, "must be at least 1".into());
            ok = false;
        } else if v > max {
            bad(key, format!("{v} is more than the {max} the runner takes"));
            ok = false;
        }
    }
    if ok && t.head_dim.is_none() && !t.d_model.is_multiple_of(t.heads) {
        bad(
            "wrap.model.heads",
            format!("{} heads do not divide d_model = {} evenly; use a divisor of it", t.heads, t.d_model),
        );
        ok = false;
    }
    let s = Spec::of(t);
    if ok && !s.heads.is_multiple_of(s.kv_heads) {
        bad(
            "wrap.model.kv_heads",
            format!(
                "{} key/value heads do not divide the {} query heads (wrap.model.heads): each key/value head serves \
                 the same number of query heads; use a divisor of {}",
                s.kv_heads, s.heads, s.heads
            ),
        );
        ok = false;
    }
    if ok && s.max_positions < s.seq_len {
        // Rotary positions compute any position, but a model made for max_positions was never
        // trained past them, and an export would record the longer context as its own.
        let why = match s.positions {
            Positions::Learned => "the learned position table has no row for the later tokens of a window".to_owned(),
            Positions::Rope => format!(
                "the model takes at most {} positions (a Hugging Face checkpoint's max_position_embeddings); set \
                 wrap.model.seq_len to at most {}",
                s.max_positions, s.max_positions
            ),
        };
        bad(
            "wrap.model.max_positions",
            format!("{} positions are fewer than seq_len = {}: {why}", s.max_positions, s.seq_len),
        );
    }
    if ok && s.positions == Positions::Rope && !s.head_dim.is_multiple_of(2) {
        bad(
            "wrap.model.positions",
            format!("rotary positions rotate pairs of a head's values, but head_dim is {} (odd)", s.head_dim),
        );
    }
    if !(s.eps > 0.0 && s.eps < 1.0) {
        bad("wrap.model.norm_eps", format!("must be above 0 and below 1, got {}", s.eps));
    }
    if !(s.rope_theta > 1.0 && s.rope_theta.is_finite()) {
        bad("wrap.model.rope_theta", format!("must be a finite number above 1, got {}", s.rope_theta));
    }
    if !(0.0..1.0).contains(&t.dropout) {
        bad("wrap.model.dropout", format!("must be in [0, 1), got {}", t.dropout));
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(t: Transformer) -> Vec<String> {
        let mut bad = Vec::new();
        check(&t, &mut |k, m| bad.push(format!("{k}: {m}")));
        bad
    }

    #[test]
    fn the_family_sets_the_defaults_and_each_part_can_be_set() {
        let gpt2 = Spec::of(&Transformer::default());
        assert_eq!(
            (gpt2.norm, gpt2.positions, gpt2.mlp, gpt2.tied, gpt2.bias),
            (Norm::Layernorm, Positions::Learned, FeedForward::Gelu, true, true)
        );
        assert_eq!((gpt2.hidden, gpt2.kv_heads, gpt2.head_dim, gpt2.max_positions, gpt2.eps), (256, 4, 16, 64, 1e-5));
        let llama = Spec::of(&Transformer { family: Family::Llama, ..Default::default() });
        assert_eq!(
            (llama.norm, llama.positions, llama.mlp, llama.tied, llama.bias),
            (Norm::Rmsnorm, Positions::Rope, FeedForward::Swiglu, false, false)
        );
        assert_eq!((llama.hidden, llama.eps, llama.rope_theta), (256, 1e-6, 10000.0));
        // Llama 2 7B's width.
        assert_eq!(swiglu_hidden(4096), 11008);
        let own = Spec::of(&Transformer {
            family: Family::Llama,
            tied: Some(true),
            mlp: Some(FeedForward::GeluTanh),
            ..Default::default()
        });
        assert_eq!((own.tied, own.mlp, own.hidden, own.norm), (true, FeedForward::GeluTanh, 256, Norm::Rmsnorm));
    }

    #[test]
    fn heads_that_do_not_fit_are_refused() {
        let t = Transformer { d_model: 8, heads: 2, ..Default::default() };
        assert_eq!(
            problems(Transformer { heads: 3, ..t.clone() }),
            ["wrap.model.heads: 3 heads do not divide d_model = 8 evenly; use a divisor of it"]
        );
        assert!(problems(Transformer { heads: 3, head_dim: Some(4), ..t.clone() }).is_empty());
        assert_eq!(
            problems(Transformer { heads: 4, kv_heads: Some(3), ..t.clone() }),
            ["wrap.model.kv_heads: 3 key/value heads do not divide the 4 query heads (wrap.model.heads): each \
              key/value head serves the same number of query heads; use a divisor of 4"]
        );
        assert_eq!(
            problems(Transformer { max_positions: Some(32), ..t.clone() }),
            ["wrap.model.max_positions: 32 positions are fewer than seq_len = 64: the learned position table has no \
              row for the later tokens of a window"]
        );
        let llama = Transformer { family: Family::Llama, max_positions: Some(32), ..t.clone() };
        assert_eq!(
            problems(llama),
            ["wrap.model.max_positions: 32 positions are fewer than seq_len = 64: the model takes at most 32 positions \
              (a Hugging Face checkpoint's max_position_embeddings); set wrap.model.seq_len to at most 32"]
        );
        let rope = Transformer { positions: Some(Positions::Rope), heads: 1, head_dim: Some(3), ..t.clone() };
        assert_eq!(
            problems(rope),
            ["wrap.model.positions: rotary positions rotate pairs of a head's values, but head_dim is 3 (odd)"]
        );
        assert_eq!(
            problems(Transformer { kv_heads: Some(0), ..t.clone() }),
            ["wrap.model.kv_heads: must be at least 1"]
        );
        assert_eq!(
            problems(Transformer { norm_eps: Some(0.0), rope_theta: Some(f64::NAN), ..t }),
            [
                "wrap.model.norm_eps: must be above 0 and below 1, got 0",
                "wrap.model.rope_theta: must be a finite number above 1, got NaN"
            ]
        );
    }
}
