//! Hugging Face directories that are not what their config.json says, read as transformers'
//! `from_pretrained` reads them (its logits on the same windows, from `tests/fixtures/hf_twin.py`):
//! a config that ties the head while the file holds a head of other values (kept apart), of the
//! same values (tied) or a head and no embedding (the embedding is the head); a directory with
//! both `model.safetensors` and shards (the single file). And a context longer than the
//! checkpoint's `max_position_embeddings`, refused.
use crate::common;
use crate::hf::{
    assert_close, checkpoint, llama_tensors, python, read, refused, runner_logits, save_windows, LLAMA, SEQ,
};

use std::path::Path;
use std::process::Command;

use common::{reference_python, text, write};
use runner::config::schema::{Model, Transformer};
use tch::{Kind, Tensor};

/// Rewrites `dir/model.safetensors` in Python: `code` edits `t`, the dict of its tensors.
fn edit(dir: &Path, code: &str) {
    const SCRIPT: &str = "import sys, torch\nfrom safetensors.torch import load_file, save_file\n\
        t = load_file(sys.argv[1])\ntorch.manual_seed(1)\nexec(sys.argv[2])\n\
        save_file({k: v.contiguous() for k, v in t.items()}, sys.argv[1], metadata={'format': 'pt'})\n";
    let file = dir.join("model.safetensors");
    let o = Command::new(reference_python()).args(["-c", SCRIPT]).arg(&file).arg(code).output().unwrap();
    assert!(o.status.success(), "editing {}: {}", file.display(), text(&o).1);
}

/// The runner's logits and transformers' on `x` for the checkpoint `name`, and whether the runner
/// read its head as tied.
fn compare(dir: &Path, name: &str, x: &Tensor) -> bool {
    let logits = format!("{name}-logits.safetensors");
    let theirs =
        python(dir, &["train", name, "--windows", "windows.safetensors", "--logits-out", &logits, "--steps", "0"]);
    let (_, model) = runner::model::hf::read_config(&dir.join(name)).unwrap();
    let tied = model.tied.unwrap();
    let ours = runner_logits(&Model::Transformer(Transformer { seq_len: SEQ, ..model }), &dir.join(name), x);
    assert_close(&ours, &read(&dir.join(&logits), "logits"), 1e-5, &format!("{name}: {theirs}"));
    tied
}

fn windows(dir: &Path) -> Tensor {
    tch::manual_seed(5);
    let ids = Tensor::randint(256, [4, SEQ as i64 + 1], (Kind::Int64, tch::Device::Cpu));
    let (x, y) = (ids.narrow(1, 0, SEQ as i64), ids.narrow(1, 1, SEQ as i64));
    save_windows(&dir.join("windows.safetensors"), &(x.contiguous(), y.contiguous()));
    x.contiguous()
}

#[test]
fn a_tied_config_s_head_is_read_as_transformers_reads_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let x = windows(p);
    python(p, &["make", "--arch", "llama", "--out", "llama", "--tied"]);
    python(p, &["make", "--arch", "gpt2", "--out", "gpt2", "--tied"]);
    for (arch, name, code, tied) in [
        // A head of its own, other values: transformers keeps it apart (the runner dropped it).
        ("llama", "llama-apart", "t['lm_head.weight'] = torch.randn_like(t['model.embed_tokens.weight'])", false),
        ("gpt2", "gpt2-apart", "t['lm_head.weight'] = torch.randn_like(t['transformer.wte.weight'])", false),
        // A head of the embedding's values: tied.
        ("llama", "llama-same", "t['lm_head.weight'] = t['model.embed_tokens.weight'].clone()", true),
        // A head and no embedding: the embedding is the head.
        ("llama", "llama-head", "t['lm_head.weight'] = t.pop('model.embed_tokens.weight')", true),
    ] {
        std::fs::create_dir(p.join(name)).unwrap();
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(p.join(arch).join(file), p.join(name).join(file)).unwrap();
        }
        edit(&p.join(name), code);
        assert_eq!(compare(p, name, &x), tied, "{name}");
    }
}

#[test]
fn a_directory_with_a_file_and_shards_is_read_from_the_file_as_transformers_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let x = windows(p);
    let made = python(p, &["make", "--arch", "llama", "--out", "both", "--max-shard-size", "20KB"]);
    assert!(made["files"].as_array().unwrap().iter().any(|f| f == "model.safetensors.index.json"), "{made}");
    python(p, &["make", "--arch", "llama", "--out", "single", "--seed", "1"]);
    std::fs::copy(p.join("single/model.safetensors"), p.join("both/model.safetensors")).unwrap();
    compare(p, "both", &x);
}

#[test]
fn a_context_longer_than_the_checkpoint_s_positions_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "book.txt", &"to be, or not to be. ".repeat(40));
    let short = LLAMA.replace("\"intermediate_size\": 12", "\"intermediate_size\": 12, \"max_position_embeddings\": 8");
    checkpoint(p, "short", &short, &llama_tensors());
    let err = refused(p, "short", &[]);
    assert!(
        err.contains(
            "`wrap.model.max_positions` (wrap.init config.json): 8 positions are fewer than seq_len = 16: the model \
             takes at most 8 positions (a Hugging Face checkpoint's max_position_embeddings); set wrap.model.seq_len \
             to at most 8"
        ),
        "{err}"
    );
}
