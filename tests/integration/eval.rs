//! `runner eval RUN_DIR DATA` against the run's own validation and against PyTorch
//! (tests/fixtures/eval_torch.py: the run's model.safetensors in the transformer twin): the same
//! loss at world sizes 1, 2 and 3, on a token file and on a text encoded by the run's BPE; and
//! its refusals.
use crate::common;

use std::path::Path;
use std::process::Command;

use common::{assert_ok, reference_python, run, text, write};

const LM: &str = r#"
[run]
name = "eval"
seed = 7
threads_per_rank = 1

[load]
source = "tokens"
path = "data/train.bin"
validation_path = "data/val.bin"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 300
d_model = 16
heads = 2
layers = 2
seq_len = 16

[train]
steps = 12
batch_size = 4
optimizer = "adamw"
lr = 0.01

[validate]
every_steps = 12
"#;

/// A text of the kinds of characters a byte-level BPE has to keep.
fn play(lines: usize, salt: &str) -> String {
    (0..lines)
        .map(|i| {
            format!("ROMEO {i}.\nBut soft, what light {salt} breaks?\n\tJULIET. Ay me; ô Roméo! Ωμέγα 東京 🌙\n\n")
        })
        .collect()
}

/// `runner eval ... --json` in `dir`: its JSON.
fn eval(dir: &Path, args: &[&str]) -> serde_json::Value {
    let o = run(&[&["eval"][..], args, &["--json"]].concat(), dir);
    assert_ok(&o);
    serde_json::from_str(&text(&o).0).unwrap_or_else(|e| panic!("{e}: {}", text(&o).0))
}

/// The PyTorch side on `data` (with `tokenizer`: a text it encodes).
fn torch(dir: &Path, data: &str, tokenizer: Option<&str>) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eval_torch.py");
    let mut c = Command::new(reference_python());
    c.arg(script).args(["lm/model.safetensors", data, "--vocab", "300", "--d-model", "16", "--heads", "2"]);
    c.args(["--layers", "2", "--seq-len", "16"]).args(tokenizer.iter().flat_map(|t| ["--tokenizer", t]));
    let o = c.env("OMP_NUM_THREADS", "1").current_dir(dir).output().unwrap();
    assert!(o.status.success(), "eval_torch.py failed: {}", text(&o).1);
    serde_json::from_str(&text(&o).0).unwrap()
}

fn close(a: &serde_json::Value, b: &serde_json::Value, key: &str, tolerance: f64) -> bool {
    let (a, b) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
    ((a - b) / b).abs() < tolerance
}

