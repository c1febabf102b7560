//! MLflow: a tracking server started once for this test binary (`mlflow server` on a free
//! loopback port, sqlite backend and artifacts in a temporary directory, killed at the end)
//! receives the params, metrics and artifacts of a run and of a 2-point sweep; what it holds is
//! read back through its REST API and compared with the run directories.
use crate::common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use polars::prelude::*;
use serde_json::{json, Value};

/// The server and its process group, killed on drop (a failing assertion too).
struct Server {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

fn start_server() -> Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let mlflow = reference_python().with_file_name("mlflow");
    let db = format!("sqlite:///{}", dir.path().join("mlflow.db").display());
    let child = Command::new(mlflow)
        .args(["server", "--host", "127.0.0.1", "--port", &port.to_string(), "--workers", "1"])
        .args(["--backend-store-uri", &db])
        .arg("--artifacts-destination")
        .arg(dir.path().join("artifacts"))
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("mlflow server starts (scripts/setup.sh --tests installs it)");
    let server = Server { child, url: format!("http://127.0.0.1:{port}"), _dir: dir };
    let start = Instant::now();
    while ureq_get(&format!("{}/health", server.url)).is_none() {
        assert!(start.elapsed() < Duration::from_secs(180), "mlflow server did not answer within 180 s");
        std::thread::sleep(Duration::from_millis(500));
    }
    // The server's first API request sets up its store (seconds on a loaded machine): made here,
    // so that the plan's one short probe meets a server that is ready.
    api(&server, "POST", "mlflow/experiments/search", json!({ "max_results": 1 }));
    server
}

/// A GET over a plain TCP stream (HTTP/1.1, chunked bodies decoded); `None` unless 200 OK.
fn ureq_get(url: &str) -> Option<Vec<u8>> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map_or((rest, "/".to_owned()), |(h, p)| (h, format!("/{p}")));
    let mut s = std::net::TcpStream::connect(host).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    if !head.starts_with("HTTP/1.1 200") {
        return None;
    }
    let body = buf[head_end + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Some(dechunk(&body));
    }
    Some(body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else { return out };
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
}

