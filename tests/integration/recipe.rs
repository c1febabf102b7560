//! The training recipe (issue 14) end to end: learning-rate schedules, gradient clipping,
//! accumulation, bf16 autocast, early stopping, pipeline checkpoints, and the plan's refusals.
use crate::common;

use std::path::Path;

use common::{assert_ok, run, run_and_kill, text, trace, write, TINY};
use polars::prelude::*;

/// A column of rank 0's rows.
fn rank0(dir: &Path, col: &str) -> Vec<Option<f64>> {
    let df = trace(dir);
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    df.filter(&mask).unwrap().column(col).unwrap().f64().unwrap().iter().collect()
}

fn close(a: &[Option<f64>], b: &[Option<f64>], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (e, (x, y)) in a.iter().zip(b).enumerate() {
        let (x, y) = (x.unwrap(), y.unwrap());
        assert!(((x - y) / y).abs() < tol, "{what}, epoch {}: {x} vs {y}", e + 1);
    }
}

/// The learning rates torch's own schedulers give for `steps` optimizer steps of a warmup of
/// `warmup` steps (LinearLR from lr / warmup) then a cosine to `min_lr` (CosineAnnealingLR with
/// T_max = the steps after the warmup), chained by SequentialLR, as a training loop steps them.
fn torch_cosine_lrs(lr: f64, min_lr: f64, warmup: usize, steps: usize) -> Vec<f64> {
    let script = format!(
        "import json, torch\n\
         p = torch.nn.Parameter(torch.zeros(1))\n\
         opt = torch.optim.SGD([p], lr={lr})\n\
         warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / {warmup}, end_factor=1.0, total_iters={w1})\n\
         cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max={decay}, eta_min={min_lr})\n\
         s = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[{warmup}])\n\
         lrs = []\n\
         for _ in range({steps}):\n    lrs.append(opt.param_groups[0]['lr']); opt.step(); s.step()\n\
         print(json.dumps(lrs))\n",
        w1 = warmup - 1,
        decay = steps - warmup,
    );
    let o = std::process::Command::new(common::reference_python()).args(["-c", &script]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The schedule's last step is torch's: `CosineAnnealingLR(T_max = N)` never reaches eta_min
/// within its N steps, and neither does the runner's cosine (min_lr one step past the run).
#[test]
fn a_cosine_schedule_with_warmup_is_torch_s_in_the_trace_and_in_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    // 300 rows per rank in batches of 16: 19 steps per epoch, 4 epochs: 76 steps, 19 of warmup.
    let args = [
        "--set",
        "train.epochs=4",
        "--set",
        "train.schedule.kind=\"cosine\"",
        "--set",
        "train.schedule.warmup_epochs=1",
        "--set",
        "train.schedule.min_lr=0.001",
    ];
    let o = run(&[&["validate", "p.toml"][..], &args].concat(), dir.path());
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(
        out.contains(
            "cosine 0.1 → 0.001 over 57 steps, after 19 warmup steps from 5.2632e-3; min_lr at step 77, one past the \
             last (as torch's schedulers)"
        ),
        "{out}"
    );
    assert_ok(&run(&[&["run", "p.toml", "--out", "r"][..], &args].concat(), dir.path()));
    let lr: Vec<f64> = rank0(&dir.path().join("r"), "lr").into_iter().map(Option::unwrap).collect();
    // The lr of each epoch's last step (0-based steps 18, 37, 56, 75), torch's at the same steps.
    let torch = torch_cosine_lrs(0.1, 0.001, 19, 76);
    let expected = [torch[18], torch[37], torch[56], torch[75]];
    for (e, (a, b)) in lr.iter().zip(expected).enumerate() {
        // torch computes its cosine recursively, step by step: a few roundings apart.
        assert!((a - b).abs() < 1e-12, "epoch {}: lr {a}, torch's {b}", e + 1);
    }
    assert!(lr[3] > 0.001 + 1e-6, "the last step trains above min_lr, as in torch: {}", lr[3]);
    let config = std::fs::read_to_string(dir.path().join("r/config.toml")).unwrap();
    assert!(config.contains("[train.schedule]\nkind = \"cosine\"  # --set train.schedule.kind=\"cosine\""), "{config}");
    assert!(
        config.contains("accumulate = 1  # default") && config.contains("precision = \"fp32\"  # default"),
        "{config}"
    );
}

#[test]
fn a_step_schedule_decays_by_gamma() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let args =
        ["--set", "train.epochs=3", "--set", "train.schedule.kind=\"step\"", "--set", "train.schedule.step_epochs=1"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "r"][..], &args].concat(), dir.path()));
    let lr: Vec<f64> = rank0(&dir.path().join("r"), "lr").into_iter().map(Option::unwrap).collect();
    let expected = [0.1, 0.01, 0.001];
    assert!(lr.iter().zip(expected).all(|(a, b)| (a - b).abs() < 1e-12), "{lr:?}");
}

