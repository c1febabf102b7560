//! `kind = "transformer"` end to end: a language model on synthetic tokens, a text file and a
//! token file, trained with DDP and as a pipeline, checked against one process; bad token data
//! refused with pinned messages; the shipped pipelines' plans.
use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{assert_ok, run, text, write};
use polars::prelude::*;
use tch::Tensor;

/// A small language model on synthetic tokens: 128 training windows of 8 + 1 tokens, vocab 32.
const LM: &str = r#"
[run]
name = "lm"
seed = 5
world_size = 1
timeout_s = 30

[load]
rows = 128
validation_rows = 16

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 32
d_model = 16
heads = 2
layers = 3
seq_len = 8
tied = false

[train]
epochs = 2
batch_size = 16
optimizer = "adamw"
lr = 0.01
"#;

fn trace(dir: &Path) -> DataFrame {
    ParquetReader::new(std::fs::File::open(dir.join("trace.parquet")).expect("trace.parquet")).finish().unwrap()
}

fn rank0(dir: &Path, col: &str) -> Vec<f64> {
    let df = trace(dir);
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    df.filter(&mask).unwrap().column(col).unwrap().f64().unwrap().into_no_null_iter().collect()
}

fn params(dir: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("model.safetensors")).expect("model.safetensors").into_iter().collect()
}

fn assert_close(got: &BTreeMap<String, Tensor>, want: &BTreeMap<String, Tensor>, what: &str) {
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{what}");
    for (name, w) in want {
        let diff = (&got[name] - w).abs().max().double_value(&[]);
        let rel = diff / w.abs().max().double_value(&[]).max(1e-12);
        assert!(rel < 1e-4, "{what}: {name} differs by {diff:e} ({rel:e} of its largest element)");
    }
}

#[test]
fn ddp_over_two_ranks_equals_one_rank_with_twice_the_batch_and_the_trace_has_perplexity() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    // A peak of 1 GFLOP/s (the least the key takes): MFU is the model's training FLOPs per second over it.
    let peak = ["--set", "run.peak_tflops=0.001"];
    let o = run(&[&["run", "p.toml", "--out", "one", "--set", "train.batch_size=16"][..], &peak].concat(), dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("Transformer LM (vocab 32, d_model 16, 2 heads, 3 blocks, context 8)"), "{stdout}");
    assert!(stdout.contains("128 training + 16 validation windows of 8 + 1 tokens, vocab 32"), "{stdout}");
    assert!(stdout.contains(" ppl ") && stdout.contains("tokens/s per rank  MFU "), "{stdout}");
    let two = ["run", "p.toml", "--out", "two", "--set", "run.world_size=2", "--set", "train.batch_size=8"];
    assert_ok(&run(&two, dir.path()));

    let (l1, l2) =
        (rank0(&dir.path().join("one"), "global_train_loss"), rank0(&dir.path().join("two"), "global_train_loss"));
    assert_eq!(l1.len(), 2);
    for (e, (a, b)) in l2.iter().zip(&l1).enumerate() {
        assert!(((a - b) / b).abs() < 1e-5, "epoch {}: 2 ranks × 8 gave {a}, 1 rank × 16 gave {b}", e + 1);
    }
    assert!(l1[1] < l1[0] && l1[0] < (32f64).ln(), "the model learns: {l1:?}");

    let df = trace(&dir.path().join("two"));
    let loss: Vec<f64> = df.column("train_loss").unwrap().f64().unwrap().into_no_null_iter().collect();
    let ppl: Vec<f64> = df.column("perplexity").unwrap().f64().unwrap().into_no_null_iter().collect();
    assert_eq!(ppl.len(), loss.len());
    assert!(ppl.iter().zip(&loss).all(|(p, l)| (p - l.exp()).abs() < 1e-12));
    let tokens: Vec<f64> = df.column("tokens_per_s").unwrap().f64().unwrap().into_no_null_iter().collect();
    let samples: Vec<f64> = df.column("samples_per_s").unwrap().f64().unwrap().into_no_null_iter().collect();
    assert!(tokens.iter().zip(&samples).all(|(t, s)| (t - 8.0 * s).abs() < 1e-6 * t));
    assert_eq!(df.column("val_perplexity").unwrap().null_count(), 2, "validation on rank 0 only");
    // MFU against the peak measured on this CPU: a fraction.
    let mfu: Vec<f64> = df.column("mfu").unwrap().f64().unwrap().into_no_null_iter().collect();
    assert!(mfu.len() == 4 && mfu.iter().all(|m| *m > 0.0 && *m < 1.0), "{mfu:?}");
    // Against run.peak_tflops: per window of 8 tokens, 3 × (3 blocks × (2 × 8 × 12 × 16² + 4 × 8² ×
    // 16) + the head's 2 × 8 × 16 × 32) = 503808 FLOPs.
    let df = trace(&dir.path().join("one"));
    let mfu: Vec<f64> = df.column("mfu").unwrap().f64().unwrap().into_no_null_iter().collect();
    let samples: Vec<f64> = df.column("samples_per_s").unwrap().f64().unwrap().into_no_null_iter().collect();
    assert!(mfu.iter().zip(&samples).all(|(m, s)| (m - s * 503808.0 / 1e9).abs() < 1e-9 * m), "{mfu:?}");
}

