//! Model kinds beyond the MLP, end to end on the real binary: a CNN over synthetic images (DDP
//! at world sizes 1 and 2, a pipeline over its conv blocks, batch norm's running statistics in
//! model.safetensors and checkpoints, SyncBatchNorm under DDP against one process on the double
//! batch), a TorchScript module (tests/fixtures/tiny_mlp.pt, made by
//! tests/fixtures/make_torchscript.py) under DDP, images from a tensors file, and the messages
//! for bad models.
use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{assert_ok, run, run_and_kill, runner, text, trace, write, TINY};
use polars::prelude::*;
use tch::Tensor;

/// 1 × 8 × 8 images of 3 classes; two conv blocks (the second with batch norm when `bn`), one
/// hidden linear layer.
fn cnn(bn: bool) -> String {
    format!(
        r#"
[run]
name = "cnn"
seed = 5
world_size = 2
timeout_s = 30

[load]
image = [1, 8, 8]
classes = 3
rows = 256
validation_rows = 64

[normalize]
method = "standard"
scope = "global"

[wrap.model]
kind = "cnn"
conv = [
  {{ channels = 4, kernel = 3, padding = 1, pool = "max" }},
  {{ channels = 6, kernel = 3, padding = 0, batch_norm = {bn}, pool = "avg" }},
]
hidden = [12]

[train]
epochs = 2
batch_size = 16
lr = 0.05
"#
    )
}

/// `cnn(true)` with batch norm in both blocks, synchronised (`wrap.sync_batchnorm`).
fn synced_cnn() -> String {
    let p = cnn(true).replace("padding = 1, pool", "padding = 1, batch_norm = true, pool");
    p.replace("[wrap.model]", "[wrap]\nsync_batchnorm = true\n\n[wrap.model]")
}

/// Rank 0's global training loss per epoch.
fn losses(dir: &Path) -> Vec<f64> {
    let df = trace(dir);
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    let df = df.filter(&mask).unwrap();
    df.column("global_train_loss").unwrap().f64().unwrap().into_no_null_iter().collect()
}

fn params(dir: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("model.safetensors")).expect("model.safetensors").into_iter().collect()
}

/// Same losses (relative 1e-5) and same final tensors (relative to each tensor's largest element).
fn assert_same(dir: &Path, a: &str, b: &str) {
    let (la, lb) = (losses(&dir.join(a)), losses(&dir.join(b)));
    assert_eq!(la.len(), lb.len());
    for (e, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert!(((x - y) / y).abs() < 1e-5, "epoch {}: {a} {x}, {b} {y}", e + 1);
    }
    let (pa, pb) = (params(&dir.join(a)), params(&dir.join(b)));
    assert_eq!(pa.keys().collect::<Vec<_>>(), pb.keys().collect::<Vec<_>>());
    for (name, want) in &pb {
        let diff = (&pa[name] - want).abs().max().double_value(&[]);
        let rel = diff / want.abs().max().double_value(&[]).max(1e-12);
        assert!(rel < 1e-5, "{a} vs {b}: {name} differs by {diff:e} ({rel:e} of its largest element)");
    }
}

#[test]
fn a_cnn_with_ddp_over_2_ranks_x_b_equals_1_rank_x_2b() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &cnn(false));
    let two = ["run", "p.toml", "--out", "two", "--set", "train.batch_size=8"];
    let o = run(&two, dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("CNN 1×8×8 → 4×4×4 → 6×1×1 → 12-3"), "{stdout}");
    let one = ["run", "p.toml", "--out", "one", "--set", "run.world_size=1", "--set", "train.batch_size=16"];
    assert_ok(&run(&one, dir.path()));
    assert_same(dir.path(), "two", "one");
    let l = losses(&dir.path().join("one"));
    assert!(l[1] < l[0], "the CNN learns: {l:?}");
}

#[test]
fn batch_norm_statistics_are_saved_with_the_model_and_a_resumed_run_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &cnn(true));
    assert_ok(&run(&["run", "p.toml", "--out", "whole", "--set", "train.epochs=3"], dir.path()));
    let model = params(&dir.path().join("whole"));
    let var = &model["bn1.running_var"];
    assert_eq!(var.size(), [6]);
    assert!(var.ne(1.0).any().int64_value(&[]) == 1, "the running variance moved from 1: {var}");
    assert!(model.contains_key("bn1.running_mean") && !model.contains_key("bn0.running_mean"));

    let first = ["run", "p.toml", "--out", "cut", "--set", "train.epochs=2", "--set", "checkpoint.every=1"];
    assert_ok(&run(&first, dir.path()));
    let resumed = ["run", "--resume", "cut", "--set", "train.epochs=3"];
    assert_ok(&run(&resumed, dir.path()));
    let after = params(&dir.path().join("cut"));
    for (name, want) in &model {
        assert!(after[name].equal(want), "{name} differs after resuming");
    }
}

