//! MLflow tracking through its REST API (`/api/2.0/mlflow/...`): a run in an experiment (created
//! if missing), its params and tags, metrics with their step, and at the end the run directory's
//! small files as artifacts through the server's artifact proxy (`mlflow-artifacts`, on by
//! default in `mlflow server`). Rank 0 hands everything to a background thread through a bounded
//! queue and never waits on the network: a full queue drops (and counts) a message, a server that
//! stops answering is given up at the first failure, and what was not sent is said at the end.
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Messages waiting for the thread at most; more are dropped (and counted), never waited for.
const QUEUE: usize = 1024;
/// How long the end of a run waits for the thread to send what is queued and the artifacts.
const FINISH_WAIT: Duration = Duration::from_secs(120);

/// What a run sends: where, under which names, with which params and tags.
#[derive(Debug, Clone)]
pub struct Target {
    pub url: String,
    pub experiment: String,
    pub run_name: String,
    pub params: Vec<(String, String)>,
    pub tags: Vec<(String, String)>,
}

enum Message {
    Metrics { step: u64, values: Vec<(String, f64)> },
    Artifact(PathBuf),
    End { succeeded: bool },
}

/// Rank 0's handle on the sending thread.
pub struct Mlflow {
    tx: SyncSender<Message>,
    report: Receiver<String>,
    url: String,
    dropped: usize,
    /// Whether the server has answered any request yet.
    answered: Arc<AtomicBool>,
    started: Instant,
}

/// How long the end of a run waits for a server that has not answered once since the run began:
/// the plan's probe found it unreachable or silent, and the run gives it no longer than the probe.
const FIRST_ANSWER_WAIT: Duration = Duration::from_secs(5);

impl Mlflow {
    pub fn start(target: Target) -> Mlflow {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let (report_tx, report) = mpsc::channel();
        let url = target.url.clone();
        let answered = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&answered);
        std::thread::spawn(move || {
            let _ = report_tx.send(serve(&target, rx, flag));
        });
        Mlflow { tx, report, url, dropped: 0, answered, started: Instant::now() }
    }

    fn send(&mut self, m: Message) {
        match self.tx.try_send(m) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => self.dropped += 1,
        }
    }

    /// Metrics at an optimizer step (non-finite values are left out: JSON has no NaN).
    pub fn metrics(&mut self, step: u64, values: &[(String, f64)]) {
        let values: Vec<(String, f64)> = values.iter().filter(|(_, v)| v.is_finite()).cloned().collect();
        if !values.is_empty() {
            self.send(Message::Metrics { step, values });
        }
    }

    /// Sends `artifacts` (files that exist), ends the MLflow run, and waits for the thread: one
    /// line saying what was sent and what was not.
    pub fn finish(mut self, artifacts: Vec<PathBuf>, succeeded: bool) -> String {
        for a in artifacts.into_iter().filter(|a| a.is_file()) {
            self.send(Message::Artifact(a));
        }
        self.send(Message::End { succeeded });
        drop(self.tx);
        let dropped = match self.dropped {
            0 => String::new(),
            n => format!("; {n} messages dropped because the queue was full"),
        };
        // A server that never answered gets no more time than the plan's probe gave it.
        let wait = match self.answered.load(Ordering::SeqCst) {
            true => FINISH_WAIT,
            false => FIRST_ANSWER_WAIT.saturating_sub(self.started.elapsed()),
        };
        match self.report.recv_timeout(wait) {
            Ok(line) => format!("{line}{dropped}"),
            Err(_) if !self.answered.load(Ordering::SeqCst) => format!(
                "mlflow: {} never answered (given {} s from the run's start); nothing was sent{dropped}",
                self.url,
                FIRST_ANSWER_WAIT.as_secs()
            ),
            Err(_) => format!(
                "mlflow: {} still had not taken what was queued after {} s; the rest was not sent{dropped}",
                self.url,
                FINISH_WAIT.as_secs()
            ),
        }
    }
}

