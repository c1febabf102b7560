//! Tracking, checked by the trackers' own code: TensorBoard's `EventAccumulator` reads the event
//! files of real runs (during and after the run), and an MLflow tracking server started here
//! (`mlflow server`, sqlite backend, loopback port) is asked through its REST API what it received.
use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use polars::prelude::*;
use serde_json::{json, Value};

/// Reads every event file under argv[1] with TensorBoard's reader: scalars, the config text and
/// the hparams plugin's session start and end, as JSON.
const READ_EVENTS: &str = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.plugins.hparams import plugin_data_pb2
a = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
a.Reload()
out = {"scalars": {t: [[e.step, e.value] for e in a.Scalars(t)] for t in a.Tags()["scalars"]}}
tensors = a.Tags()["tensors"]
out["text"] = a.Tensors("config")[0].tensor_proto.string_val[0].decode() if "config" in tensors else None
hp = {}
for tag, content in a.PluginTagToContent("hparams").items():
    d = plugin_data_pb2.HParamsPluginData.FromString(content)
    if d.HasField("session_start_info"):
        hp["start"] = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in d.session_start_info.hparams.items()}
    if d.HasField("session_end_info"):
        hp["end"] = d.session_end_info.status
out["hparams"] = hp
print(json.dumps(out))
"#;

fn read_events(logdir: &Path) -> Value {
    let o = Command::new(reference_python()).arg("-c").arg(READ_EVENTS).arg(logdir).output().unwrap();
    assert!(o.status.success(), "EventAccumulator failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The trace column each row scalar comes from (rank 0's rows).
const FROM_TRACE: &[(&str, &str)] = &[
    ("train/loss", "global_train_loss"),
    ("train/accuracy", "global_train_acc"),
    ("train/lr", "lr"),
    ("train/grad_norm", "grad_norm_mean"),
    ("val/loss", "val_loss"),
    ("val/accuracy", "val_acc"),
    ("val/f1", "val_f1"),
    ("throughput/samples_per_s", "samples_per_s"),
    ("time/epoch_s", "epoch_s"),
];

/// Every scalar of the trace's rank-0 rows, at its optimizer step, equals TensorBoard's (float32).
fn assert_scalars_equal_trace(events: &Value, run_dir: &Path) {
    let df = trace(run_dir);
    let df = df.filter(&df.column("rank").unwrap().u32().unwrap().equal(0)).unwrap();
    let steps: Vec<u64> = df.column("step").unwrap().u64().unwrap().into_no_null_iter().collect();
    assert!(steps.len() >= 2, "{steps:?}");
    for (tag, column) in FROM_TRACE {
        let values: Vec<Option<f64>> = df.column(column).unwrap().f64().unwrap().iter().collect();
        let expected: Vec<(u64, f32)> =
            steps.iter().zip(&values).filter_map(|(s, v)| Some((*s, (*v)? as f32))).collect();
        let got: Vec<(u64, f32)> = events["scalars"][tag]
            .as_array()
            .unwrap_or_else(|| panic!("no scalar {tag} in {:?}", events["scalars"]))
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap() as f32))
            .collect();
        assert_eq!(got, expected, "{tag} against trace column {column}");
    }
}

const TRACKED: &str = r#"
[run]
name = "tracked"
seed = 1
world_size = 2
timeout_s = 30

[load]
rows = 800
features = 6
classes = 3
validation_rows = 100

[wrap.model]
hidden = [16]

[train]
epochs = 3
batch_size = 16
clip_grad_norm = 5.0

[trace]
log_every_steps = 5
"#;

