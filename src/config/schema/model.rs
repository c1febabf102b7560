//! `[wrap.model]`: the model kinds and their shapes.
use super::*;

/// The model: `kind` picks the architecture, the other keys are that kind's own. One variant per
/// kind; each kind's module in `crate::model` implements its architecture.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Model {
    /// Linear layers with an activation between them, over rows of features.
    Mlp(Mlp),
    /// Convolution blocks over images (N × C × H × W), then linear layers.
    Cnn(Cnn),
    /// A module scripted or traced in PyTorch, with its own initial weights.
    Torchscript(Torchscript),
    /// A decoder-only language model over windows of token ids.
    Transformer(Transformer),
}

impl Default for Model {
    fn default() -> Self {
        Model::Mlp(Mlp::default())
    }
}

/// `[wrap.model]` may leave `kind` out: it is "mlp", as before kinds existed. serde's tagged
/// enums have no default tag, so the table is read whole and given one.
pub(super) fn model_of_default_kind<'de, D: Deserializer<'de>>(d: D) -> Result<Model, D::Error> {
    use serde::de::Error;
    let mut table = toml::Table::deserialize(d)?;
    table.entry("kind").or_insert_with(|| "mlp".into());
    Model::deserialize(toml::Value::Table(table)).map_err(|e| D::Error::custom(e.message()))
}

/// `kind = "mlp"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Mlp {
    /// Widths of the hidden layers.
    pub hidden: Vec<usize>,
    /// The activation after each hidden layer.
    pub activation: Activation,
    /// Dropout probability after each hidden activation.
    pub dropout: f64,
}

impl Default for Mlp {
    fn default() -> Self {
        Mlp { hidden: vec![64, 64], activation: Activation::Relu, dropout: 0.0 }
    }
}

/// `kind = "cnn"`: the `conv` blocks in order, then the `hidden` linear layers and the output layer
/// (the first linear layer flattens the last block's C × H × W).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Cnn {
    /// The convolution blocks, in order: a list of tables (the keys below).
    pub conv: Vec<ConvBlock>,
    /// Widths of the hidden linear layers after the convolutions.
    pub hidden: Vec<usize>,
    /// After every convolution (after its batch norm) and every hidden linear layer.
    pub activation: Activation,
    /// Dropout probability after each hidden linear layer's activation.
    pub dropout: f64,
}

impl Default for Cnn {
    fn default() -> Self {
        Cnn {
            conv: vec![
                ConvBlock { channels: 16, ..ConvBlock::default() },
                ConvBlock { channels: 32, ..ConvBlock::default() },
            ],
            hidden: vec![64],
            activation: Activation::Relu,
            dropout: 0.0,
        }
    }
}

/// One convolution block: conv2d → batch norm (optional) → activation → pooling (optional) →
/// dropout (optional). One layer of the model: a pipeline may cut between blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ConvBlock {
    /// Output channels.
    pub channels: usize,
    /// Square kernel side, in pixels.
    pub kernel: usize,
    /// The convolution's step, in pixels.
    pub stride: usize,
    /// Zeros added on each side, in pixels.
    pub padding: usize,
    /// Batch normalization after the convolution (running statistics: momentum 0.1, eps 1e-5).
    pub batch_norm: bool,
    /// Pooling after the activation: "max", "avg" or "none".
    pub pool: Pool,
    /// Pooling window side (and stride), in pixels.
    pub pool_size: usize,
    /// Dropout probability at the end of the block.
    pub dropout: f64,
}