/// The sending thread: creates the run, then sends each message in order until the queue closes.
fn serve(t: &Target, rx: Receiver<Message>, answered: Arc<AtomicBool>) -> String {
    // In the background: a slow server delays nothing but the end's wait.
    let api = Api { answered, ..Api::new(&t.url, Duration::from_secs(30)) };
    let run = api.start_run(t);
    let (mut sent, mut unsent, mut artifacts) = (0usize, 0usize, 0usize);
    let mut failure = None;
    let run = match run {
        Ok(run) => Some(run),
        Err(e) => {
            failure = Some(e);
            None
        }
    };
    for m in rx {
        let Some(run) = run.as_ref().filter(|_| failure.is_none()) else {
            unsent += 1;
            continue;
        };
        let is_artifact = matches!(m, Message::Artifact(_));
        match api.send(run, m) {
            Ok(()) => {
                sent += 1;
                artifacts += is_artifact as usize;
            }
            Err(e) => {
                failure = Some(e);
                unsent += 1;
            }
        }
    }
    match (failure, run) {
        (None, Some(run)) => format!(
            "mlflow: run {} in experiment \"{}\" at {}: {sent} requests sent ({artifacts} artifacts)",
            run.id, t.experiment, t.url
        ),
        (Some(why), _) => format!("mlflow: {unsent} of {} messages were not sent to {} ({why})", sent + unsent, t.url),
        (None, None) => unreachable!("no run without a failure"),
    }
}

/// An MLflow run this process created.
struct Run {
    id: String,
    /// Where the artifact proxy keeps the run's files (`<experiment>/<run>/artifacts`), when the
    /// server proxies artifacts.
    artifact_path: Option<String>,
    artifact_uri: String,
}

/// The REST API of one server.
pub struct Api {
    agent: ureq::Agent,
    base: String,
    /// The `Authorization` header MLflow's own variables give: MLFLOW_TRACKING_TOKEN (a bearer
    /// token), or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (basic).
    auth: Option<String>,
    /// Set once the server answers a request (with any status).
    answered: Arc<AtomicBool>,
}

/// The `Authorization` header from MLflow's variables, as its client reads them.
fn auth_header() -> Option<String> {
    use base64::Engine;
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let Some(token) = var("MLFLOW_TRACKING_TOKEN") {
        return Some(format!("Bearer {token}"));
    }
    let user = var("MLFLOW_TRACKING_USERNAME")?;
    let password = var("MLFLOW_TRACKING_PASSWORD").unwrap_or_default();
    Some(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))))
}

impl Api {
    pub fn new(url: &str, timeout: Duration) -> Api {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .timeout_connect(Some(timeout.min(Duration::from_secs(3))))
            .http_status_as_error(false)
            .build()
            .into();
        Api { agent, base: url.trim_end_matches('/').to_owned(), auth: auth_header(), answered: Default::default() }
    }

