//! The collectives tensor parallelism is built from (`ProcessGroup::copy_to_ranks_autograd`
//! before a column-parallel layer, `sum_from_ranks_autograd` after a row-parallel one), across
//! real processes: a Megatron-split two-layer MLP equals the whole MLP in one process, forward
//! and backward. dist.rs's worker runs [`column_then_row`] as its scenario "tensor_parallel".
use runner::dist::ProcessGroup;
use tch::{Device, Kind, Tensor};

/// x (4 × 6) → linear 6 → 8 → tanh → linear 8 → 3 → sum of squares. Each rank holds rows
/// [r·8/w, (r+1)·8/w) of the first weight and bias, and the same columns of the second weight; the
/// second bias is added once, after the sum. The outputs, the input's gradient and each rank's
/// slices of the weights' gradients equal the whole model's.
pub fn column_then_row(pg: &ProcessGroup) {
    let (r, w) = (pg.rank() as i64, pg.size() as i64);
    let seeded = |shape: &[i64], salt: f64| {
        let n: i64 = shape.iter().product();
        (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + salt).sin().view(shape)
    };
    let x = seeded(&[4, 6], 0.1);
    let (w1, b1, w2, b2) = (seeded(&[8, 6], 0.2), seeded(&[8], 0.3), seeded(&[3, 8], 0.4), seeded(&[3], 0.5));
    let forward =
        |x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor| x.linear(w1, Some(b1)).tanh().linear(w2, None::<Tensor>);

    let leaf = |t: &Tensor| t.detach().set_requires_grad(true);
    let (x_all, w1_all, w2_all) = (leaf(&x), leaf(&w1), leaf(&w2));
    let whole = forward(&x_all, &w1_all, &b1, &w2_all) + &b2;
    whole.square().sum(Kind::Float).backward();

    let part = 8 / w;
    let (x_tp, w1_tp, w2_tp) = (leaf(&x), leaf(&w1.narrow(0, r * part, part)), leaf(&w2.narrow(1, r * part, part)));
    let entered = pg.copy_to_ranks_autograd(&x_tp).unwrap();
    let partial = forward(&entered, &w1_tp, &b1.narrow(0, r * part, part), &w2_tp);
    let split = pg.sum_from_ranks_autograd(&partial).unwrap() + &b2;
    split.square().sum(Kind::Float).backward();

    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    assert!(diff(&split, &whole) < 1e-5, "outputs differ by {}", diff(&split, &whole));
    assert!(diff(&x_tp.grad(), &x_all.grad()) < 1e-5, "the input's gradient differs");
    let w1_grad = w1_all.grad().narrow(0, r * part, part);
    assert!(diff(&w1_tp.grad(), &w1_grad) < 1e-5, "the column-parallel weight's gradient differs");
    let w2_grad = w2_all.grad().narrow(1, r * part, part);
    assert!(diff(&w2_tp.grad(), &w2_grad) < 1e-5, "the row-parallel weight's gradient differs");
}

/// A small language model on synthetic tokens (128 windows of 8 + 1 tokens, vocab 32), trained
/// with SGD: Adam would magnify the float noise of gradients that are zero in exact arithmetic,
/// which the comparison of parameters would see.
pub const LM: &str = r#"
[run]
name = "tp"
seed = 5
world_size = 1
timeout_s = 60

[load]
rows = 128
validation_rows = 16

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 32
d_model = 16
heads = 4
layers = 2
seq_len = 8
tied = false

[train]
epochs = 2
batch_size = 16
optimizer = "sgd"
lr = 0.5
clip_grad_norm = 0.5
"#;

/// Runs `p.toml` in `dir` into `out` with `extra`; the run's stdout.
fn train(dir: &std::path::Path, out: &str, extra: &[&str]) -> String {
    let o = crate::common::run(&[&["run", "p.toml", "--out", out][..], extra].concat(), dir);
    crate::common::assert_ok(&o);
    crate::common::text(&o).0
}

/// Resumes the run `out` in `dir` with `extra`.
fn resume(dir: &std::path::Path, out: &str, extra: &[&str]) {
    crate::common::assert_ok(&crate::common::run(&[&["run", "--resume", out][..], extra].concat(), dir));
}

const TP2: [&str; 4] = ["--set", "run.world_size=2", "--set", "wrap.mesh.tensor=2"];

