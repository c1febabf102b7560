//! Hugging Face checkpoints in and out, against transformers' own classes
//! (`tests/fixtures/hf_twin.py`, tiny models made locally from a config, nothing downloaded):
//! a `LlamaForCausalLM` (grouped-query attention, RoPE, an untied head) and a `GPT2LMHeadModel`
//! (tied, Conv1D weights) imported give transformers' logits and the losses of 20 steps of
//! `torch.optim.AdamW` on the HF module; the shipped fine-tune (pipelines/llama_finetune.toml: a
//! sharded checkpoint imported under FSDP at 2 ranks, a BPE tokenizer), exported sharded, loads in
//! `from_pretrained` with no missing or unexpected key, the same logits, the same tokenizer ids, the
//! same greedy text as `runner predict` and the same loss as `runner eval`; and the refusals, each
//! pinned.
use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{assert_ok, reference_python, run, runner, text, write};
use polars::prelude::ChunkCompareEq;
use runner::config::schema::Model;
use tch::{nn, Kind, Tensor};

/// Windows of `SEQ` + 1 tokens: `ROWS` to train on, `VAL` held out.
pub(crate) const SEQ: usize = 16;
const ROWS: usize = 16;
const VAL: usize = 4;
const STEPS: usize = 20;

/// One step per epoch on all 16 windows: the same batch as the twin's at every step.
pub(crate) const TWIN: &str = r#"
[run]
name = "twin"
seed = 3
timeout_s = 60
threads_per_rank = 1

[load]
source = "text"
path = "book.txt"
rows = 20

[normalize]
method = "none"

[wrap]
init = "INIT"

[wrap.model]
kind = "transformer"
seq_len = 16

[train]
epochs = 20
batch_size = 16
optimizer = "adamw"
lr = 0.002
weight_decay = 0.01

[validate]
every = 0
rows = 4
"#;

/// Runs the twin script; its JSON line.
pub(crate) fn python(dir: &Path, args: &[&str]) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_twin.py");
    let o = Command::new(reference_python())
        .arg(script)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .current_dir(dir)
        .output()
        .expect("python");
    let (out, err) = text(&o);
    assert!(o.status.success(), "hf_twin.py {args:?} failed:\n{out}\n{err}");
    serde_json::from_str(out.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The first `n` windows of `tokens` at stride SEQ: inputs and next tokens, as the runner cuts them.
pub(crate) fn windows(tokens: &[i64], n: usize) -> (Tensor, Tensor) {
    let cut = |shift: usize| -> Vec<i64> {
        (0..n).flat_map(|i| tokens[i * SEQ + shift..i * SEQ + shift + SEQ].to_vec()).collect()
    };
    let shape = [n as i64, SEQ as i64];
    (Tensor::from_slice(&cut(0)).view(shape), Tensor::from_slice(&cut(1)).view(shape))
}

pub(crate) fn save_windows(path: &Path, (x, y): &(Tensor, Tensor)) {
    Tensor::write_safetensors(&[("x", x), ("y", y)], path).unwrap();
}

pub(crate) fn read(path: &Path, name: &str) -> Tensor {
    Tensor::read_safetensors(path).unwrap().into_iter().find(|(n, _)| n == name).unwrap().1
}

/// The runner's logits on `x` for `model` with the weights of `init` (a checkpoint directory or
/// a weights file), computed by its own model code and loader.
pub(crate) fn runner_logits(model: &Model, init: &Path, x: &Tensor) -> Tensor {
    let arch = runner::model::architecture(model, &[SEQ], 0, None);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = arch.build(&vs.root(), 0..arch.layers().len(), &runner::model::BuildContext::new(0));
    runner::model::load_init(init, model, &vs).unwrap();
    tch::no_grad(|| net.forward_t(x, false))
}

/// The model a run directory's plan describes.
fn run_model(run_dir: &Path) -> Model {
    let plan = runner::plan::Plan::load(&run_dir.join("plan.json")).unwrap();
    plan.config.wrap.model
}

pub(crate) fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    assert_eq!(a.size(), b.size(), "{what}");
    let diff = (a - b).abs().max().double_value(&[]);
    assert!(diff < tol, "{what}: logits differ by up to {diff}");
}