/// k batches of B accumulated make the step of one batch of k·B: on one rank, and under DDP
/// (which syncs only on the last batch).
#[test]
fn accumulating_k_batches_equals_one_batch_k_times_larger_also_under_ddp() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    for world in ["1", "2"] {
        let w = format!("run.world_size={world}");
        let acc = format!("acc{world}");
        let big = format!("big{world}");
        let a =
            ["run", "p.toml", "--out", &acc, "--set", &w, "--set", "train.batch_size=8", "--set", "train.accumulate=4"];
        assert_ok(&run(&a, dir.path()));
        assert_ok(&run(&["run", "p.toml", "--out", &big, "--set", &w, "--set", "train.batch_size=32"], dir.path()));
        for col in ["global_train_loss", "val_loss"] {
            close(
                &rank0(&dir.path().join(&acc), col),
                &rank0(&dir.path().join(&big), col),
                1e-5,
                &format!("{col} at world size {world}: 4 × 8 vs 32"),
            );
        }
    }
}

#[test]
fn clipping_records_the_pre_clip_norm_and_a_loose_bound_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    assert_ok(&run(&["run", "p.toml", "--out", "plain"], dir.path()));
    assert_ok(&run(&["run", "p.toml", "--out", "loose", "--set", "train.clip_grad_norm=1e6"], dir.path()));
    assert_ok(&run(&["run", "p.toml", "--out", "tight", "--set", "train.clip_grad_norm=0.01"], dir.path()));
    let d = dir.path();
    assert_eq!(rank0(&d.join("plain"), "global_train_loss"), rank0(&d.join("loose"), "global_train_loss"));
    assert!(rank0(&d.join("plain"), "grad_norm_mean").iter().all(Option::is_none), "no norm without clipping");
    let (mean, max) = (rank0(&d.join("tight"), "grad_norm_mean"), rank0(&d.join("tight"), "grad_norm_max"));
    for (m, x) in mean.iter().zip(&max) {
        let (m, x) = (m.unwrap(), x.unwrap());
        assert!(m > 0.01 && x >= m, "pre-clip norms: mean {m}, max {x}");
    }
    assert_ne!(rank0(&d.join("plain"), "global_train_loss"), rank0(&d.join("tight"), "global_train_loss"));
}

/// A pipeline clips by the norm over every stage: the same steps as one process clipping its
/// whole model.
#[test]
fn a_pipeline_clips_by_the_global_norm_across_its_stages() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let common =
        ["--set", "run.world_size=2", "--set", "wrap.model.hidden=[16, 16]", "--set", "train.clip_grad_norm=0.05"];
    let pipe = [&["run", "p.toml", "--out", "pipe", "--set", "wrap.strategy=\"pipeline\""][..], &common].concat();
    assert_ok(&run(&pipe, dir.path()));
    // One process walking the same rows (a single pipeline's ranks walk the whole set).
    let one = [&["run", "p.toml", "--out", "one"][..], &common, &["--set", "run.world_size=1"]].concat();
    assert_ok(&run(&one, dir.path()));
    let d = dir.path();
    close(&rank0(&d.join("pipe"), "grad_norm_max"), &rank0(&d.join("one"), "grad_norm_max"), 1e-4, "norm");
    close(&rank0(&d.join("pipe"), "global_train_loss"), &rank0(&d.join("one"), "global_train_loss"), 1e-4, "loss");
}