#[test]
fn gpt2_and_llama_split_over_2_tensor_ranks_train_as_one_process_dropout_included() {
    let dir = tempfile::tempdir().unwrap();
    crate::common::write(dir.path(), "p.toml", LM);
    let llama =
        ["--set", "wrap.model.family=\"llama\"", "--set", "wrap.model.kv_heads=2", "--set", "wrap.model.mlp_hidden=24"];
    for (name, model) in [("gpt2", &[][..]), ("llama", &llama[..])] {
        // Dropout in the embedding, the attention and the residuals: the masks one process draws.
        let dropout = ["--set", "wrap.model.dropout=0.1"];
        let (one, split) = (format!("{name}-one"), format!("{name}-tp"));
        train(dir.path(), &one, &[model, &dropout].concat());
        let stdout = train(dir.path(), &split, &[model, &dropout, &TP2].concat());
        assert!(stdout.contains("tensor groups (the slices of each layer): [0, 1]"), "{stdout}");
        assert!(
            stdout.contains("each rank holds 1 / tensor of each block's attention heads and MLP units"),
            "{stdout}"
        );
        crate::common::assert_close_runs(&dir.path().join(&split), &dir.path().join(&one), 1e-5);
        // Each rank holds half of every split matrix, and the norms, embeddings and head whole.
        let model = tch::Tensor::read_safetensors(dir.path().join(&one).join("model.safetensors")).unwrap();
        let split_part = |n: &str| ["qkv.", "proj.weight", "fc.", "out.weight"].iter().any(|p| n.contains(p));
        let bytes = |keep: &dyn Fn(&str) -> bool| -> f64 {
            model.iter().filter(|(n, _)| keep(n)).map(|(_, t)| 4.0 * t.numel() as f64).sum()
        };
        let want = bytes(&|n: &str| !split_part(n)) + bytes(&|n: &str| split_part(n)) / 2.0;
        let df = crate::common::trace(&dir.path().join(&split));
        let held: Vec<u64> = df.column("param_bytes").unwrap().u64().unwrap().into_no_null_iter().collect();
        assert!(
            held.iter().all(|&b| b as f64 == want),
            "{name}: the ranks hold {held:?} bytes of parameters, not {want}"
        );
    }
}

#[test]
fn ddp_and_fsdp_times_tensor_at_4_ranks_equal_one_process_with_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    crate::common::write(dir.path(), "p.toml", LM);
    train(dir.path(), "one", &[]);
    let mesh = ["--set", "run.world_size=4", "--set", "wrap.mesh.tensor=2", "--set", "train.batch_size=8"];
    let stdout = train(dir.path(), "ddp", &mesh);
    assert!(stdout.contains("mesh: data 2 × tensor 2 × pipeline 1"), "{stdout}");
    assert!(
        stdout.contains("data groups (copies of the model, each on its own shard of the data): [0, 2] [1, 3]"),
        "{stdout}"
    );
    crate::common::assert_close_runs(&dir.path().join("ddp"), &dir.path().join("one"), 1e-5);
    // torchtitan's 2-D: each tensor rank's slices sharded over the data dimension; its
    // checkpoint (whole tensors) resumes on one rank.
    let fsdp = ["--set", "wrap.strategy=\"fsdp\"", "--set", "checkpoint.every=1"];
    let stdout = train(dir.path(), "fsdp", &[&mesh[..], &fsdp].concat());
    assert!(stdout.contains("each rank holds 1/2 of its tensor slice of every parameter"), "{stdout}");
    crate::common::assert_close_runs(&dir.path().join("fsdp"), &dir.path().join("one"), 1e-5);
    train(dir.path(), "cut", &[&mesh[..], &fsdp, &["--set", "train.epochs=1"]].concat());
    let one = ["--set", "train.epochs=2", "--set", "run.world_size=1", "--set", "wrap.mesh.tensor=1"];
    resume(dir.path(), "cut", &[&one[..], &["--set", "train.batch_size=16"]].concat());
    crate::common::assert_close_runs(&dir.path().join("cut"), &dir.path().join("one"), 1e-5);
}