#[test]
fn eval_gives_the_run_s_validation_loss_and_pytorch_s_at_world_sizes_1_2_and_3() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "play.txt", &play(50, "through yonder window"));
    assert_ok(&run(&["prepare", "text", "play.txt", "--out", "data", "--tokenizer", "bpe", "--vocab", "300"], p));
    write(p, "lm.toml", LM);
    assert_ok(&run(&["run", "lm.toml", "--out", "lm"], p));
    let trace = common::trace(&p.join("lm"));
    let val_loss = trace.column("val_loss").unwrap().f64().unwrap().get(0).unwrap();

    // The validation file: the run's validation loss, PyTorch's loss, at any world size.
    let theirs = torch(p, "data/val.bin", None);
    eprintln!("validation {val_loss}, torch {theirs}");
    let one = eval(p, &["lm", "data/val.bin", "--world-size", "1"]);
    let three = eval(p, &["lm", "data/val.bin", "--world-size", "3", "--batch-size", "2"]);
    for ours in [&one, &three] {
        assert!(((ours["loss"].as_f64().unwrap() - val_loss) / val_loss).abs() < 1e-6, "{ours} against {val_loss}");
        assert!(close(ours, &theirs, "loss", 1e-5), "{ours}\n{theirs}");
        assert_eq!(ours["windows"], theirs["windows"]);
        let tokens = ours["tokens"].as_f64().unwrap();
        assert!((ours["accuracy"].as_f64().unwrap() - theirs["accuracy"].as_f64().unwrap()).abs() <= 1.0 / tokens);
        let ppl = ours["perplexity"].as_f64().unwrap();
        assert!((ppl - ours["loss"].as_f64().unwrap().exp()).abs() < 1e-9 * ppl);
        assert!(ours["tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    assert_eq!((one["world_size"].as_u64(), three["world_size"].as_u64()), (Some(1), Some(3)));
    assert_eq!(one["tokens"].as_u64().unwrap(), one["windows"].as_u64().unwrap() * 16);

    // A text the run never saw, encoded with the run's BPE here and with Python's tokenizers there.
    write(p, "other.txt", &play(8, "ünseen — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"));
    let ours = eval(p, &["lm", "other.txt", "--world-size", "2"]);
    let theirs = torch(p, "other.txt", Some("data/tokenizer.json"));
    assert!(close(&ours, &theirs, "loss", 1e-5), "{ours}\n{theirs}");
    assert_eq!(ours["windows"], theirs["windows"]);

    // What a person reads.
    let o = run(&["eval", "lm", "data/val.bin", "--world-size", "2"], p);
    assert_ok(&o);
    let said = text(&o).0;
    assert!(said.starts_with(&format!("lm: {} windows of 16 + 1 tokens of data/val.bin (", one["windows"])), "{said}");
    assert!(said.contains(&format!("  loss {val_loss:.4}  perplexity {:.4}  accuracy ", val_loss.exp())), "{said}");

    // Refusals.
    write(p, "short.txt", "ROMEO.");
    std::fs::write(p.join("big.bin"), [44u8, 1, 0, 0]).unwrap();
    for (args, code, says) in [
        (&["lm", "short.txt"][..], 2, "error: short.txt holds 2 tokens, and one window needs seq_len + 1 = 17"),
        (&["lm", "big.bin"][..], 2, "error: big.bin holds token id 300 (at position 0), but wrap.model.vocab is 300"),
        (&["lm", "data/val.bin", "--world-size", "0"][..], 2, "error: --world-size must be 1 to "),
        (&["data", "data/val.bin"][..], 2, "error: cannot read the run's plan data/plan.json: "),
    ] {
        let o = run(&[&["eval"][..], args].concat(), p);
        let err = text(&o).1;
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.starts_with(says), "{args:?}: {err}");
    }
}

/// `ids` of `text` as Python's `tokenizers` encodes it with `tokenizer`, written as a .bin of uint16.
fn encode_in_python(dir: &Path, tokenizer: &str, file: &str, bin: &str) {
    const SCRIPT: &str = "import sys, numpy as np\nfrom tokenizers import Tokenizer\n\
        ids = Tokenizer.from_file(sys.argv[1]).encode(open(sys.argv[2], encoding='utf-8').read()).ids\n\
        np.array(ids, dtype=np.uint16).tofile(sys.argv[3])\n";
    let o =
        Command::new(reference_python()).args(["-c", SCRIPT, tokenizer, file, bin]).current_dir(dir).output().unwrap();
    assert!(o.status.success(), "{}", text(&o).1);
}

#[test]
fn eval_of_a_hugging_face_directory_gives_transformers_loss_on_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "play.txt", &play(30, "through yonder window"));
    assert_ok(&run(&["prepare", "text", "play.txt", "--out", "data", "--tokenizer", "bpe", "--vocab", "300"], p));
    crate::hf::python(p, &["make", "--arch", "llama", "--out", "base", "--vocab", "300", "--positions", "32"]);
    let x = tch::Tensor::zeros([1, 16], (tch::Kind::Int64, tch::Device::Cpu));
    crate::hf::save_windows(&p.join("w.safetensors"), &(x.shallow_clone(), x));
    let transformers = |bin: &str| {
        let args = ["check", "base", "--windows", "w.safetensors", "--logits-out", "l.safetensors", "--prompt", "1"];
        crate::hf::python(p, &[&args[..], &["--new", "1", "--eval-data", bin, "--seq-len", "16"]].concat())["eval"]
            .clone()
    };

    // The base model's loss on token ids, at any world size, as transformers computes it.
    let theirs = transformers("data/val.bin");
    for world in ["1", "2"] {
        let ours = eval(p, &["base", "data/val.bin", "--seq-len", "16", "--world-size", world]);
        assert!(close(&ours, &theirs, "loss", 1e-5), "{ours}\n{theirs}");
        assert_eq!(ours["windows"], theirs["windows"]);
        let tokens = ours["tokens"].as_f64().unwrap();
        assert!((ours["accuracy"].as_f64().unwrap() - theirs["accuracy"].as_f64().unwrap()).abs() <= 1.0 / tokens);
    }
    // Windows as long as the model's max_position_embeddings unless --seq-len says otherwise.
    assert_eq!(eval(p, &["base", "data/val.bin"])["seq_len"], 32);

    // A text: encoded with the directory's tokenizer.json, refused without one.
    write(p, "other.txt", &play(6, "ünseen"));
    let o = run(&["eval", "base", "other.txt"], p);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(
        text(&o).1.starts_with(
            "error: other.txt is a text, but base has no tokenizer.json to encode it with: give token ids"
        ),
        "{}",
        text(&o).1
    );
    std::fs::copy(p.join("data/tokenizer.json"), p.join("base/tokenizer.json")).unwrap();
    let ours = eval(p, &["base", "other.txt", "--seq-len", "16"]);
    encode_in_python(p, "base/tokenizer.json", "other.txt", "other.bin");
    let theirs = transformers("other.bin");
    assert!(close(&ours, &theirs, "loss", 1e-5), "{ours}\n{theirs}");
    assert_eq!(ours["windows"], theirs["windows"]);

    let o = run(&["eval", "base", "data/val.bin", "--seq-len", "33"], p);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(
        text(&o).1.starts_with("error: --seq-len 33: base/config.json takes windows of 1 to 32 tokens"),
        "{}",
        text(&o).1
    );
}

