//! `GPT2LMHeadModel`: names (`transformer.h.{i}.attn.c_attn`, ...; files saved from `GPT2Model`
//! have no `transformer.` prefix), its `Conv1D` weights stored as [inputs, outputs] (the model's
//! linear weights transposed), learned positions, LayerNorm with biases, a GELU MLP.
use serde_json::{json, Map, Value};

use super::config::Json;
use super::{block_of, Part};
use crate::config::schema::{Family, FeedForward, Norm, Positions, Transformer};
use crate::model::transformer::Spec;

/// The model's configuration from GPT-2's keys.
pub fn read(j: &Json) -> Result<Transformer, String> {
    let d = j.count("n_embd")?;
    let heads = j.count("n_head")?;
    let mlp = match j.text_or("activation_function", "gelu_new")? {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => FeedForward::GeluTanh,
        "gelu" => FeedForward::Gelu,
        other => {
            return Err(format!(
                "has activation_function \"{other}\"; the runner's GPT-2 MLP takes \"gelu_new\" (GELU's tanh \
                 approximation) or \"gelu\""
            ))
        }
    };
    for (key, runner) in
        [("scale_attn_by_inverse_layer_idx", false), ("add_cross_attention", false), ("scale_attn_weights", true)]
    {
        if j.flag_or(key, runner)? != runner {
            return Err(format!("has `{key}` = {}; the runner's attention has it {runner}", !runner));
        }
    }
    Ok(Transformer {
        family: Family::Gpt2,
        vocab: j.count("vocab_size")?,
        d_model: d,
        heads,
        kv_heads: Some(heads),
        head_dim: Some(d.checked_div(heads).unwrap_or(0)),
        layers: j.count("n_layer")?,
        max_positions: Some(j.count_or("n_positions", Some(1024))?),
        tied: Some(j.flag_or("tie_word_embeddings", true)?),
        bias: Some(true),
        norm: Some(Norm::Layernorm),
        norm_eps: Some(j.number_or("layer_norm_epsilon", 1e-5)?),
        positions: Some(Positions::Learned),
        rope_theta: None,
        mlp: Some(mlp),
        mlp_hidden: Some(j.count_or("n_inner", Some(4 * d))?),
        ..Transformer::default()
    })
}

/// What keeps a model of `spec` from being a GPT2LMHeadModel.
pub fn differences(s: &Spec) -> Vec<String> {
    let mut out = Vec::new();
    if s.norm != Norm::Layernorm {
        out.push("its norm is not LayerNorm".to_owned());
    }
    if s.positions != Positions::Learned {
        out.push("its positions are not learned".to_owned());
    }
    if s.mlp == FeedForward::Swiglu {
        out.push("its MLP is SwiGLU".to_owned());
    }
    if s.kv_heads != s.heads {
        out.push("it groups key/value heads".to_owned());
    }
    if s.head_dim * s.heads != s.d {
        out.push("its head_dim × heads is not d_model".to_owned());
    }
    if !s.bias {
        out.push("it has no biases".to_owned());
    }
    out
}

/// GPT-2's `config.json` for `s`.
pub fn write(s: &Spec) -> Map<String, Value> {
    let activation = if s.mlp == FeedForward::Gelu { "gelu" } else { "gelu_new" };
    let json = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": s.vocab,
        "n_embd": s.d,
        "n_head": s.heads,
        "n_layer": s.layers,
        "n_positions": s.max_positions,
        "n_inner": s.hidden,
        "activation_function": activation,
        "layer_norm_epsilon": s.eps,
        "tie_word_embeddings": s.tied,
        "embd_pdrop": s.dropout,
        "attn_pdrop": s.dropout,
        "resid_pdrop": s.dropout,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "use_cache": true,
    });
    match json {
        Value::Object(map) => map,
        _ => unreachable!("an object"),
    }
}

/// The checkpoint's tensors that make the model's `ours`; `prefix` is `transformer.` or empty.
pub fn parts(s: &Spec, ours: &str, prefix: &str) -> Vec<Part> {
    let rows = |n: usize| n as i64;
    let plain = |name: &str, n: usize| vec![Part::new(format!("{prefix}{name}"), rows(n))];
    let conv1d =
        |name: String, n: usize| vec![Part { name: format!("{prefix}{name}"), rows: rows(n), transposed: true }];
    match ours {
        "tok.weight" => plain("wte.weight", s.vocab),
        "pos.weight" => plain("wpe.weight", s.max_positions),
        "ln_f.weight" | "ln_f.bias" => plain(ours, s.d),
        "head.weight" => vec![Part::new("lm_head.weight".into(), rows(s.vocab))],
        _ => {
            let (i, rest) = block_of(ours).expect("a block's parameter");
            let h = format!("h.{i}");
            match rest {
                "ln1.weight" => plain(&format!("{h}.ln_1.weight"), s.d),
                "ln1.bias" => plain(&format!("{h}.ln_1.bias"), s.d),
                "ln2.weight" => plain(&format!("{h}.ln_2.weight"), s.d),
                "ln2.bias" => plain(&format!("{h}.ln_2.bias"), s.d),
                "qkv.weight" => conv1d(format!("{h}.attn.c_attn.weight"), 3 * s.d),
                "qkv.bias" => plain(&format!("{h}.attn.c_attn.bias"), 3 * s.d),
                "proj.weight" => conv1d(format!("{h}.attn.c_proj.weight"), s.d),
                "proj.bias" => plain(&format!("{h}.attn.c_proj.bias"), s.d),
                "fc.weight" => conv1d(format!("{h}.mlp.c_fc.weight"), s.hidden),
                "fc.bias" => plain(&format!("{h}.mlp.c_fc.bias"), s.hidden),
                "out.weight" => conv1d(format!("{h}.mlp.c_proj.weight"), s.d),
                "out.bias" => plain(&format!("{h}.mlp.c_proj.bias"), s.d),
                _ => unreachable!("the transformer has no `{ours}`"),
            }
        }
    }
}