fn trace_losses(run_dir: &Path) -> Vec<f64> {
    let df = common::trace(run_dir);
    let rows = df.filter(&df.column("rank").unwrap().u32().unwrap().equal(0)).unwrap();
    rows.column("global_train_loss").unwrap().f64().unwrap().into_no_null_iter().collect()
}

/// A tiny model of `arch`, imported: step-0 logits and 20 AdamW steps against transformers.
fn twin(dir: &Path, arch: &str, make: &[&str]) {
    let made = python(dir, &[&["make", "--arch", arch, "--out", arch], make].concat());
    assert_eq!(made["files"], serde_json::json!(["config.json", "generation_config.json", "model.safetensors"]));
    let tokens: Vec<i64> = std::fs::read(dir.join("book.txt")).unwrap().iter().map(|&b| b as i64).collect();
    let w = windows(&tokens, ROWS);
    save_windows(&dir.join("windows.safetensors"), &w);
    let logits0 = format!("{arch}-logits0.safetensors");
    let theirs = python(dir, &["train", arch, "--windows", "windows.safetensors", "--logits-out", &logits0]);
    let (_, model) = runner::model::hf::read_config(&dir.join(arch)).unwrap();
    let model = Model::Transformer(runner::config::schema::Transformer { seq_len: SEQ, ..model });
    let ours = runner_logits(&model, &dir.join(arch), &w.0);
    assert_close(&ours, &read(&dir.join(&logits0), "logits"), 1e-5, &format!("{arch} at step 0"));

    write(dir, "twin.toml", &TWIN.replace("INIT", arch));
    assert_ok(&run(&["run", "twin.toml", "--out", &format!("{arch}-run")], dir));
    let ours = trace_losses(&dir.join(format!("{arch}-run")));
    let theirs: Vec<f64> = theirs["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
    assert_eq!((ours.len(), theirs.len()), (STEPS, STEPS));
    for (s, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!(((a - b) / b).abs() < 1e-5, "{arch}, step {}: runner {a}, transformers {b}", s + 1);
    }
    assert!(ours[STEPS - 1] < ours[0] - 0.5, "{arch} learns: {ours:?}");
}

#[test]
fn llama_and_gpt2_imported_give_transformers_logits_and_adamw_losses() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let book: String = (0..200).map(|i| format!("{i}: to be, or not to be, that is the question. ")).collect();
    write(p, "book.txt", &book[..(ROWS + VAL) * SEQ + 1]);
    // Grouped-query attention (2 key/value heads for 4), RoPE, an untied head.
    twin(p, "llama", &["--kv-heads", "2", "--hidden", "48", "--rope-theta", "500"]);
    // GPT-2's tied head, learned positions, Conv1D weights and gelu_new.
    twin(p, "gpt2", &["--tied", "--hidden", "80", "--positions", "24"]);

    // The trained GPT-2 exported: Conv1D weights transposed back, the tied head left out.
    let run_dir = p.join("gpt2-run");
    assert_ok(&run(&["export", "gpt2-run", "--hf", "gpt2-out"], p));
    let model = run_model(&run_dir);
    let w = windows(&std::fs::read(p.join("book.txt")).unwrap().iter().map(|&b| b as i64).collect::<Vec<_>>(), 4);
    save_windows(&p.join("check.safetensors"), &w);
    let got = python(
        p,
        &[
            "check",
            "gpt2-out",
            "--windows",
            "check.safetensors",
            "--logits-out",
            "out.safetensors",
            "--prompt",
            "116,111",
            "--new",
            "4",
        ],
    );
    assert_eq!(
        (&got["class"], &got["missing_keys"], &got["unexpected_keys"]),
        (&serde_json::json!("GPT2LMHeadModel"), &serde_json::json!([]), &serde_json::json!([]))
    );
    let ours = runner_logits(&model, &run_dir.join("model.safetensors"), &w.0);
    assert_close(&ours, &read(&p.join("out.safetensors"), "logits"), 1e-5, "the exported GPT-2");
}

/// The token ids of a prepared token file (uint16).
fn token_ids(path: &Path) -> Vec<i64> {
    std::fs::read(path).unwrap().chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as i64).collect()
}

