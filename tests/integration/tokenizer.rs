//! Tokenizers against Python's `tokenizers` (tests/fixtures/hf_tokenizers.py): `runner prepare
//! text --tokenizer bpe` trains the tokenizer Python trains and gives the ids Python gives, on
//! Unicode text; `--tokenizer FILE` reads any tokenizer.json; a vocabulary past 65,536 ids writes
//! uint32 `.npy` token files; a run samples with its tokenizer, and the plan refuses a tokenizer
//! larger than the model.
use crate::common;

use std::path::Path;
use std::process::Command;

use common::{assert_ok, reference_python, run, text, write};

/// Runs the fixture script in `dir`; its stdout.
fn python(dir: &Path, args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_tokenizers.py");
    let o = Command::new(reference_python()).arg(script).args(args).current_dir(dir).output().expect("python");
    let (out, err) = text(&o);
    assert!(o.status.success(), "hf_tokenizers.py {args:?} failed:\n{out}\n{err}");
    out
}

/// Python's ids of `text_file` under `tokenizer`.
fn python_ids(dir: &Path, tokenizer: &str, text_file: &str) -> Vec<u32> {
    serde_json::from_str(&python(dir, &["encode", tokenizer, text_file])).unwrap()
}

/// The ids of a prepared folder's two token files, one after the other (uint16 `.bin`s).
fn prepared_ids(dir: &Path) -> (Vec<u32>, usize) {
    let read = |name: &str| -> Vec<u32> {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        bytes.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect()
    };
    let train = read("train.bin");
    let n = train.len();
    ([train, read("val.bin")].concat(), n)
}

/// A text with every kind of character a byte-level BPE must keep: accents, Greek, CJK, emoji
/// (4-byte UTF-8), tabs, Windows line ends, blank lines, trailing spaces.
fn unicode_text(lines: usize) -> String {
    (0..lines)
        .map(|i| {
            format!(
                "ROMEO {i}.\r\nBut soft, what light through yonder window breaks?  \n\tJULIET. Ay me; ô Roméo! \
                 Ωμέγα καὶ ἄλφα — 東京の夜 🌙✨\n\n"
            )
        })
        .collect()
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn a_bpe_prepared_here_is_the_bpe_python_trains_and_gives_python_s_ids_on_unicode_text() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let play = unicode_text(120);
    write(p, "play.txt", &play);
    let o = run(&["prepare", "text", "play.txt", "--out", "data", "--tokenizer", "bpe", "--vocab", "400"], p);
    assert_ok(&o);
    let said = text(&o).0;
    assert!(said.starts_with(&format!("play.txt: {} characters, ", play.chars().count())), "{said}");
    assert!(said.contains(" token ids trained on it (at most 400); train.bin "), "{said}");
    assert_eq!(files(&p.join("data")), ["tokenizer.json", "train.bin", "val.bin"]);

    // The same trainer in Python makes the same file.
    python(p, &["train", "play.txt", "400", "theirs.json"]);
    let json = |f: &str| -> serde_json::Value { serde_json::from_slice(&std::fs::read(p.join(f)).unwrap()).unwrap() };
    assert_eq!(json("data/tokenizer.json"), json("theirs.json"), "the tokenizer Python trains");

    // train.bin then val.bin hold Python's ids of the whole text, split 90/10.
    let (ours, train) = prepared_ids(&p.join("data"));
    let theirs = python_ids(p, "data/tokenizer.json", "play.txt");
    assert_eq!(ours, theirs);
    assert_eq!(train, (theirs.len() as f64 * 0.9) as usize);

    // --tokenizer FILE: a text the BPE never saw (characters it has only as bytes).
    write(
        p,
        "other.txt",
        "Ünïcødé ñ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃ «guillemets» 中文字符 العربية\nline two\r\n\r\n  indented\n".repeat(20).as_str(),
    );
    assert_ok(&run(&["prepare", "text", "other.txt", "--out", "other", "--tokenizer", "data/tokenizer.json"], p));
    assert_eq!(prepared_ids(&p.join("other")).0, python_ids(p, "data/tokenizer.json", "other.txt"));
    assert_eq!(
        std::fs::read(p.join("other/tokenizer.json")).unwrap(),
        std::fs::read(p.join("data/tokenizer.json")).unwrap()
    );

    // Any tokenizer.json: one that normalises (NFKC, lowercase) and prefixes a space to its input.
    python(p, &["prefixed", "play.txt", "prefixed.json"]);
    assert_ok(&run(&["prepare", "text", "other.txt", "--out", "prefixed", "--tokenizer", "prefixed.json"], p));
    assert_eq!(prepared_ids(&p.join("prefixed")).0, python_ids(p, "prefixed.json", "other.txt"));

    // The tokenizer replaces a character vocabulary with --force, and the stale meta.json goes.
    assert_ok(&run(&["prepare", "text", "play.txt", "--out", "chars"], p));
    let o = run(&["prepare", "text", "play.txt", "--out", "chars", "--tokenizer", "data/tokenizer.json"], p);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(text(&o).1.contains("chars already holds chars/train.bin, chars/val.bin, chars/meta.json: pass --force"));
    let force = ["--tokenizer", "data/tokenizer.json", "--force"];
    assert_ok(&run(&[&["prepare", "text", "play.txt", "--out", "chars"][..], &force[..]].concat(), p));
    assert_eq!(files(&p.join("chars")), ["tokenizer.json", "train.bin", "val.bin"]);

    for (args, says) in [
        (&["--tokenizer", "bpe"][..], "error: --tokenizer bpe needs --vocab N, the most tokens it may have"),
        (&["--vocab", "300"][..], "error: --vocab sizes a BPE trained on the text (--tokenizer bpe); --tokenizer chars has its own vocabulary"),
        (&["--tokenizer", "bpe", "--vocab", "100"][..], "error: --vocab 100 is too small for a byte-level BPE: its 256 bytes and <|endoftext|> take 257; give at least 257"),
        (&["--tokenizer", "play.txt"][..], "error: play.txt is not a tokenizer.json that Hugging Face's tokenizers reads: "),
    ] {
        let o = run(&[&["prepare", "text", "play.txt", "--out", "refused"][..], args].concat(), p);
        let err = text(&o).1;
        assert!(o.status.code() == Some(1) || o.status.code() == Some(2), "{args:?}: {err}");
        assert!(err.starts_with(says), "{args:?}: {err}");
        assert!(!p.join("refused").exists(), "{args:?}: nothing written");
    }
}