/// The REST API, read with Python's standard library (a second, independent client).
fn api(server: &Server, method: &str, path: &str, body: Value) -> Value {
    let script = r#"
import json, sys, urllib.request
url, method, body = sys.argv[1], sys.argv[2], sys.argv[3]
req = urllib.request.Request(url, method=method, data=body.encode() if method == "POST" else None,
                             headers={"Content-Type": "application/json"})
print(urllib.request.urlopen(req).read().decode())
"#;
    let url = format!("{}/api/2.0/{path}", server.url);
    let o = Command::new(reference_python()).args(["-c", script, &url, method, &body.to_string()]).output().unwrap();
    assert!(o.status.success(), "{method} {path}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn history(server: &Server, run_id: &str, key: &str) -> Vec<(u64, f64)> {
    let v = api(server, "GET", &format!("mlflow/metrics/get-history?run_id={run_id}&metric_key={key}"), json!({}));
    let mut h: Vec<(u64, f64)> = v["metrics"]
        .as_array()
        .map(|m| m.iter().map(|m| (m["step"].as_u64().unwrap(), m["value"].as_f64().unwrap())).collect())
        .unwrap_or_default();
    h.sort_by_key(|(s, _)| *s);
    h
}

fn runs_of(server: &Server, experiment: &str) -> Vec<Value> {
    let e = api(server, "GET", &format!("mlflow/experiments/get-by-name?experiment_name={experiment}"), json!({}));
    let id = e["experiment"]["experiment_id"].as_str().unwrap().to_owned();
    let v = api(server, "POST", "mlflow/runs/search", json!({ "experiment_ids": [id] }));
    v["runs"].as_array().cloned().unwrap_or_default()
}

fn tag(run: &Value, key: &str) -> Option<String> {
    run["data"]["tags"].as_array()?.iter().find(|t| t["key"] == key).map(|t| t["value"].as_str().unwrap().to_owned())
}

fn param(run: &Value, key: &str) -> Option<String> {
    run["data"]["params"].as_array()?.iter().find(|t| t["key"] == key).map(|t| t["value"].as_str().unwrap().to_owned())
}

/// What the server holds of one run equals its run directory: the trace's rank-0 metrics at
/// their steps (exactly), the params, a finished status, and the artifacts byte for byte.
fn assert_run_received(server: &Server, run: &Value, run_dir: &Path) {
    let info = &run["info"];
    let id = info["run_id"].as_str().unwrap();
    assert_eq!(info["status"], "FINISHED", "{run}");
    let df = trace(run_dir);
    let df = df.filter(&df.column("rank").unwrap().u32().unwrap().equal(0)).unwrap();
    let steps: Vec<u64> = df.column("step").unwrap().u64().unwrap().into_no_null_iter().collect();
    for (key, column) in [("train/loss", "global_train_loss"), ("val/accuracy", "val_acc"), ("train/lr", "lr")] {
        let values: Vec<f64> = df.column(column).unwrap().f64().unwrap().into_no_null_iter().collect();
        let expected: Vec<(u64, f64)> = steps.iter().copied().zip(values).collect();
        assert_eq!(history(server, id, key), expected, "{key}");
    }
    assert!(!history(server, id, "step/loss").is_empty(), "step metrics");
    assert_eq!(param(run, "train.batch_size").as_deref(), Some("16"), "{run}");
    let uri = info["artifact_uri"].as_str().unwrap();
    let path = uri.trim_start_matches("mlflow-artifacts:").trim_start_matches('/');
    for file in ["config.toml", "trace.parquet", "model.safetensors", "plan.json"] {
        let got = ureq_get(&format!("{}/api/2.0/mlflow-artifacts/artifacts/{path}/{file}", server.url));
        assert_eq!(got, Some(std::fs::read(run_dir.join(file)).unwrap()), "artifact {file}");
    }
}

const PIPELINE: &str = r#"
[run]
name = "logged"
world_size = 2
timeout_s = 30

[load]
rows = 400
features = 5
classes = 3
validation_rows = 60

[wrap.model]
hidden = [8]

[train]
epochs = 2
batch_size = 16
"#;

#[test]
fn an_mlflow_server_receives_a_run_and_a_sweep() {
    let server = start_server();
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", PIPELINE);
    let url = format!("track.mlflow=\"{}\"", server.url);

    let o = run(&["validate", "p.toml", "--set", &url], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains(&format!("mlflow: {}, experiment \"logged\"", server.url)), "{}", text(&o).0);

    let o = run(&["run", "p.toml", "--out", "one", "--set", &url], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("in experiment \"logged\""), "{}", text(&o).0);
    let runs = runs_of(&server, "logged");
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0]["info"]["run_name"], "one");
    assert_run_received(&server, &runs[0], &dir.path().join("one"));

    write(
        dir.path(),
        "sweep.toml",
        &format!(
            "pipeline = \"p.toml\"\n[set]\n\"track.mlflow\" = \"{}\"\n\"track.experiment\" = \"seeds\"\n\
             [sweep]\n\"run.seed\" = [4, 5]\n",
            server.url
        ),
    );
    let o = run(&["sweep", "sweep.toml", "--out", "sw"], dir.path());
    assert_ok(&o);
    let runs = runs_of(&server, "seeds");
    assert_eq!(runs.len(), 2, "{runs:?}");
    let mut seeds: Vec<String> = runs.iter().map(|r| tag(r, "run.seed").expect("the axis tag")).collect();
    seeds.sort();
    assert_eq!(seeds, ["4", "5"]);
    for r in &runs {
        let point = r["info"]["run_name"].as_str().unwrap().to_owned();
        assert_eq!(param(r, "run.seed"), tag(r, "run.seed"));
        assert_run_received(&server, r, &dir.path().join("sw").join(point));
    }
}