/// Runs a script of the repository with the reference Python in `dir`; its stdout.
fn script(dir: &Path, path: &str, args: &[&str]) -> String {
    let o = Command::new(reference_python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .current_dir(dir)
        .output()
        .expect("python");
    let (out, err) = text(&o);
    assert!(o.status.success(), "{path} {args:?} failed:\n{out}\n{err}");
    out
}

/// The workflow of docs/guide/hugging-face.md, shortened to 6 steps: a BPE trained on The
/// Tempest, a tiny Llama made by `scripts/tiny_llama.py` and saved in shards, the shipped
/// pipelines/llama_finetune.toml fine-tuning it under FSDP at 2 ranks, exported sharded with its
/// tokenizer. transformers loads the export with no missing or unexpected key; its logits are the
/// runner's; AutoTokenizer gives the runner's ids for the whole text; greedy generation is
/// `runner predict --top-k 1`'s text; its loss over the validation file is `runner eval`'s.
#[test]
fn the_llama_finetune_workflow_exports_to_transformers_with_the_same_ids_logits_tokens_and_loss() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tempest = repo.join("pipelines/data/tempest.txt");
    std::fs::create_dir_all(p.join("pipelines")).unwrap();
    let shipped = std::fs::read_to_string(repo.join("pipelines/llama_finetune.toml")).unwrap();
    write(&p.join("pipelines"), "llama_finetune.toml", &shipped);
    let bpe = ["--tokenizer", "bpe", "--vocab", "512"];
    assert_ok(&run(
        &[&["prepare", "text", tempest.to_str().unwrap(), "--out", "data/tempest-bpe"][..], &bpe].concat(),
        p,
    ));
    // Shards of at most 200 kB: several files and an index.
    let made = script(p, "scripts/tiny_llama.py", &["make", "--out", "models/tiny-llama", "--max-shard-size", "200KB"]);
    assert!(made.contains("LlamaForCausalLM of 158016 parameters"), "{made}");
    assert!(p.join("models/tiny-llama/model.safetensors.index.json").is_file());

    let short = ["train.steps=6", "train.schedule.warmup_steps=2", "validate.every_steps=6", "validate.batches=2"];
    let sets: Vec<&str> = short.iter().flat_map(|s| ["--set", s]).collect();
    // Under FSDP at 2 ranks each rank reads only its rows of the checkpoint's shards.
    let counts = p.join("read");
    std::fs::create_dir_all(&counts).unwrap();
    let o = runner()
        .args([&["run", "pipelines/llama_finetune.toml", "--out", "tuned"][..], &sets].concat())
        .env("RUNNER_TEST_READ_BYTES", &counts)
        .current_dir(p)
        .output()
        .unwrap();
    assert_ok(&o);
    let total: u64 = std::fs::read_dir(p.join("models/tiny-llama"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
        .map(|f| {
            let bytes = std::fs::read(&f).unwrap();
            bytes.len() as u64 - 8 - u64::from_le_bytes(bytes[..8].try_into().unwrap())
        })
        .sum();
    let ranks: Vec<u64> =
        (0..2).map(|r| std::fs::read_to_string(counts.join(format!("rank-{r}"))).unwrap().parse().unwrap()).collect();
    for (r, &bytes) in ranks.iter().enumerate() {
        assert!(bytes * 100 <= total * 55, "rank {r} read {bytes} of the checkpoint's {total} bytes");
    }
    assert!(ranks.iter().sum::<u64>() >= total, "the ranks read {ranks:?}, the checkpoint holds {total} bytes");
    let o = run(&["export", "tuned", "--hf", "out", "--max-shard-size", "200KB"], p);
    assert_ok(&o);
    let (stdout, _) = text(&o);
    for part in ["LlamaForCausalLM", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"] {
        assert!(stdout.contains(part), "{part}: {stdout}");
    }
    assert!(!p.join("out.tmp").exists());

    let w = windows(&token_ids(&p.join("data/tempest-bpe/val.bin")), 3);
    save_windows(&p.join("check.safetensors"), &w);
    let o = run(&["eval", "tuned", "data/tempest-bpe/val.bin", "--json"], p);
    assert_ok(&o);
    let eval: serde_json::Value = serde_json::from_str(&text(&o).0).unwrap();
    let got = python(
        p,
        &[
            "check",
            "out",
            "--windows",
            "check.safetensors",
            "--logits-out",
            "out.safetensors",
            "--prompt-text",
            "PROSPERO:",
            "--new",
            "12",
            "--text",
            tempest.to_str().unwrap(),
            "--eval-data",
            "data/tempest-bpe/val.bin",
            "--seq-len",
            "128",
        ],
    );
    assert_eq!((&got["missing_keys"], &got["unexpected_keys"]), (&serde_json::json!([]), &serde_json::json!([])));
    let ours = runner_logits(&run_model(&p.join("tuned")), &p.join("tuned/model.safetensors"), &w.0);
    assert_close(&ours, &read(&p.join("out.safetensors"), "logits"), 1e-5, "the exported Llama");

    // The tokenizer: AutoTokenizer's ids for the whole text are the prepared files' (train, then
    // validation).
    let ids: Vec<i64> =
        ["train.bin", "val.bin"].iter().flat_map(|f| token_ids(&p.join("data/tempest-bpe").join(f))).collect();
    let theirs: Vec<i64> = got["text_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    assert_eq!(theirs.len(), ids.len(), "AutoTokenizer's token count");
    assert!(theirs == ids, "AutoTokenizer's ids differ from the runner's");

    // Greedy decoding: runner predict's top-1 draws against transformers' generate, as text.
    let o = run(&["predict", "tuned", "--prompt", "PROSPERO:", "--tokens", "12", "--top-k", "1"], p);
    assert_ok(&o);
    assert_eq!(text(&o).0, format!("{}\n", got["text"].as_str().unwrap()));

    // runner eval against the export's loss in PyTorch over the same windows.
    assert_eq!(eval["windows"], got["eval"]["windows"]);
    for key in ["loss", "accuracy"] {
        let (a, b) = (eval[key].as_f64().unwrap(), got["eval"][key].as_f64().unwrap());
        assert!((a - b).abs() < 1e-5, "{key}: runner eval {a}, the export in PyTorch {b}");
    }
}

/// A checkpoint directory written here: `config` and one tensor per (name, shape).
pub(crate) fn checkpoint(dir: &Path, name: &str, config: &str, tensors: &[(String, Vec<i64>)]) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("config.json"), config).unwrap();
    let values: Vec<(String, Tensor)> =
        tensors.iter().map(|(n, s)| (n.clone(), Tensor::ones(s.as_slice(), (Kind::Float, tch::Device::Cpu)))).collect();
    Tensor::write_safetensors(&values, d.join("model.safetensors")).unwrap();
    d
}

/// A Llama of width 8 (2 heads of 4, 1 key/value head), 1 block, SwiGLU of 12: its tensors.
pub(crate) fn llama_tensors() -> Vec<(String, Vec<i64>)> {
    let l = "model.layers.0";
    [
        ("model.embed_tokens.weight", vec![256, 8]),
        ("model.norm.weight", vec![8]),
        ("lm_head.weight", vec![256, 8]),
        (&format!("{l}.input_layernorm.weight"), vec![8]),
        (&format!("{l}.post_attention_layernorm.weight"), vec![8]),
        (&format!("{l}.self_attn.q_proj.weight"), vec![8, 8]),
        (&format!("{l}.self_attn.k_proj.weight"), vec![4, 8]),
        (&format!("{l}.self_attn.v_proj.weight"), vec![4, 8]),
        (&format!("{l}.self_attn.o_proj.weight"), vec![8, 8]),
        (&format!("{l}.mlp.gate_proj.weight"), vec![12, 8]),
        (&format!("{l}.mlp.up_proj.weight"), vec![12, 8]),
        (&format!("{l}.mlp.down_proj.weight"), vec![8, 12]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect()
}

pub(crate) const LLAMA: &str = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 8,
 "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1, "intermediate_size": 12,
 "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}"#;

/// `runner validate` with `wrap.init = NAME`: refused (exit 2), its message.
pub(crate) fn refused(dir: &Path, init: &str, extra: &[&str]) -> String {
    write(dir, "p.toml", &TWIN.replace("INIT", init));
    let mut args = vec!["validate", "p.toml"];
    for s in extra {
        args.extend(["--set", s]);
    }
    let o = run(&args, dir);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn checkpoints_that_do_not_fit_are_refused_by_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "book.txt", &"to be, or not to be. ".repeat(40));
    checkpoint(p, "good", LLAMA, &llama_tensors());
    write(p, "p.toml", &TWIN.replace("INIT", "good"));
    let o = run(&["validate", "p.toml"], p);
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(out.contains("Transformer LM (vocab 256, d_model 8, 2 heads (1 key/value), 1 blocks, context 16, no biases, RMSNorm, RoPE, SwiGLU MLP of 12)"), "{out}");

    let bert = r#"{"architectures": ["BertForMaskedLM"], "model_type": "bert"}"#;
    checkpoint(p, "bert", bert, &[]);
    let err = refused(p, "bert", &[]);
    assert!(err.contains(
        "`wrap.init` (file p.toml:17): bert/config.json: it describes a BertForMaskedLM, an architecture the runner \
         does not have; it imports GPT2LMHeadModel and LlamaForCausalLM"
    ), "{err}");

    let mut tensors = llama_tensors();
    tensors.retain(|(n, _)| n != "model.layers.0.mlp.up_proj.weight");
    tensors[1].1 = vec![16];
    tensors.push(("model.layers.0.self_attn.q_proj.bias".into(), vec![8]));
    checkpoint(p, "bad", LLAMA, &tensors);
    let err = refused(p, "bad", &[]);
    assert!(
        err.contains(
            "`wrap.init` (file p.toml:17): bad does not fit its config.json (LlamaForCausalLM): no \
         `model.layers.0.mlp.up_proj.weight`; `model.norm.weight` is [16], config.json makes it [8]; unexpected \
         `model.layers.0.self_attn.q_proj.bias`"
        ),
        "{err}"
    );

    checkpoint(
        p,
        "gqa",
        &LLAMA.replace(
            "\"num_attention_heads\": 2, \"num_key_value_heads\": 1",
            "\"num_attention_heads\": 4, \"num_key_value_heads\": 3, \"head_dim\": 2",
        ),
        &llama_tensors(),
    );
    let err = refused(p, "gqa", &[]);
    assert!(
        err.contains(
            "`wrap.model.kv_heads` (wrap.init config.json): 3 key/value heads do not divide the 4 query heads \
         (wrap.model.heads): each key/value head serves the same number of query heads; use a divisor of 4"
        ),
        "{err}"
    );

    let err = refused(p, "good", &["wrap.model.heads=4", "wrap.model.tied=false", "wrap.model.family=\"gpt2\""]);
    assert!(
        err.contains(
            "`wrap.model.heads` (--set wrap.model.heads=4): is 4, but good/config.json (LlamaForCausalLM) makes it 2: \
         remove it from [wrap.model] (the checkpoint sets it), or give another wrap.init"
        ),
        "{err}"
    );
    assert!(err.contains("`wrap.model.family` (--set wrap.model.family=\"gpt2\"): is \"gpt2\", but good/config.json (LlamaForCausalLM) makes it \"llama\""), "{err}");
    assert!(!err.contains("wrap.model.tied"), "an agreeing key is no problem: {err}");
}

/// What transformers reads otherwise than a plain checkpoint: quantized weights are refused by
/// name; `hidden_act = "swish"` is transformers' SiLU, so the model is the same.
#[test]
fn quantized_weights_are_refused_and_swish_is_silu() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "book.txt", &"to be, or not to be. ".repeat(40));
    let quantized = LLAMA.replace(
        "\"vocab_size\"",
        "\"quantization_config\": {\"quant_method\": \"bitsandbytes\", \"load_in_4bit\": true}, \"vocab_size\"",
    );
    checkpoint(p, "q", &quantized, &llama_tensors());
    let err = refused(p, "q", &[]);
    assert!(
        err.contains(
            "q/config.json: has a `quantization_config` (quant_method \"bitsandbytes\"): its weights are quantized, \
             and the runner reads only full-precision weights"
        ),
        "{err}"
    );
    checkpoint(
        p,
        "swish",
        &LLAMA.replace("\"vocab_size\"", "\"hidden_act\": \"swish\", \"vocab_size\""),
        &llama_tensors(),
    );
    write(p, "p.toml", &TWIN.replace("INIT", "swish"));
    let o = run(&["validate", "p.toml"], p);
    assert_ok(&o);
    assert!(text(&o).0.contains("RoPE, SwiGLU MLP of 12)"), "{}", text(&o).0);
}