/// Largest relative difference of the per-epoch losses of runs `a` and `b`.
fn loss_gap(dir: &Path, a: &str, b: &str) -> f64 {
    let (la, lb) = (losses(&dir.join(a)), losses(&dir.join(b)));
    la.iter().zip(&lb).map(|(x, y)| ((x - y) / y).abs()).fold(0.0, f64::max)
}

/// Largest difference of the final running statistics of runs `a` and `b`.
fn running_gap(dir: &Path, a: &str, b: &str) -> f64 {
    let (pa, pb) = (params(&dir.join(a)), params(&dir.join(b)));
    pb.iter()
        .filter(|(name, _)| name.contains("running_"))
        .map(|(name, want)| (&pa[name] - want).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// SyncBatchNorm under DDP: 2 ranks × B rows are one process × 2B rows, losses and final model
/// (running statistics included), over batch norm in both conv blocks and an uneven last batch;
/// plain per-rank batch norm at 2 × B is not (so the comparison can fail); on one rank the key is
/// plain batch norm, bit for bit.
#[test]
fn sync_batchnorm_under_ddp_over_2_ranks_x_b_equals_1_rank_x_2b_and_plain_batch_norm_does_not() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &synced_cnn());
    // 128 rows per rank in batches of 12: each epoch ends on a batch of 8 per rank (16 on one).
    let o = run(&["run", "p.toml", "--out", "two", "--set", "train.batch_size=12"], dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("the 2 ranks' batches") && stdout.contains("SyncBatchNorm"), "{stdout}");
    let one = ["run", "p.toml", "--out", "one", "--set", "run.world_size=1", "--set", "train.batch_size=24"];
    let o = run(&one, dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("plain batch norm: nothing to synchronise (one rank)"), "{}", text(&o).0);
    assert_same(dir.path(), "two", "one");
    let model = params(&dir.path().join("two"));
    assert!(model["bn0.running_var"].ne(1.0).any().int64_value(&[]) == 1, "the running statistics moved");

    let plain = ["--set", "wrap.sync_batchnorm=false"];
    assert_ok(&run(
        &[&["run", "p.toml", "--out", "local", "--set", "train.batch_size=12"][..], &plain].concat(),
        dir.path(),
    ));
    let (synced, local) = (loss_gap(dir.path(), "two", "one"), loss_gap(dir.path(), "local", "one"));
    let (synced_stats, local_stats) = (running_gap(dir.path(), "two", "one"), running_gap(dir.path(), "local", "one"));
    eprintln!(
        "2 × 12 against 1 × 24: losses {synced:e} (synchronised), {local:e} (per rank); running statistics \
         {synced_stats:e}, {local_stats:e}"
    );
    assert!(local > 100.0 * synced.max(1e-7), "per-rank batch norm should differ: {local:e}");
    assert!(local_stats > 1e-3, "per-rank running statistics should differ: {local_stats:e}");

    let one_plain = [&one[..2], &["--out", "one-plain"], &one[4..], &plain].concat();
    assert_ok(&run(&one_plain, dir.path()));
    assert_eq!(losses(&dir.path().join("one")), losses(&dir.path().join("one-plain")));
    let plain_model = params(&dir.path().join("one-plain"));
    for (name, want) in params(&dir.path().join("one")) {
        assert!(plain_model[&name].equal(&want), "{name}: one rank with sync_batchnorm is not plain batch norm");
    }
}

/// SyncBatchNorm with gradient accumulation: every micro-batch's statistics cover both ranks, so
/// 2 ranks × 12 rows × 2 micro-batches per step equal 1 rank × 24 rows × 2 (losses, weights and
/// running statistics).
#[test]
fn sync_batchnorm_with_accumulation_over_2_ranks_equals_one_rank_on_the_double_batch() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &synced_cnn());
    let accumulate = ["--set", "train.accumulate=2"];
    let two = ["run", "p.toml", "--out", "two", "--set", "train.batch_size=12"];
    assert_ok(&run(&[&two[..], &accumulate].concat(), dir.path()));
    let one = ["run", "p.toml", "--out", "one", "--set", "run.world_size=1", "--set", "train.batch_size=24"];
    assert_ok(&run(&[&one[..], &accumulate].concat(), dir.path()));
    assert_same(dir.path(), "two", "one");
}

