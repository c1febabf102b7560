//! nanoGPT's recipe: the optimizer and model keys it needs (betas, weight decay on matrices, a
//! transformer without biases) against the PyTorch twin, step by step at world sizes 1 and 2.
use crate::common;

use std::path::Path;
use std::process::Command;

use common::{assert_ok, reference_python, run, write};
use polars::prelude::ChunkCompareEq;

/// Windows of `SEQ` + 1 bytes: `ROWS` to train on, `VAL` held out.
const SEQ: usize = 16;
const ROWS: usize = 16;
const VAL: usize = 4;
const STEPS: usize = 20;

const TWIN: &str = r#"
[run]
name = "twin"
seed = 3
timeout_s = 60
threads_per_rank = 1

[load]
source = "text"
path = "book.txt"
rows = 20                    # read: 16 to train on, the last 4 held out (validate.rows), as the twin

[normalize]
method = "none"

[wrap]
init = "init.npz"

[wrap.model]
kind = "transformer"
vocab = 256
d_model = 32
heads = 4
layers = 2
seq_len = 16
tied = true
bias = false

[train]
epochs = 20
optimizer = "adamw"
lr = 0.002
betas = [0.9, 0.99]
weight_decay = 0.1
weight_decay_on = "matrices"

[validate]
every = 0
rows = 4
"#;

/// The twin's per-epoch losses (`epoch E loss L` lines).
fn twin_losses(dir: &Path, world: usize, batch: usize) -> Vec<f64> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/reference/transformer_torch.py");
    let o = Command::new(reference_python())
        .args(["-m", "torch.distributed.run", "--standalone", &format!("--nproc_per_node={world}")])
        .arg(script)
        .args(["book.txt", "--rows", &ROWS.to_string(), "--val", &VAL.to_string(), "--d-model", "32"])
        .args(["--heads", "4", "--layers", "2", "--seq-len", &SEQ.to_string(), "--tied", "--no-bias"])
        .args(["--batch", &batch.to_string(), "--epochs", &STEPS.to_string(), "--optimizer", "adamw"])
        .args(["--lr", "0.002", "--weight-decay", "0.1", "--decay-on", "matrices", "--betas", "0.9", "0.99"])
        .args(["--seed", "3", "--threads", "1", "--init-out", "init.npz"])
        .env("OMP_NUM_THREADS", "1")
        .current_dir(dir)
        .output()
        .expect("torchrun");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "the twin failed: {out}\n{}", String::from_utf8_lossy(&o.stderr));
    out.lines().filter_map(|l| l.strip_prefix("epoch ")?.split(" loss ").nth(1)?.parse().ok()).collect()
}

fn runner_losses(dir: &Path, out: &str) -> Vec<f64> {
    let df = common::trace(&dir.join(out));
    let rank = df.column("rank").unwrap().u32().unwrap().equal(0);
    let rows = df.filter(&rank).unwrap();
    rows.column("global_train_loss").unwrap().f64().unwrap().into_no_null_iter().collect()
}

#[test]
fn betas_decay_on_matrices_and_no_bias_match_the_pytorch_twin_step_by_step() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let text: String = (0..200).map(|i| format!("{i}: to be, or not to be, that is the question. ")).collect();
    write(p, "book.txt", &text[..(ROWS + VAL) * SEQ + 1]);
    write(p, "twin.toml", TWIN);
    for (world, batch) in [(1, 16), (2, 8)] {
        let theirs = twin_losses(p, world, batch);
        assert_eq!(theirs.len(), STEPS, "one step per epoch: {theirs:?}");
        let out = format!("w{world}");
        let o = run(
            &[
                "run",
                "twin.toml",
                "--out",
                &out,
                "--set",
                &format!("run.world_size={world}"),
                "--set",
                &format!("train.batch_size={batch}"),
            ],
            p,
        );
        assert_ok(&o);
        let ours = runner_losses(p, &out);
        assert_eq!(ours.len(), STEPS);
        for (s, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(((a - b) / b).abs() < 1e-5, "world size {world}, step {}: runner {a}, torch {b}", s + 1);
        }
        assert!(ours[STEPS - 1] < ours[0] - 0.5, "the model learns: {ours:?}");
    }
}

/// A text with every kind of character the vocabulary has to keep: newlines, punctuation,
/// non-ASCII letters.
fn play() -> String {
    (0..400)
        .map(|i| {
            format!("ROMEO.\nBut soft, what light through yonder window breaks? {i}\nJULIET.\nAy me; ô Roméo!\n\n")
        })
        .collect()
}