#[test]
fn bf16_trains_close_to_fp32_and_fp16_is_refused_on_cpu() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    assert_ok(&run(&["run", "p.toml", "--out", "fp32", "--set", "train.epochs=4"], dir.path()));
    assert_ok(&run(
        &["run", "p.toml", "--out", "bf16", "--set", "train.epochs=4", "--set", "train.precision=\"bf16\""],
        dir.path(),
    ));
    let (a, b) =
        (rank0(&dir.path().join("fp32"), "global_train_loss"), rank0(&dir.path().join("bf16"), "global_train_loss"));
    assert_ne!(a, b, "bf16 autocast changes the arithmetic");
    close(&b, &a, 0.03, "bf16 vs fp32 train loss");

    let o = run(&["validate", "p.toml", "--set", "train.precision=\"fp16\""], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "`train.precision` (--set train.precision=\"fp16\"): \"fp16\" (with dynamic loss scaling) needs a GPU"
        ),
        "{err}"
    );
}

#[test]
fn early_stopping_keeps_the_best_model_and_says_why_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    // No improvement counts under min_delta = 10: the run stops after 1 + patience validations.
    let args =
        ["--set", "train.epochs=6", "--set", "train.early_stop.patience=2", "--set", "train.early_stop.min_delta=10"];
    let o = run(&[&["run", "p.toml", "--out", "r"][..], &args].concat(), dir.path());
    assert_ok(&o);
    let r = dir.path().join("r");
    assert_eq!(rank0(&r, "val_loss").len(), 3, "epochs 1 (best), 2 and 3 (no improvement), then the stop");
    assert!(r.join("model.best.safetensors").is_file() && r.join("model.safetensors").is_file());
    let best = std::fs::read(r.join("model.best.safetensors")).unwrap();
    assert_ne!(best, std::fs::read(r.join("model.safetensors")).unwrap(), "the best is epoch 1's model, not the last");
    let manifest = std::fs::read_to_string(r.join("manifest.json")).unwrap();
    assert!(
        manifest.contains("\"status\": \"complete\"")
            && manifest
                .contains("early stop after epoch 3: val_loss did not improve by more than 10 for 2 validations"),
        "{manifest}"
    );
    assert_ok(&run(&["run", "p.toml", "--out", "whole"], dir.path()));
    let manifest = std::fs::read_to_string(dir.path().join("whole/manifest.json")).unwrap();
    assert!(manifest.contains("\"stopped\": \"completed train.epochs = 2\""), "{manifest}");
}

#[test]
fn impossible_combinations_are_refused_before_any_rank_starts() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    for (args, expected) in [
        (
            &["--set", "train.accumulate=20"][..],
            "`train.accumulate` (--set train.accumulate=20): 20 batches per optimizer step, but an epoch has only 19 \
             batches per rank",
        ),
        (
            &["--set", "train.schedule.warmup_steps=38"][..],
            "the warmup (38 optimizer steps) is as long as the run or longer",
        ),
        (
            &["--set", "validate.every=0", "--set", "train.early_stop.patience=2"][..],
            "`validate.every` (--set validate.every=0): is 0 (no validation), but [train.early_stop] watches a \
             validation metric",
        ),
        (&["--set", "wrap.sync_batchnorm=true"][..], "MLP 5-16-3 has no batch norm layers to synchronise"),
        (&["--set", "train.clip_grad_norm=0"][..], "must be a positive norm, got 0"),
        (
            &["--set", "train.fused=true"][..],
            "`train.fused` (--set train.fused=true): the runner has a fused kernel for \"adam\" and \"adamw\" only",
        ),
        (&["--set", "train.schedule.min_lr=0.01"][..], "is only read by kind = \"linear\" or \"cosine\""),
        (&["--set", "train.schedule.kind=\"step\""][..], "needs step_size (optimizer steps) or step_epochs"),
    ] {
        let o = run(&[&["run", "p.toml", "--out", "never"][..], args].concat(), dir.path());
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(!dir.path().join("never").exists(), "{args:?}: nothing ran");
    }
}

/// The recipe's keys at their defaults leave the run id as it was. run.numerics changed it: the
/// seed pipeline computes natively by default now; with "portable", the default it was made
/// under, it keeps the id it had then.
#[test]
fn default_configurations_keep_their_run_id() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = run(&["validate", "pipelines/ddp.toml"], root);
    assert_ok(&o);
    assert!(text(&o).0.contains("run ddp (f022e20ac7c1)"), "{}", text(&o).0);
    let o = run(&["validate", "pipelines/ddp.toml", "--set", "run.numerics=\"portable\""], root);
    assert_ok(&o);
    assert!(text(&o).0.contains("run ddp (0abe5d2d8cf0)"), "{}", text(&o).0);
}