#[test]
fn an_mlp_split_in_column_row_pairs_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    crate::common::write(dir.path(), "p.toml", crate::common::TINY);
    // Layers 0-1 and 2-3 are pairs; the dropout after layer 0 falls on split activations.
    let mlp = [
        "--set",
        "wrap.model.hidden=[16, 16, 16]",
        "--set",
        "wrap.model.dropout=0.2",
        "--set",
        "train.optimizer=\"sgd\"",
        "--set",
        "train.clip_grad_norm=0.5",
    ];
    train(dir.path(), "one", &[&mlp[..], &["--set", "run.world_size=1"]].concat());
    let stdout = train(dir.path(), "tp", &[&mlp[..], &TP2].concat());
    assert!(stdout.contains("each rank holds 1 / tensor of each pair of layers"), "{stdout}");
    crate::common::assert_close_runs(&dir.path().join("tp"), &dir.path().join("one"), 1e-5);
}

#[test]
fn a_checkpoint_saved_at_tensor_2_resumes_on_one_rank_and_one_rank_s_resumes_at_data_2_tensor_2() {
    let dir = tempfile::tempdir().unwrap();
    crate::common::write(dir.path(), "p.toml", LM);
    let every = ["--set", "checkpoint.every=1"];
    train(dir.path(), "whole", &every);
    train(dir.path(), "from-tp", &[&every[..], &TP2, &["--set", "train.epochs=1"]].concat());
    let back = ["--set", "train.epochs=2", "--set", "run.world_size=1", "--set", "wrap.mesh.tensor=1"];
    resume(dir.path(), "from-tp", &back);
    crate::common::assert_close_runs(&dir.path().join("from-tp"), &dir.path().join("whole"), 1e-5);

    train(dir.path(), "to-tp", &[&every[..], &["--set", "train.epochs=1"]].concat());
    let mesh = ["--set", "train.epochs=2", "--set", "run.world_size=4", "--set", "wrap.mesh.tensor=2"];
    let batch = ["--set", "train.batch_size=8"];
    resume(dir.path(), "to-tp", &[&mesh[..], &batch].concat());
    crate::common::assert_close_runs(&dir.path().join("to-tp"), &dir.path().join("whole"), 1e-5);
}

#[test]
fn a_checkpoint_saved_at_tensor_2_resumes_at_tensor_4_and_at_data_2_under_fsdp() {
    let dir = tempfile::tempdir().unwrap();
    crate::common::write(dir.path(), "p.toml", LM);
    let every = ["--set", "checkpoint.every=1"];
    train(dir.path(), "whole", &every);
    let first = [&every[..], &TP2, &["--set", "train.epochs=1"]].concat();
    train(dir.path(), "to-tp4", &first);
    let tp4 = ["--set", "train.epochs=2", "--set", "run.world_size=4", "--set", "wrap.mesh.tensor=4"];
    resume(dir.path(), "to-tp4", &tp4);
    crate::common::assert_close_runs(&dir.path().join("to-tp4"), &dir.path().join("whole"), 1e-5);

    train(dir.path(), "to-fsdp", &first);
    let fsdp = ["--set", "train.epochs=2", "--set", "wrap.mesh.tensor=1", "--set", "wrap.strategy=\"fsdp\""];
    resume(dir.path(), "to-fsdp", &[&fsdp[..], &["--set", "train.batch_size=8"]].concat());
    crate::common::assert_close_runs(&dir.path().join("to-fsdp"), &dir.path().join("whole"), 1e-5);
}