    fn answer(&self, r: Result<ureq::http::Response<ureq::Body>, ureq::Error>, what: &str) -> Result<Value, String> {
        let mut r = r.map_err(|e| format!("{what}: {e}"))?;
        self.answered.store(true, Ordering::SeqCst);
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().map_err(|e| format!("{what}: {e}"))?;
        if !(200..300).contains(&status) {
            return Err(format!("{what}: HTTP {status}: {}", text.chars().take(300).collect::<String>()));
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// A request to `url`, with the credentials when there are any.
    fn request<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.auth {
            Some(auth) => req.header("Authorization", auth),
            None => req,
        }
    }

    pub fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, String> {
        let mut req = self.request(self.agent.get(format!("{}/api/2.0/{path}", self.base)));
        for (k, v) in query {
            req = req.query(*k, *v);
        }
        self.answer(req.call(), path)
    }

    pub fn post(&self, path: &str, body: Value) -> Result<Value, String> {
        let r = self
            .request(self.agent.post(format!("{}/api/2.0/{path}", self.base)))
            .header("Content-Type", "application/json")
            .send(body.to_string());
        self.answer(r, path)
    }

    /// The experiment's id, if it exists.
    pub fn experiment_id(&self, name: &str) -> Result<Option<String>, String> {
        let r = self.request(self.agent.get(format!("{}/api/2.0/mlflow/experiments/get-by-name", self.base)));
        let mut r = r.query("experiment_name", name).call().map_err(|e| e.to_string())?;
        self.answered.store(true, Ordering::SeqCst);
        let text = r.body_mut().read_to_string().map_err(|e| e.to_string())?;
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        match r.status().as_u16() {
            200 => Ok(v["experiment"]["experiment_id"].as_str().map(str::to_owned)),
            404 if v["error_code"] == "RESOURCE_DOES_NOT_EXIST" => Ok(None),
            s => Err(format!("experiments/get-by-name: HTTP {s}: {}", text.chars().take(300).collect::<String>())),
        }
    }

    fn start_run(&self, t: &Target) -> Result<Run, String> {
        let experiment = match self.experiment_id(&t.experiment)? {
            Some(id) => id,
            None => match self.post("mlflow/experiments/create", json!({ "name": t.experiment })) {
                Ok(v) => v["experiment_id"].as_str().unwrap_or_default().to_owned(),
                // Another point of a sweep may have created it meanwhile.
                Err(e) => self.experiment_id(&t.experiment)?.ok_or(e)?,
            },
        };
        let tags: Vec<Value> = t.tags.iter().map(|(k, v)| json!({ "key": k, "value": v })).collect();
        let v = self.post(
            "mlflow/runs/create",
            json!({ "experiment_id": experiment, "run_name": t.run_name, "start_time": millis(), "tags": tags }),
        )?;
        let info = &v["run"]["info"];
        let id = info["run_id"].as_str().ok_or("runs/create: no run_id in the answer")?.to_owned();
        let artifact_uri = info["artifact_uri"].as_str().unwrap_or_default().to_owned();
        let run = Run { id, artifact_path: proxied_path(&artifact_uri), artifact_uri };
        // log-batch takes at most 100 params per request.
        for chunk in t.params.chunks(100) {
            let params: Vec<Value> = chunk.iter().map(|(k, v)| json!({ "key": k, "value": v })).collect();
            self.post("mlflow/runs/log-batch", json!({ "run_id": run.id, "params": params }))?;
        }
        Ok(run)
    }

    fn send(&self, run: &Run, m: Message) -> Result<(), String> {
        match m {
            Message::Metrics { step, values } => {
                let at = millis();
                let metrics: Vec<Value> = values
                    .iter()
                    .map(|(k, v)| json!({ "key": k, "value": v, "timestamp": at, "step": step }))
                    .collect();
                self.post("mlflow/runs/log-batch", json!({ "run_id": run.id, "metrics": metrics })).map(|_| ())
            }
            Message::Artifact(path) => {
                let Some(dir) = &run.artifact_path else {
                    return Err(format!(
                        "the server keeps artifacts at {}, which it does not serve; start it with --serve-artifacts",
                        run.artifact_uri
                    ));
                };
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                let url = format!("{}/api/2.0/mlflow-artifacts/artifacts/{dir}/{name}", self.base);
                let r = self
                    .request(self.agent.put(url))
                    .header("Content-Type", "application/octet-stream")
                    .send(&bytes[..]);
                self.answer(r, &format!("artifact {name}")).map(|_| ())
            }
            Message::End { succeeded } => {
                let status = if succeeded { "FINISHED" } else { "FAILED" };
                self.post("mlflow/runs/update", json!({ "run_id": run.id, "status": status, "end_time": millis() }))
                    .map(|_| ())
            }
        }
    }
}

/// `mlflow-artifacts:/1/abc/artifacts` (or `mlflow-artifacts://host:port/1/abc/artifacts`) →
/// `1/abc/artifacts`; `None` for a store the server does not proxy.
fn proxied_path(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("mlflow-artifacts:")?;
    let path = match rest.strip_prefix("//") {
        Some(authority_and_path) => authority_and_path.split_once('/').map_or("", |(_, p)| p),
        None => rest,
    };
    Some(path.trim_matches('/').to_owned())
}

fn millis() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Refuses what cannot be an MLflow server's address: another scheme than http://, no host, a
/// port beyond 65535, spaces, and credentials, which would be written with the URL into
/// config.toml, plan.json and the TensorBoard events (MLflow's own variables carry them).
pub fn check_url(url: &str) -> Result<(), String> {
    let example = "e.g. \"http://127.0.0.1:5000\"";
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!("\"{url}\" is not an http:// URL of an MLflow server ({example}; https is not supported)"));
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(format!(
            "\"{}\" holds credentials, which would be written into config.toml, plan.json and the TensorBoard \
             events: give the URL without them, and the credentials in MLFLOW_TRACKING_USERNAME and \
             MLFLOW_TRACKING_PASSWORD (or a token in MLFLOW_TRACKING_TOKEN)",
            crate::config::resolve::redact_credentials(url)
        ));
    }
    let uri: Option<ureq::http::Uri> = (!authority.is_empty())
        .then(|| url.parse())
        .transpose()
        .map_err(|e: ureq::http::uri::InvalidUri| format!("\"{url}\" is not a URL ({e}); {example}"))?;
    if uri.as_ref().and_then(|u| u.host()).is_none_or(str::is_empty) {
        return Err(format!("\"{url}\" names no host; {example}"));
    }
    // The port as written (the parsed URI drops one that does not fit 16 bits).
    if let Some((_, port)) = authority.rsplit_once(':').filter(|_| !authority.ends_with(']')) {
        if !port.parse::<u16>().is_ok_and(|p| p > 0) {
            return Err(format!("\"{url}\": port {port} is not between 1 and 65535"));
        }
    }
    Ok(())
}