/// Every recipe option at once, killed after the epoch-2 checkpoint and resumed: bit-identical to
/// an uninterrupted run, under DDP and in a pipeline.
const RECIPE: &str = r#"
[run]
name = "recipe"
world_size = 2
timeout_s = 10
abort_after_s = 2

[load]
rows = 2000
features = 8
classes = 3
validation_rows = 100

[wrap.model]
hidden = [32, 32]

[train]
epochs = 5
batch_size = 16
optimizer = "adamw"
lr = 0.01
weight_decay = 0.01
clip_grad_norm = 0.5
accumulate = 3
precision = "bf16"

[train.schedule]
kind = "cosine"
warmup_steps = 10
min_lr = 0.0001

[checkpoint]
every = 1
keep = 2
"#;

fn resumes_bit_identical(extra: &[&str], files: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RECIPE);
    assert_ok(&run(&[&["run", "p.toml", "--out", "whole"][..], extra].concat(), dir.path()));
    run_and_kill(dir.path(), "cut", extra, 1);
    assert_ok(&run(&["run", "--resume", "cut"], dir.path()));
    let (a, b) = (trace(&dir.path().join("whole")), trace(&dir.path().join("cut")));
    assert_eq!(a.height(), 5 * 2);
    for name in a.get_column_names() {
        if common::measured(name) {
            continue;
        }
        assert_eq!(a.column(name).unwrap(), b.column(name).unwrap(), "column {name} differs after resume");
    }
    for f in files {
        let read = |d: &str| std::fs::read(dir.path().join(d).join(f)).unwrap();
        assert!(read("whole") == read("cut"), "{f} differs after resume");
    }
}

#[test]
fn ddp_with_the_whole_recipe_resumes_bit_identical() {
    resumes_bit_identical(&[], &["checkpoints/epoch-0005/rank-0.safetensors", "model.safetensors"]);
}

/// `train.fused = false` (PyTorch's `_foreach_` passes) keeps the fused kernel's state, so it
/// resumes bit-identical too.
#[test]
fn foreach_adamw_with_the_whole_recipe_resumes_bit_identical() {
    resumes_bit_identical(&["--set", "train.fused=false"], &["checkpoints/epoch-0005/rank-0.safetensors"]);
}

/// Under FSDP (each rank steps its shards) with clipping, decay and bf16, the foreach path ends
/// where the fused kernel does.
#[test]
fn fsdp_with_the_whole_recipe_ends_alike_fused_and_foreach() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RECIPE);
    for (out, fused) in [("fused", "true"), ("foreach", "false")] {
        let fused = format!("train.fused={fused}");
        let args = ["run", "p.toml", "--out", out, "--set", "wrap.strategy=\"fsdp\"", "--set", &fused];
        assert_ok(&run(&args, dir.path()));
    }
    common::assert_close_runs(&dir.path().join("fused"), &dir.path().join("foreach"), 1e-5);
}

#[test]
fn a_pipeline_with_the_whole_recipe_resumes_bit_identical() {
    let pipeline = ["--set", "wrap.strategy=\"pipeline\"", "--set", "wrap.pipeline.micro_batches=2"];
    resumes_bit_identical(
        &pipeline,
        &[
            "checkpoints/epoch-0005/rank-0.safetensors",
            "checkpoints/epoch-0005/rank-1.safetensors",
            "model.safetensors",
        ],
    );
}

#[test]
fn a_pipeline_resumes_under_another_partition_and_a_length_dependent_schedule_keeps_its_length() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", RECIPE);
    let pipeline = ["--set", "wrap.strategy=\"pipeline\"", "--set", "train.epochs=1"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "r"][..], &pipeline].concat(), dir.path()));
    assert!(dir.path().join("r/checkpoints/epoch-0001/rank-1.safetensors").is_file());
    let o = run(&["run", "--resume", "r", "--set", "train.epochs=3"], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("the cosine learning-rate schedule spans the run's length"), "{err}");
    // Another partition of the same model spreads the same steps otherwise: it resumes. The
    // checkpoint has nothing left to run (epoch 1 of 1), which is what is then refused.
    let o = run(&["run", "--resume", "r", "--set", "wrap.pipeline.stages=[[0, 1], [2]]"], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("nothing is left to run"), "{err}");
}