#[test]
fn a_transformer_pipeline_over_2_and_4_ranks_equals_one_process() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", LM);
    let go = |out: &str, extra: &[&str]| {
        // SGD: Adam would magnify float noise in gradients that are zero in exact arithmetic
        // (the attention's key bias), which the comparison of parameters below would see.
        let sgd = ["--set", "train.epochs=1", "--set", "train.optimizer=\"sgd\"", "--set", "train.lr=0.5"];
        let o = run(&[&["run", "p.toml", "--out", out][..], &sgd, extra].concat(), dir.path());
        assert_ok(&o);
        text(&o).0
    };
    go("one", &["--set", "wrap.strategy=\"none\""]);
    let pipe = ["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.pipeline.micro_batches=3"];
    let stdout = go("two", &[&pipe[..], &["--set", "run.world_size=2"]].concat());
    // 5 layers: the embedding (640 parameters), 3 blocks of 3280, the head (544).
    assert!(stdout.contains("layers 0-1 (8-8 × 16-8 × 16): 3920 parameters"), "{stdout}");
    assert!(stdout.contains("layers 2-4 (8 × 16-8 × 16-8 × 16-8 × 32): 7104 parameters"), "{stdout}");
    go("four", &[&pipe[..], &["--set", "run.world_size=4"]].concat());
    go("four-1f1b", &[&pipe[..], &["--set", "run.world_size=4", "--set", "wrap.pipeline.schedule=\"1f1b\""]].concat());

    let reference = params(&dir.path().join("one"));
    assert_eq!(reference.len(), 2 + 3 * 12 + 3);
    for out in ["two", "four", "four-1f1b"] {
        assert_close(&params(&dir.path().join(out)), &reference, out);
        let (a, b) =
            (rank0(&dir.path().join(out), "global_train_loss"), rank0(&dir.path().join("one"), "global_train_loss"));
        assert!(((a[0] - b[0]) / b[0]).abs() < 1e-5, "{out}: loss {a:?} against one process's {b:?}");
    }
}