/// A SyncBatchNorm run whose rank 1 is killed after its second checkpoint fails cleanly (rank 0's
/// all-reduce names the dead peer) and, resumed, ends bit-identical to an uninterrupted run.
#[test]
fn a_killed_sync_batchnorm_run_resumed_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &synced_cnn());
    let extra = ["--set", "train.epochs=6", "--set", "checkpoint.every=1", "--set", "run.abort_after_s=2"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "whole"][..], &extra].concat(), dir.path()));
    let err = run_and_kill(dir.path(), "cut", &extra, 1);
    assert!(err.contains("rank 1 was killed") && !err.contains("panicked"), "{err}");
    assert_ok(&run(&["run", "--resume", "cut"], dir.path()));
    let (a, b) = (trace(&dir.path().join("whole")), trace(&dir.path().join("cut")));
    assert_eq!(a.height(), 6 * 2);
    for name in a.get_column_names() {
        if common::measured(name) {
            continue;
        }
        assert_eq!(a.column(name).unwrap(), b.column(name).unwrap(), "column {name} differs after resume");
    }
    let checkpoint = |d: &str| common::checkpoint_bytes(&dir.path().join(d), "epoch-0006");
    assert!(checkpoint("whole") == checkpoint("cut"), "the last checkpoint differs after resume");
    let model = |d: &str| std::fs::read(dir.path().join(d).join("model.safetensors")).unwrap();
    assert!(model("whole") == model("cut"), "model.safetensors differs after resume");
}

#[test]
fn a_pipeline_over_conv_blocks_equals_one_process() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &cnn(true));
    assert_ok(&run(&["run", "p.toml", "--out", "one", "--set", "run.world_size=1"], dir.path()));
    let pipe = ["run", "p.toml", "--out", "pipe", "--set", "wrap.strategy=\"pipeline\"", "--set", "run.world_size=2"];
    let o = run(&pipe, dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("layers 0-1 (1 × 8 × 8-4 × 4 × 4-6 × 1 × 1): 268 parameters"), "{stdout}");
    assert!(stdout.contains("layers 2-3 (6 × 1 × 1-12-3): 123 parameters"), "{stdout}");
    assert_same(dir.path(), "pipe", "one");
}

#[test]
fn images_from_a_tensors_file_train_like_the_same_images_generated() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &cnn(false));
    let gen = ["run", "p.toml", "--out", "gen", "--set", "run.world_size=1", "--set", "train.epochs=1"];
    assert_ok(&run(&gen, dir.path()));
    // The same rows through a file: the runner's own synthetic images, saved as x and y.
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("gen/plan.json")).unwrap()).unwrap();
    let spec: runner::data::DataSpec = serde_json::from_value(plan["data"].clone()).unwrap();
    let data = runner::data::load(&spec).unwrap();
    let (x, y) = data.train.gather(&(0..spec.rows as i64).collect::<Vec<_>>()).unwrap();
    Tensor::write_npz(&[("x", x), ("y", y)], dir.path().join("images.npz")).unwrap();
    Tensor::write_npz(&[("x", &data.val_x), ("y", &data.val_y)], dir.path().join("val.npz")).unwrap();
    let file = cnn(false)
        .replace("image = [1, 8, 8]", "source = \"tensors\"\npath = \"images.npz\"\nvalidation_path = \"val.npz\"");
    let file = file.replace("rows = 256\n", "").replace("validation_rows = 64\n", "");
    write(dir.path(), "f.toml", &file);
    let o =
        run(&["run", "f.toml", "--out", "file", "--set", "run.world_size=1", "--set", "train.epochs=1"], dir.path());
    assert_ok(&o);
    assert_eq!(losses(&dir.path().join("file")), losses(&dir.path().join("gen")));
}

fn torchscript_pipeline(dir: &Path) {
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_mlp.pt"), dir.join("m.pt")).unwrap();
    let p = TINY.replace("[wrap.model]\nhidden = [16]", "[wrap.model]\nkind = \"torchscript\"\npath = \"m.pt\"");
    write(dir, "p.toml", &p);
}