fn decode(meta: &serde_json::Value, bytes: &[u8]) -> String {
    bytes.chunks(2).map(|c| meta["itos"][u16::from_le_bytes([c[0], c[1]]).to_string()].as_str().unwrap()).collect()
}

#[test]
fn prepare_text_writes_nanogpt_s_files_and_round_trips_the_text_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let text = play();
    write(p, "play.txt", &text);
    let o = run(&["prepare", "text", "play.txt", "--out", "data"], p);
    assert_ok(&o);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p.join("data/meta.json")).unwrap()).unwrap();
    let mut chars: Vec<char> = text.chars().collect();
    chars.sort();
    chars.dedup();
    assert_eq!(meta["vocab_size"], chars.len());
    assert_eq!(meta["stoi"]["\n"], 0, "sorted: the newline first");
    let train = std::fs::read(p.join("data/train.bin")).unwrap();
    let val = std::fs::read(p.join("data/val.bin")).unwrap();
    let n = text.chars().count();
    assert_eq!(train.len() / 2, (n as f64 * 0.9) as usize, "90% of the characters");
    assert_eq!(decode(&meta, &train) + &decode(&meta, &val), text);

    std::fs::write(p.join("bad.txt"), [0x66, 0xff, 0x66]).unwrap();
    let o = run(&["prepare", "text", "bad.txt", "--out", "data2"], p);
    let (_, stderr) = common::text(&o);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("bad.txt is not UTF-8 text (byte 1)"), "{stderr}");
    assert!(!p.join("data2/train.bin").exists());
}

/// The shipped pipeline on a prepared copy of `play()`, shortened: it validates as shipped and
/// trains; `runner predict --prompt` samples from it.
#[test]
fn the_shakespeare_pipeline_validates_trains_and_samples_deterministically_from_its_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    std::fs::create_dir_all(p.join("pipelines")).unwrap();
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/pipelines/shakespeare_char.toml"));
    write(&p.join("pipelines"), "shakespeare_char.toml", &shipped.unwrap());
    write(p, "play.txt", &play());
    assert_ok(&run(&["prepare", "text", "play.txt", "--out", "data/shakespeare_char"], p));
    let o = run(&["validate", "pipelines/shakespeare_char.toml"], p);
    assert_ok(&o);
    let (plan, _) = common::text(&o);
    for part in [
        "Transformer LM (vocab 73, d_model 128, 4 heads, 4 blocks, context 64, head tied to the embedding, no biases)",
        "2000 steps of 12 per rank (12 global), adamw (betas 0.9, 0.99; weight decay 0.1 on matrices) lr 0.001",
        "cosine 0.001 → 0.0001 over 1900 steps, after 100 warmup steps from 9.9010e-6",
        "clip to global norm 1 after averaging",
        "every 250 step(s) (20 batches of 12, the same every time)",
    ] {
        assert!(plan.contains(part), "{part}\n{plan}");
    }
    let short = ["--set", "train.steps=20", "--set", "validate.every_steps=10", "--set", "train.schedule.decay_end=20"];
    let short = [&short[..], &["--set", "train.schedule.warmup_steps=5", "--set", "validate.batches=2"]].concat();
    let o = run(&[&["run", "pipelines/shakespeare_char.toml", "--out", "lm"][..], &short[..]].concat(), p);
    assert_ok(&o);
    let manifest = std::fs::read_to_string(p.join("lm/manifest.json")).unwrap();
    assert!(manifest.contains("\"stopped\": \"completed train.steps = 20\""), "{manifest}");

    let sample = |seed: &str| {
        let args = ["predict", "lm", "--prompt", "ROMEO.\n", "--tokens", "60", "--temperature", "0.8"];
        let o = run(&[&args[..], &["--top-k", "20", "--seed", seed]].concat(), p);
        assert_ok(&o);
        common::text(&o).0
    };
    let (a, b, c) = (sample("1"), sample("1"), sample("2"));
    assert_eq!(a, b, "the same seed, the same text");
    assert_ne!(a, c, "another seed, another text");
    assert!(a.starts_with("ROMEO.\n"), "{a}");
    assert_eq!(a.strip_suffix('\n').unwrap().chars().count(), 7 + 60, "the prompt and 60 tokens: {a:?}");
    let vocab: std::collections::BTreeSet<char> = play().chars().collect();
    assert!(a.chars().all(|ch| vocab.contains(&ch)), "only the vocabulary's characters: {a:?}");

    let o = run(&["predict", "lm", "--prompt", "ROMEO#"], p);
    let (_, stderr) = common::text(&o);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--prompt") && stderr.contains("'#' is not in the vocabulary"), "{stderr}");
}