impl Default for ConvBlock {
    fn default() -> Self {
        ConvBlock {
            channels: 16,
            kernel: 3,
            stride: 1,
            padding: 1,
            batch_norm: false,
            pool: Pool::None,
            pool_size: 2,
            dropout: 0.0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    None,
    Max,
    Avg,
}

/// `kind = "torchscript"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Torchscript {
    /// The module `torch.jit.script(model).save(path)` (or `torch.jit.trace`) wrote, relative to
    /// the pipeline file: one input tensor (a batch of the data's samples) to one output tensor
    /// (a batch of logits over the classes).
    pub path: PathBuf,
}

/// `kind = "transformer"`: a decoder-only language model: token embeddings, `layers` pre-norm
/// blocks (causal self-attention, then an MLP), a final norm and an output head over the
/// vocabulary. `family` sets the defaults of the block's parts, GPT-2's or Llama's; each part can
/// be set on its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Transformer {
    /// The defaults of the parts left unset: "gpt2" (learned positions, LayerNorm, a GELU MLP of
    /// 4 × d_model, biases, the head tied to the embedding) or "llama" (rotary positions, RMSNorm,
    /// a SwiGLU MLP, no biases, a head of its own).
    #[serde(skip_serializing_if = "is_default")]
    pub family: Family,
    /// Token ids 0..vocab (256 for `load.source = "text"`).
    pub vocab: usize,
    /// Width of the embeddings and of every block.
    pub d_model: usize,
    /// Attention (query) heads per block; must divide d_model unless head_dim is set.
    pub heads: usize,
    /// Key and value heads per block (grouped-query attention: each serves heads / kv_heads
    /// query heads); must divide heads. Default: heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// Width of each attention head. Default: d_model / heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Transformer blocks.
    pub layers: usize,
    /// Tokens per window (the context length); the data is cut into windows of seq_len + 1.
    pub seq_len: usize,
    /// The longest context the model takes: the rows of the learned position table (at least
    /// seq_len), and what an export records. Default: seq_len.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_positions: Option<usize>,
    /// Dropout probability on the embeddings, the attention weights and each residual branch.
    pub dropout: f64,
    /// The output head is the token embedding (transposed) instead of a matrix of its own.
    /// Default: by family (gpt2 true, llama false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tied: Option<bool>,
    /// Biases in the linear layers (and in LayerNorm); false: weights only (nanoGPT's and
    /// Llama's choice). Default: by family (gpt2 true, llama false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias: Option<bool>,
    /// The norm before each block's attention and MLP and before the head: "layernorm" or
    /// "rmsnorm" (no mean subtracted, no bias). Default: by family (gpt2 "layernorm", llama
    /// "rmsnorm").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm: Option<Norm>,
    /// The norms' epsilon, added to the variance. Default: by family (gpt2 1e-5, llama 1e-6, as
    /// transformers' configurations).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// How the model knows positions: "learned" (a table of max_positions × d_model added to the
    /// token embeddings) or "rope" (rotary embeddings of the queries and keys, in Hugging Face's
    /// rotate-half layout). Default: by family (gpt2 "learned", llama "rope").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub positions: Option<Positions>,
    /// RoPE's base wavelength (`positions = "rope"`). Default: 10000.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// The MLP: "gelu" (exact GELU), "gelu_tanh" (its tanh approximation, GPT-2's own) or
    /// "swiglu" (silu(x W_gate) × x W_up, then W_down). Default: by family (gpt2 "gelu", as
    /// nanoGPT; llama "swiglu").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp: Option<FeedForward>,
    /// The MLP's hidden width. Default: 4 × d_model with GELU; with SwiGLU, 2/3 of that rounded
    /// up to a multiple of 256 (Llama's rule).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp_hidden: Option<usize>,
}

impl Default for Transformer {
    fn default() -> Self {
        Transformer {
            family: Family::Gpt2,
            vocab: 256,
            d_model: 64,
            heads: 4,
            kv_heads: None,
            head_dim: None,
            layers: 2,
            seq_len: 64,
            max_positions: None,
            dropout: 0.0,
            tied: None,
            bias: None,
            norm: None,
            norm_eps: None,
            positions: None,
            rope_theta: None,
            mlp: None,
            mlp_hidden: None,
        }
    }
}

/// The family of a transformer: the defaults of its parts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// GPT-2's (and nanoGPT's) block.
    #[default]
    Gpt2,
    /// Llama's block.
    Llama,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    /// Mean and variance normalised, then scaled (and shifted, with biases).
    Layernorm,
    /// Root mean square normalised, then scaled.
    Rmsnorm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Positions {
    /// A learned embedding per position, added to the token embeddings.
    Learned,
    /// Rotary position embeddings of the queries and keys.
    Rope,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FeedForward {
    /// Two linear layers around an exact GELU.
    Gelu,
    /// Two linear layers around GELU's tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    /// A gated linear unit with SiLU: three matrices.
    Swiglu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    Relu,
    Tanh,
    Gelu,
}