/// A complete run extended with `--resume --set train.steps=...` and stopped before its end: its
/// model.safetensors is the older run's. `eval`, `export` and `predict` refuse it, naming the
/// checkpoint of the run's newest state; the resumed run, once complete, serves again.
#[test]
fn a_run_extended_past_its_model_and_stopped_is_not_served_with_the_older_model() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "play.txt", &play(30, "through yonder window"));
    assert_ok(&run(&["prepare", "text", "play.txt", "--out", "data", "--tokenizer", "bpe", "--vocab", "300"], p));
    write(p, "lm.toml", &LM.replace("[validate]", "[checkpoint]\nevery_steps = 4\n\n[validate]"));
    assert_ok(&run(&["run", "lm.toml", "--out", "lm"], p));

    // Extended to 24 steps; rank 0 stops for good in the checkpoint of step 20, and the launcher
    // is interrupted once the checkpoint of step 16 is committed.
    let mut launcher = common::runner()
        .args(["run", "--resume", "lm", "--set", "train.steps=24"])
        .env("RUNNER_TEST_STALL_CHECKPOINT", "0:20")
        .current_dir(p)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let marker = p.join("lm/checkpoints/step-00000016/index.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "no checkpoint of step 16");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = nix::unistd::Pid::from_raw(launcher.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    assert_eq!(launcher.wait().unwrap().code(), Some(143));

    let newest = "is not the model of the run's newest state: it was written after step 12, and the run went on to \
                  its checkpoint of step 16";
    for args in [
        &["eval", "lm", "data/val.bin"][..],
        &["export", "lm", "--hf", "hf"][..],
        &["predict", "lm", "--prompt", "ROMEO", "--tokens", "4"][..],
    ] {
        let o = run(args, p);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(newest) && err.contains("runner run --resume lm finishes the run"), "{args:?}: {err}");
    }
    assert!(!p.join("hf").exists());

    // Finished, the run serves its newest model.
    assert_ok(&run(&["run", "--resume", "lm"], p));
    eval(p, &["lm", "data/val.bin"]);
}