/// One line for the plan: whether the server answers, checked once with a short timeout.
pub fn probe(url: &str, experiment: &str) -> String {
    let api = Api::new(url, Duration::from_secs(5));
    match api.experiment_id(experiment) {
        Ok(Some(id)) => format!("mlflow: {url}, experiment \"{experiment}\" (id {id})"),
        Ok(None) => format!("mlflow: {url}, experiment \"{experiment}\" (created by the run)"),
        Err(e) => format!(
            "mlflow: {url} cannot be reached ({e}): the run trains and writes its results all the same, and says \
             at the end what was not sent"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxied_artifact_paths() {
        assert_eq!(proxied_path("mlflow-artifacts:/1/ab/artifacts").as_deref(), Some("1/ab/artifacts"));
        assert_eq!(proxied_path("mlflow-artifacts://h:5000/1/ab/artifacts").as_deref(), Some("1/ab/artifacts"));
        assert_eq!(proxied_path("file:///tmp/mlruns/1/ab/artifacts"), None);
    }

    #[test]
    fn urls_that_cannot_reach_a_server_or_hold_credentials_are_refused() {
        assert!(check_url("http://127.0.0.1:5000").is_ok());
        assert!(check_url("http://mlflow.example/prefix").is_ok());
        for (url, says) in [
            ("https://h:5000", "is not an http:// URL"),
            ("http://h:99999", "port 99999 is not between 1 and 65535"),
            ("http://h st:5000", "is not a URL"),
            ("http://", "names no host"),
            ("http://me:secret@h:5000", "\"http://me:***@h:5000\" holds credentials"),
        ] {
            let e = check_url(url).unwrap_err();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("secret"), "{e}");
        }
    }
}
