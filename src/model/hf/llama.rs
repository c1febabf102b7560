//! `LlamaForCausalLM`: names (`model.layers.{i}.self_attn.q_proj`, ...), the model's `qkv` made
//! of the q, k and v projections' rows and its `fc` of the gate and up projections' rows, RMSNorm,
//! rotary positions (`rope_theta` inside `rope_parameters` in transformers 5, at the top level in
//! older files), grouped key/value heads, biases on the attention and the MLP or on neither.
use serde_json::{json, Map, Value};

use super::config::Json;
use super::{block_of, Part};
use crate::config::schema::{Family, FeedForward, Norm, Positions, Transformer};
use crate::model::transformer::Spec;

/// The model's configuration from Llama's keys.
pub fn read(j: &Json) -> Result<Transformer, String> {
    let d = j.count("hidden_size")?;
    let heads = j.count("num_attention_heads")?;
    // transformers maps "swish" to the same SiLU.
    let act = j.text_or("hidden_act", "silu")?;
    if !matches!(act, "silu" | "swish") {
        return Err(format!("has hidden_act \"{act}\"; the runner's SwiGLU takes \"silu\" (or \"swish\", the same)"));
    }
    let (attention_bias, mlp_bias) = (j.flag_or("attention_bias", false)?, j.flag_or("mlp_bias", false)?);
    if attention_bias != mlp_bias {
        return Err(format!(
            "has attention_bias = {attention_bias} and mlp_bias = {mlp_bias}; the runner's wrap.model.bias sets both"
        ));
    }
    let rope = rope_theta(j)?;
    Ok(Transformer {
        family: Family::Llama,
        vocab: j.count("vocab_size")?,
        d_model: d,
        heads,
        kv_heads: Some(j.count_or("num_key_value_heads", Some(heads))?),
        head_dim: Some(j.count_or("head_dim", Some(d.checked_div(heads).unwrap_or(0)))?),
        layers: j.count("num_hidden_layers")?,
        max_positions: Some(j.count_or("max_position_embeddings", Some(2048))?),
        tied: Some(j.flag_or("tie_word_embeddings", false)?),
        bias: Some(attention_bias),
        norm: Some(Norm::Rmsnorm),
        norm_eps: Some(j.number_or("rms_norm_eps", 1e-6)?),
        positions: Some(Positions::Rope),
        rope_theta: Some(rope),
        mlp: Some(FeedForward::Swiglu),
        mlp_hidden: Some(j.count("intermediate_size")?),
        ..Transformer::default()
    })
}

/// RoPE's base: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (older files); a
/// scaled RoPE (Llama 3.1's, YaRN, ...) is refused.
fn rope_theta(j: &Json) -> Result<f64, String> {
    let params = match j.get("rope_parameters").or_else(|| j.get("rope_scaling")) {
        Some(Value::Object(p)) => Some(p),
        Some(v) => return Err(format!("`rope_parameters` is {v}, not an object")),
        None => None,
    };
    let kind = params.and_then(|p| p.get("rope_type").or_else(|| p.get("type"))).and_then(Value::as_str);
    if let Some(kind) = kind.filter(|k| *k != "default") {
        return Err(format!(
            "scales its rotary positions (rope_type \"{kind}\"); the runner's RoPE is the default, unscaled one"
        ));
    }
    match params.and_then(|p| p.get("rope_theta")) {
        Some(v) => v.as_f64().ok_or_else(|| format!("`rope_parameters.rope_theta` is {v}, not a number")),
        None => j.number_or("rope_theta", 10000.0),
    }
}

/// What keeps a model of `spec` from being a LlamaForCausalLM.
pub fn differences(s: &Spec) -> Vec<String> {
    let mut out = Vec::new();
    if s.norm != Norm::Rmsnorm {
        out.push("its norm is not RMSNorm".to_owned());
    }
    if s.positions != Positions::Rope {
        out.push("its positions are not rotary".to_owned());
    }
    if s.mlp != FeedForward::Swiglu {
        out.push("its MLP is not SwiGLU".to_owned());
    }
    out
}

/// Llama's `config.json` for `s`: `rope_theta` both inside `rope_parameters` (transformers 5) and
/// at the top level (older readers).
pub fn write(s: &Spec) -> Map<String, Value> {
    let json = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.d,
        "intermediate_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.max_positions,
        "rms_norm_eps": s.eps,
        "rope_parameters": {"rope_theta": s.rope_theta, "rope_type": "default"},
        "rope_theta": s.rope_theta,
        "hidden_act": "silu",
        "attention_bias": s.bias,
        "mlp_bias": s.bias,
        "attention_dropout": s.dropout,
        "tie_word_embeddings": s.tied,
        "pretraining_tp": 1,
        "use_cache": true,
    });
    match json {
        Value::Object(map) => map,
        _ => unreachable!("an object"),
    }
}

/// The checkpoint's tensors that make the model's `ours`.
pub fn parts(s: &Spec, ours: &str) -> Vec<Part> {
    let one = |name: String, n: usize| vec![Part::new(name, n as i64)];
    match ours {
        "tok.weight" => one("model.embed_tokens.weight".into(), s.vocab),
        "ln_f.weight" => one("model.norm.weight".into(), s.d),
        "head.weight" => one("lm_head.weight".into(), s.vocab),
        _ => {
            let (i, rest) = block_of(ours).expect("a block's parameter");
            let (layer, suffix) = (format!("model.layers.{i}"), rest.rsplit_once('.').map_or("", |(_, s)| s));
            let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
            let attn = |p: &str| format!("{layer}.self_attn.{p}.{suffix}");
            let mlp = |p: &str| format!("{layer}.mlp.{p}.{suffix}");
            match rest {
                "ln1.weight" => one(format!("{layer}.input_layernorm.weight"), s.d),
                "ln2.weight" => one(format!("{layer}.post_attention_layernorm.weight"), s.d),
                "qkv.weight" | "qkv.bias" => vec![
                    Part::new(attn("q_proj"), q as i64),
                    Part::new(attn("k_proj"), kv as i64),
                    Part::new(attn("v_proj"), kv as i64),
                ],
                "proj.weight" | "proj.bias" => one(attn("o_proj"), s.d),
                "fc.weight" | "fc.bias" => {
                    vec![Part::new(mlp("gate_proj"), s.hidden as i64), Part::new(mlp("up_proj"), s.hidden as i64)]
                }
                "out.weight" | "out.bias" => one(mlp("down_proj"), s.d),
                _ => unreachable!("a Llama block has no `{ours}`"),
            }
        }
    }
}
