//! torchvision's ResNet-18, scripted, as a user's own module under DDP over 2 ranks on small
//! 3×32×32 images: its whole state (62 parameters, 60 batch norm buffers) under PyTorch's names.
//! The fixtures are made at test time by tests/fixtures/make_resnet18.py (the module is ~45 MB,
//! not committed), with the tests' Python (`scripts/setup.sh --tests` installs torchvision).
use crate::common;

use std::path::Path;
use std::process::Command;

use common::{assert_ok, reference_python, run, text, trace, write};
use polars::prelude::*;

const RESNET: &str = r#"
[run]
name = "resnet"
seed = 5
world_size = 2
timeout_s = 120

[load]
source = "tensors"
path = "images.npz"

[normalize]
method = "none"

[wrap.model]
kind = "torchscript"
path = "resnet18.pt"

[train]
epochs = 2
batch_size = 8
lr = 0.05

[validate]
rows = 16
on = "all"

[checkpoint]
every = 1
"#;

fn script() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/make_resnet18.py")
}

fn python(args: &[&str]) -> String {
    let o = Command::new(reference_python()).arg(script()).args(args).output().unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "make_resnet18.py {args:?} failed:\n{out}\n{err}");
    out
}

/// Every trace column but the timings and the run id (train.epochs, part of it, was raised on
/// resume).
fn assert_same_trace(a: &DataFrame, b: &DataFrame) {
    assert_eq!(a.height(), b.height());
    for name in a.get_column_names() {
        if name == "run_id" || common::measured(name) {
            continue;
        }
        assert_eq!(a.column(name).unwrap(), b.column(name).unwrap(), "column {name} differs after resume");
    }
}

fn column(df: &DataFrame, name: &str) -> Vec<f64> {
    df.column(name).unwrap().f64().unwrap().into_no_null_iter().collect()
}

#[test]
fn resnet18_state_is_whole_broadcast_resumed_exactly_and_loads_into_torchvision() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    python(&[d.to_str().unwrap()]);
    write(d, "p.toml", RESNET);

    // Uninterrupted, and one epoch then resumed for the second from its checkpoint.
    let o = run(&["run", "p.toml", "--out", "whole"], d);
    assert_ok(&o);
    assert!(text(&o).0.contains("TorchScript resnet18.pt"), "{}", text(&o).0);
    assert_ok(&run(&["run", "p.toml", "--out", "cut", "--set", "train.epochs=1"], d));
    assert_ok(&run(&["run", "--resume", "cut", "--set", "train.epochs=2"], d));
    let (whole, cut) = (trace(&d.join("whole")), trace(&d.join("cut")));
    assert_same_trace(&whole, &cut);
    // model.safetensors' metadata names the run (its id differs); its tensors must not.
    let model = |run: &str| -> std::collections::BTreeMap<String, tch::Tensor> {
        tch::Tensor::read_safetensors(d.join(run).join("model.safetensors")).unwrap().into_iter().collect()
    };
    let (a, b) = (model("whole"), model("cut"));
    assert_eq!(a.len(), 62 + 60);
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, t) in &a {
        assert!(t.equal(&b[name]), "{name} differs after resume");
    }
    let bytes = |run: &str| common::checkpoint_bytes(&d.join(run), "epoch-0002");
    assert!(bytes("whole") == bytes("cut"), "checkpoint (running statistics included) differs after resume");

    // Buffers broadcast from rank 0: both ranks validate the same model, so their validation
    // metrics agree to the bit (each rank's own running statistics would not).
    let rank = |r: u32| {
        let mask = whole.column("rank").unwrap().u32().unwrap().equal(r);
        whole.filter(&mask).unwrap()
    };
    let (r0, r1) = (rank(0), rank(1));
    assert_eq!(column(&r0, "val_loss"), column(&r1, "val_loss"), "the ranks' buffers differ");

    // model.safetensors in torchvision's own class, strict: the trace's last validation.
    let out = python(&["check", d.join("whole").to_str().unwrap(), d.to_str().unwrap()]);
    let got: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let names: Vec<&str> = got["names"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(names.len(), 62 + 60);
    assert!(names.contains(&"layer1.0.bn1.running_mean") && names.contains(&"bn1.num_batches_tracked"));
    assert_eq!(got["rows"], 16);
    let (loss, acc) = (*column(&r0, "val_loss").last().unwrap(), *column(&r0, "val_acc").last().unwrap());
    let py_loss = got["val_loss"].as_f64().unwrap();
    assert!(((py_loss - loss) / loss).abs() < 1e-5, "validation loss: runner {loss}, torchvision {py_loss}");
    assert_eq!(got["val_acc"].as_f64().unwrap(), acc, "validation accuracy");
}

/// The same module sharded (`wrap.strategy = "fsdp"`, one unit: the runner cannot see inside
/// it): every step's loss and the final model as DDP's, and model.safetensors still loads into
/// torchvision's own class.
#[test]
fn resnet18_under_fsdp_gives_ddps_losses_and_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    python(&[d.to_str().unwrap()]);
    write(d, "p.toml", &RESNET.replace("epochs = 2", "steps = 8"));
    let steps = ["--set", "validate.every_steps=1", "--set", "checkpoint.every=0"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "ddp"], steps.as_slice()].concat(), d));
    let o =
        run(&[&["run", "p.toml", "--out", "fsdp", "--set", "wrap.strategy=\"fsdp\""], steps.as_slice()].concat(), d);
    assert_ok(&o);
    assert!(
        text(&o).0.contains("TorchScript module, 62 parameters, 60 buffers: 11181642 parameters"),
        "{}",
        text(&o).0
    );
    let (a, b) = (trace(&d.join("ddp")), trace(&d.join("fsdp")));
    let (x, y) = (column(&a, "global_train_loss"), column(&b, "global_train_loss"));
    assert_eq!(x.len(), 2 * 8);
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        assert!((p - q).abs() <= 1e-5 * p.abs(), "row {i}: {q} against DDP's {p}");
    }
    let model = |run: &str| -> std::collections::BTreeMap<String, tch::Tensor> {
        tch::Tensor::read_safetensors(d.join(run).join("model.safetensors")).unwrap().into_iter().collect()
    };
    let (ma, mb) = (model("ddp"), model("fsdp"));
    assert_eq!(ma.keys().collect::<Vec<_>>(), mb.keys().collect::<Vec<_>>());
    for (name, t) in &ma {
        let diff = (&mb[name] - t).abs().max().double_value(&[]);
        assert!(diff <= 1e-5 * t.abs().max().double_value(&[]).max(1e-6), "{name} differs by {diff:e}");
    }
    let out = python(&["check", d.join("fsdp").to_str().unwrap(), d.to_str().unwrap()]);
    let got: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(got["names"].as_array().unwrap().len(), 62 + 60);
}