const WIDE: &str = r#"
[run]
name = "wide"
threads_per_rank = 1

[load]
source = "tokens"
path = "data/train.npy"
validation_path = "data/val.npy"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 70000
d_model = 8
heads = 2
layers = 1
seq_len = 4

[train]
steps = 2
batch_size = 2
"#;

#[test]
fn a_vocabulary_of_70000_ids_writes_uint32_npy_files_and_a_model_smaller_than_it_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    python(p, &["words", "70000", "words.json"]);
    let words: String = (0..300).map(|i| format!("w{} w{} w{}\n", 69_998 - i, i * 233, 65_536 + i)).collect();
    write(p, "words.txt", &words);
    let o = run(&["prepare", "text", "words.txt", "--out", "data", "--tokenizer", "words.json"], p);
    assert_ok(&o);
    let said = text(&o).0;
    assert!(
        said.contains(
            "900 tokens; the tokenizer of words.json, 70000 token ids; train.npy 810 tokens, val.npy 90 tokens"
        ),
        "{said}"
    );
    assert_eq!(files(&p.join("data")), ["tokenizer.json", "train.npy", "val.npy"]);
    // numpy reads them as uint32, with Python's ids.
    let check = r#"
import json, sys, numpy as np
a = [np.load(f"data/{s}.npy", mmap_mode="r") for s in ("train", "val")]
assert all(x.dtype == np.uint32 and x.ndim == 1 for x in a), [x.dtype for x in a]
print(json.dumps([int(i) for i in np.concatenate(a)]))
"#;
    let o = Command::new(reference_python()).args(["-c", check]).current_dir(p).output().unwrap();
    assert!(o.status.success(), "{}", text(&o).1);
    let ours: Vec<u32> = serde_json::from_str(&text(&o).0).unwrap();
    assert_eq!(ours, python_ids(p, "words.json", "words.txt"));
    assert!(ours.iter().any(|&i| i > 65_535), "ids past uint16");

    write(p, "wide.toml", WIDE);
    assert_ok(&run(&["validate", "wide.toml"], p));
    let o = run(&["validate", "wide.toml", "--set", "wrap.model.vocab=69999"], p);
    let err = text(&o).1;
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "`wrap.model.vocab` (--set wrap.model.vocab=69999): 69999 is fewer than the 70000 token ids of \
             data/tokenizer.json, the vocabulary beside the token file: set wrap.model.vocab = 70000 or more"
        ),
        "{err}"
    );
}

const BPE_LM: &str = r#"
[run]
name = "bpe"
seed = 3
threads_per_rank = 1

[load]
source = "tokens"
path = "data/train.bin"
validation_path = "data/val.bin"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 320
d_model = 16
heads = 2
layers = 1
seq_len = 16

[train]
steps = 10
batch_size = 4
optimizer = "adamw"
lr = 0.01
"#;

#[test]
fn a_bpe_run_samples_through_its_tokenizer_and_refuses_another() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    write(p, "play.txt", &unicode_text(60));
    assert_ok(&run(&["prepare", "text", "play.txt", "--out", "data", "--tokenizer", "bpe", "--vocab", "320"], p));
    write(p, "lm.toml", BPE_LM);
    assert_ok(&run(&["run", "lm.toml", "--out", "lm"], p));
    let plan: serde_json::Value = serde_json::from_slice(&std::fs::read(p.join("lm/plan.json")).unwrap()).unwrap();
    assert!(plan["vocabulary"]["path"].as_str().unwrap().ends_with("data/tokenizer.json"), "{}", plan["vocabulary"]);

    let prompt = "JULIET. Ωμέγα 東京 ";
    let sample = |seed: &str| {
        let o = run(&["predict", "lm", "--prompt", prompt, "--tokens", "40", "--seed", seed], p);
        assert_ok(&o);
        text(&o).0
    };
    let (a, b, c) = (sample("1"), sample("1"), sample("2"));
    assert_eq!(a, b, "the same seed, the same text");
    assert_ne!(a, c, "another seed, another text");
    assert!(a.starts_with(prompt), "{a}");
    assert!(a.chars().count() > prompt.chars().count() + 20, "40 tokens of text after the prompt: {a:?}");

    // Another tokenizer.json in its place is refused by its digest.
    python(p, &["train", "play.txt", "300", "data/tokenizer.json"]);
    let o = run(&["predict", "lm", "--prompt", prompt], p);
    let err = text(&o).1;
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("data/tokenizer.json is not the vocabulary this run trained with: it changed since (digest "),
        "{err}"
    );
    assert!(err.contains("put back the tokenizer.json that was made with the token file"), "{err}");
}