#[test]
fn pipeline_times_tensor_and_the_3d_mesh_at_8_ranks_equal_one_process_and_resume_on_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    crate::common::write(dir.path(), "p.toml", LM);
    train(dir.path(), "one", &[]);
    let pipeline = ["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.pipeline.micro_batches=2"];
    let two_d = ["--set", "run.world_size=4", "--set", "wrap.mesh.tensor=2"];
    let stdout = train(dir.path(), "pp-tp", &[&pipeline[..], &two_d].concat());
    assert!(stdout.contains("mesh: data 1 × tensor 2 × pipeline 2"), "{stdout}");
    assert!(
        stdout.contains("pipeline groups (a pipeline's stages, activations sent between them): [0, 2] [1, 3]"),
        "{stdout}"
    );
    // Two stages, each split across two ranks: the bubble of two stages, not four.
    assert!(stdout.contains("pipeline over 2 ranks (each stage split across 2 tensor ranks)"), "{stdout}");
    assert!(stdout.contains("(micro-batches + stages - 1) = 33%"), "{stdout}");
    // Each tensor rank of a stage exchanges with the same tensor rank of the next stage; the
    // last stage's last rank measures the loss.
    for said in
        [" to rank 2\n", " to rank 3\n", " from rank 0 ", " from rank 1 ", "loss on rank 3", "measured on rank 3"]
    {
        assert!(stdout.contains(said), "{said}: {stdout}");
    }
    crate::common::assert_close_runs(&dir.path().join("pp-tp"), &dir.path().join("one"), 1e-5);
    // With sequence parallelism the stages send each tensor rank's part of the sequence.
    let sp = ["--set", "wrap.mesh.sequence_parallel=true"];
    train(dir.path(), "pp-sp", &[&pipeline[..], &two_d, &sp].concat());
    crate::common::assert_close_runs(&dir.path().join("pp-sp"), &dir.path().join("one"), 1e-5);
    // Data 2 × pipeline 2 × tensor 2: each copy takes half of the global batch.
    let three_d = [
        "--set",
        "run.world_size=8",
        "--set",
        "wrap.mesh.tensor=2",
        "--set",
        "wrap.mesh.pipeline=2",
        "--set",
        "train.batch_size=8",
        "--set",
        "checkpoint.every=1",
    ];
    let stdout = train(dir.path(), "3d", &[&pipeline[..], &three_d].concat());
    assert!(
        stdout.contains(
            "data groups (copies of the model, each on its own shard of the data): [0, 4] [1, 5] [2, 6] [3, 7]"
        ),
        "{stdout}"
    );
    crate::common::assert_close_runs(&dir.path().join("3d"), &dir.path().join("one"), 1e-5);
    train(dir.path(), "cut", &[&pipeline[..], &three_d, &["--set", "train.epochs=1"]].concat());
    let one = [
        "--set",
        "train.epochs=2",
        "--set",
        "run.world_size=1",
        "--set",
        "wrap.strategy=\"ddp\"",
        "--set",
        "wrap.mesh.tensor=1",
        "--set",
        "wrap.mesh.pipeline=1",
        "--set",
        "wrap.pipeline.micro_batches=1",
        "--set",
        "train.batch_size=16",
    ];
    resume(dir.path(), "cut", &one);
    crate::common::assert_close_runs(&dir.path().join("cut"), &dir.path().join("one"), 1e-5);
}

/// `wrap.init` from a Hugging Face checkpoint at tensor 2: each rank reads its rows of `qkv`
/// and `fc` and its columns of `proj` and `out` (a run of each stored row), and the norms,
/// embedding and head whole: exactly its share of the weights' bytes
/// (`RUNNER_TEST_READ_BYTES`), not the column-split matrices whole.
#[test]
fn a_hugging_face_checkpoint_is_read_by_each_tensor_rank_s_slice_alone() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    crate::common::write(p, "book.txt", &crate::common::book());
    // The fixture's Llama with 2 key/value heads, which 2 tensor ranks split.
    let config = crate::hf::LLAMA.replace("\"num_key_value_heads\": 1", "\"num_key_value_heads\": 2");
    let kv = |n: &str| n.ends_with("k_proj.weight") || n.ends_with("v_proj.weight");
    let tensors: Vec<(String, Vec<i64>)> =
        crate::hf::llama_tensors().into_iter().map(|(n, s)| if kv(&n) { (n, vec![8, 8]) } else { (n, s) }).collect();
    crate::hf::checkpoint(p, "llama", &config, &tensors);
    crate::common::write(p, "p.toml", &crate::hf::TWIN.replace("INIT", "llama"));
    let read = p.join("read");
    std::fs::create_dir(&read).unwrap();
    let o = crate::common::runner()
        .args(["run", "p.toml", "--out", "tp", "--set", "train.epochs=1", "--set", "run.world_size=2"])
        .args(["--set", "wrap.mesh.tensor=2"])
        .env("RUNNER_TEST_READ_BYTES", &read)
        .current_dir(p)
        .output()
        .unwrap();
    crate::common::assert_ok(&o);
    let values = |keep: &dyn Fn(&str) -> bool| -> u64 {
        tensors.iter().filter(|(n, _)| keep(n)).map(|(_, s)| s.iter().product::<i64>() as u64).sum()
    };
    let split = |n: &str| n.contains("_proj.");
    // float32: the replicated tensors whole, half of each split matrix.
    let share = 4 * (values(&|n: &str| !split(n)) + values(&split) / 2);
    for rank in 0..2 {
        let got: u64 = std::fs::read_to_string(read.join(format!("rank-{rank}"))).unwrap().parse().unwrap();
        assert_eq!(got, share, "rank {rank} read {got} bytes of the checkpoint, not its share {share}");
    }
}