/// A run's event files, read by TensorBoard while it trains and after: the scalars of every trace
/// row equal the trace's, the training metrics every trace.log_every_steps steps, the resolved
/// configuration as text, the hparams with a successful end.
#[test]
fn tensorboard_reads_every_trace_value_during_and_after_the_run() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TRACKED);
    // Long enough to be read while it trains.
    let mut child = runner()
        .args(["run", "p.toml", "--out", "r", "--set", "train.epochs=40"])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let logdir = dir.path().join("r/tensorboard");
    let start = Instant::now();
    let mid_run = loop {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before its events could be read mid-run");
        assert!(start.elapsed() < Duration::from_secs(120), "no trace row in the events after 120 s");
        if logdir.is_dir() {
            let events = read_events(&logdir);
            if events["scalars"]["train/loss"].as_array().is_some_and(|a| !a.is_empty()) {
                break events;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(still_running, "the events were read only after the run had ended");
    assert!(mid_run["hparams"]["start"]["train.epochs"].as_f64() == Some(40.0), "{}", mid_run["hparams"]);

    let o = run(&["run", "p.toml", "--out", "done"], dir.path());
    assert_ok(&o);
    let run_dir = dir.path().join("done");
    let events = read_events(&run_dir.join("tensorboard"));
    assert_scalars_equal_trace(&events, &run_dir);
    // 800 rows over 2 ranks in batches of 16: 25 steps per epoch, 75 in all; step/... every 5.
    let logged: Vec<u64> =
        events["scalars"]["step/loss"].as_array().unwrap().iter().map(|p| p[0].as_u64().unwrap()).collect();
    assert_eq!(logged, (1..=15).map(|k| 5 * k).collect::<Vec<u64>>());
    assert_eq!(events["scalars"]["step/grad_norm"].as_array().unwrap().len(), 15);
    let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    assert!(events["text"].as_str().unwrap().contains(config.trim()), "{}", events["text"]);
    assert_eq!(events["hparams"]["start"]["train.clip_grad_norm"], json!(5.0));
    assert_eq!(events["hparams"]["start"]["run.world_size"], json!(2.0));
    assert_eq!(events["hparams"]["end"], json!(1), "STATUS_SUCCESS");

    let o = run(&["run", "p.toml", "--out", "off", "--set", "trace.tensorboard=false"], dir.path());
    assert_ok(&o);
    assert!(!dir.path().join("off/tensorboard").exists(), "trace.tensorboard = false writes no events");
}

/// In a step-based run a trace row (and so a TensorBoard point) comes every validate.every_steps.
#[test]
fn step_based_runs_write_a_point_per_validation_interval() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &TRACKED.replace("epochs = 3\n", ""));
    let o = run(
        &["run", "p.toml", "--out", "r", "--set", "train.steps=30", "--set", "validate.every_steps=10"],
        dir.path(),
    );
    assert_ok(&o);
    let events = read_events(&dir.path().join("r/tensorboard"));
    let steps: Vec<u64> =
        events["scalars"]["val/loss"].as_array().unwrap().iter().map(|p| p[0].as_u64().unwrap()).collect();
    assert_eq!(steps, [10, 20, 30]);
    assert_scalars_equal_trace(&events, &dir.path().join("r"));
}

/// A tracking server that cannot be reached is said once on the plan and at the end, and changes
/// nothing in the results: the same run id and the same trace values as a run without it.
#[test]
fn an_unreachable_mlflow_server_leaves_the_results_identical() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("track.mlflow=\"http://127.0.0.1:{port}\"");
    let plain = run(&["run", "p.toml", "--out", "plain"], dir.path());
    assert_ok(&plain);
    let tracked = run(&["run", "p.toml", "--out", "tracked", "--set", &url], dir.path());
    assert_ok(&tracked);
    let (out, _) = text(&tracked);
    assert_eq!(out.matches("cannot be reached").count(), 1, "{out}");
    assert!(out.contains(&format!("messages were not sent to http://127.0.0.1:{port}")), "{out}");
    let (a, b) = (trace(&dir.path().join("plain")), trace(&dir.path().join("tracked")));
    for column in ["run_id", "epoch", "step", "rank", "train_loss", "train_acc", "val_loss", "val_acc", "lr"] {
        assert!(a.column(column).unwrap().equals_missing(b.column(column).unwrap()), "{column} differs");
    }
    let model = |d: &str| std::fs::read(dir.path().join(d).join("model.safetensors")).unwrap();
    assert_eq!(model("plain"), model("tracked"));
}

#[test]
fn bad_tracking_values_are_refused_on_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    for (set, expected) in [
        (
            "track.mlflow=\"localhost:5000\"",
            "`track.mlflow` (--set track.mlflow=\"localhost:5000\"): \"localhost:5000\" is not an http:// URL",
        ),
        ("track.experiment=\" \"", "`track.experiment` (--set track.experiment=\" \"): is empty"),
        ("trace.tensorbord=true", "unknown key `trace.tensorbord`; did you mean `trace.tensorboard`?"),
    ] {
        let o = run(&["validate", "p.toml", "--set", set], dir.path());
        assert_eq!(o.status.code(), Some(2), "{set}");
        assert!(text(&o).1.contains(expected), "{set}: {}", text(&o).1);
    }
}