#[test]
fn text_and_token_files_train_and_bad_token_data_is_refused_with_pinned_messages() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    // Token files hold out windows with validate.rows (load.validation_rows is synthetic's).
    write(p, "p.toml", &LM.replace("validation_rows = 16\n", ""));
    let text_file: String =
        (0..40).map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog. ")).collect();
    write(p, "book.txt", &text_file);
    let o = run(
        &[
            "run",
            "p.toml",
            "--out",
            "text",
            "--set",
            "load.source=\"text\"",
            "--set",
            "load.path=\"book.txt\"",
            "--set",
            "wrap.model.vocab=256",
            "--set",
            "validate.rows=8",
            "--set",
            "run.world_size=2",
        ],
        p,
    );
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(
        stdout.contains("book.txt (2150 tokens)") && stdout.contains("120 training + 8 validation windows"),
        "{stdout}"
    );

    // A nanoGPT .bin of uint16 ids, one of them 40 ≥ vocab 32.
    let ids: Vec<u16> = (0..200).map(|i| if i == 150 { 40 } else { (i * 7 % 32) as u16 }).collect();
    std::fs::write(p.join("ids.bin"), ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let tokens = ["--set", "load.source=\"tokens\"", "--set", "load.path=\"ids.bin\"", "--set", "validate.rows=2"];
    let refuse = |extra: &[&str]| {
        let o = run(&[&["validate", "p.toml"][..], &tokens, extra].concat(), p);
        assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
        text(&o).1
    };
    let err = refuse(&["--set", "load.rows=10"]);
    assert!(
        err.contains(&format!(
            "`load.path` (--set load.path=\"ids.bin\"): {} holds token id 40 (at position 150), but wrap.model.vocab \
             is 32: every id must be below it",
            "ids.bin"
        )),
        "{err}"
    );
    let err = refuse(&["--set", "wrap.model.vocab=64", "--set", "wrap.model.seq_len=256"]);
    assert!(
        err.contains(&format!(
            "`wrap.model.seq_len` (--set wrap.model.seq_len=256): 256 is longer than the data: {} holds 200 tokens, \
             and one window needs seq_len + 1 = 257",
            "ids.bin"
        )),
        "{err}"
    );
    let err = refuse(&["--set", "wrap.model.vocab=64", "--set", "normalize.method=\"minmax\""]);
    assert!(
        err.contains(
            "`normalize.method` (--set normalize.method=\"minmax\"): a language model's inputs are token ids, \
                      which are never scaled: set it to \"none\""
        ),
        "{err}"
    );
    let err = refuse(&[
        "--set",
        "wrap.model.vocab=64",
        "--set",
        "wrap.strategy=\"pipeline\"",
        "--set",
        "run.world_size=2",
        "--set",
        "wrap.model.tied=true",
    ]);
    assert!(
        err.contains("`wrap.model.tied` (--set wrap.model.tied=true): the output head (layer 4) is tied to the token \
                      embedding (layer 0), but a pipeline puts them on different ranks (layers 2-4 without layer 0); set \
                      wrap.model.tied = false"),
        "{err}"
    );
    // A model no machine holds is refused by the memory estimate, naming the transformer's key.
    let err = refuse(&["--set", "wrap.model.vocab=64", "--set", "wrap.model.d_model=1048576"]);
    assert!(err.contains("`wrap.model.d_model` (--set wrap.model.d_model=1048576): the run needs about"), "{err}");
    write(p, "mlp.toml", "[load]\nsource = \"tokens\"\npath = \"ids.bin\"\n");
    let o = run(&["validate", "mlp.toml"], p);
    assert!(
        text(&o).1.contains(
            "`load.source` (file mlp.toml:2): \"tokens\" gives token ids for a language model: use wrap.model.kind = \
             \"transformer\""
        ),
        "{:?}",
        text(&o)
    );
    // With every id below the vocabulary, the same file trains.
    let o = run(
        &[&["run", "p.toml", "--out", "bin"][..], &tokens, &["--set", "wrap.model.vocab=41", "--set", "load.rows=20"]]
            .concat(),
        p,
    );
    assert_ok(&o);
}

#[test]
fn the_large_model_holds_a_quarter_of_100_million_parameters_per_rank_and_one_rank_is_refused() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let pipeline = root.join("pipelines/large_model.toml");
    let dir = tempfile::tempdir().unwrap();
    let validate = |extra: &[&str]| {
        common::runner()
            .args([&["validate", pipeline.to_str().unwrap()][..], extra].concat())
            .env("RUNNER_NO_MEMORY_CHECK", "1")
            .current_dir(dir.path())
            .output()
            .unwrap()
    };
    let o = validate(&[]);
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("(100290944 parameters)"), "about 100 million parameters: {stdout}");
    for r in 0..4 {
        let line = stdout.lines().find(|l| l.contains(&format!("  rank {r} "))).unwrap_or_else(|| panic!("{stdout}"));
        let p: usize = line.split(": ").nth(1).and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
        assert!((24_000_000..26_000_000).contains(&p), "rank {r} holds {p}: {line}");
    }
    let o = validate(&["--set", "run.world_size=1"]);
    assert_eq!(o.status.code(), Some(2));
    let (_, stderr) = text(&o);
    assert!(
        stderr.contains(
            "more than the 1000 MiB a rank may use; wrap.strategy = \"fsdp\" fits from run.world_size = 3 (960 MiB a \
             rank), or the pipeline fits from run.world_size = 2 (970 MiB on its heaviest rank, with activation \
             checkpointing)"
        ),
        "{stderr}"
    );
}