#[test]
fn a_torchscript_module_trains_under_ddp_like_one_process_on_the_double_batch() {
    let dir = tempfile::tempdir().unwrap();
    torchscript_pipeline(dir.path());
    let global = ["--set", "normalize.scope=\"global\""];
    let o = run(&[&["run", "p.toml", "--out", "two", "--set", "train.batch_size=8"][..], &global].concat(), dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    // 5·8 + 8 + 8·3 + 3.
    assert!(stdout.contains("75 parameters"), "{stdout}");
    let one = ["run", "p.toml", "--out", "one", "--set", "run.world_size=1", "--set", "train.batch_size=16"];
    assert_ok(&run(&[&one[..], &global].concat(), dir.path()));
    assert_same(dir.path(), "two", "one");
    let names: Vec<String> = params(&dir.path().join("one")).into_keys().collect();
    assert_eq!(names, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], "PyTorch's own names");
}

/// `runner validate` on `p.toml` with `args`: exit code 2 and exactly `expected` on stderr.
fn refused(dir: &Path, args: &[&str], expected: &str) {
    let out = runner().current_dir(dir).args(["validate", "p.toml"]).args(args).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(stderr.trim_end(), expected);
}

#[test]
fn bad_models_are_refused_with_pinned_messages() {
    let dir = tempfile::tempdir().unwrap();
    torchscript_pipeline(dir.path());
    refused(
        dir.path(),
        &["--set", "load.classes=4"],
        "error: p.toml: invalid configuration:\n  `wrap.model.path` (file p.toml:16): m.pt, on a batch of 16 rows of the \
         data (shape [16, 5]) in training mode, returns shape [16, 3] where the task needs [16, 4] (one row of 4 per \
         sample)",
    );
    refused(
        dir.path(),
        &["--set", "wrap.strategy=\"pipeline\""],
        "error: p.toml: invalid configuration:\n  `wrap.strategy` (--set wrap.strategy=\"pipeline\"): a TorchScript module is \
         one opaque graph to the runner: it cannot be cut into pipeline stages; use \"ddp\" (or a built-in model kind, \
         whose layers a pipeline can split)",
    );
    refused(
        dir.path(),
        &["--set", "wrap.sync_batchnorm=true"],
        "error: p.toml: invalid configuration:\n  `wrap.sync_batchnorm` (--set wrap.sync_batchnorm=true): TorchScript m.pt \
         runs its own layers: the runner cannot synchronise batch norm inside it; remove it (or use a built-in model \
         kind, such as \"cnn\" with batch_norm blocks)",
    );
    write(dir.path(), "m.pt", "def forward(self, x): return x\n");
    refused(
        dir.path(),
        &[],
        "error: p.toml: invalid configuration:\n  `wrap.model.path` (file p.toml:16): m.pt is not a TorchScript module (not the zip \
         archive torch.jit.save writes); save one with torch.jit.script(model).save(path) or torch.jit.trace(model, \
         example).save(path)",
    );
    write(dir.path(), "p.toml", &cnn(false));
    refused(
        dir.path(),
        &["--set", "wrap.sync_batchnorm=true"],
        "error: p.toml: invalid configuration:\n  `wrap.sync_batchnorm` (--set wrap.sync_batchnorm=true): CNN 1×8×8 → \
         4×4×4 → 6×1×1 → 12-3 has no batch norm layers to synchronise; remove it",
    );
    write(dir.path(), "p.toml", &synced_cnn());
    refused(
        dir.path(),
        &["--set", "wrap.strategy=\"pipeline\""],
        "error: p.toml: invalid configuration:\n  `wrap.sync_batchnorm` (file p.toml:19): is not available with \
         wrap.strategy = \"pipeline\": each rank of a pipeline holds other layers, and a batch norm layer \
         normalises each micro-batch on its own; synchronising over the pipeline's copies is not implemented (torch \
         has no equivalent either). Use wrap.strategy = \"ddp\", or remove it",
    );
    let o = runner().current_dir(dir.path()).args(["validate", "p.toml", "--set", "wrap.strategy=\"none\""]).output();
    let o = o.unwrap();
    assert_ok(&o);
    assert!(text(&o)
        .0
        .contains("plain batch norm: nothing to synchronise (with wrap.strategy = \"none\" the ranks train alone)"));
    write(dir.path(), "p.toml", &cnn(false));
    refused(
        dir.path(),
        &["--set", "load.image=[1, 5, 5]"],
        "error: p.toml: invalid configuration:\n  `wrap.model.conv` (file p.toml:20): block 1 reduces the image below 1 pixel: its \
         2 × 2 input padded by 0 is smaller than its 3 × 3 kernel; the data's images are 1 × 5 × 5: use fewer or \
         smaller kernels and pools, or more padding",
    );
}
