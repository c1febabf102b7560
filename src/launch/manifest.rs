//! `manifest.json`: what ran, where, with what, and how it ended.
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::plan::Plan;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Running,
    Complete,
    Failed,
    Interrupted,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub run_id: String,
    pub name: String,
    pub status: Status,
    pub runner_version: String,
    /// The commit of the repository holding the pipeline file, if it is in one.
    pub git_commit: Option<String>,
    pub libtorch_version: String,
    pub host: String,
    pub cores: usize,
    pub world_size: usize,
    pub threads_per_rank: usize,
    pub pipeline: String,
    pub started_at: String,
    pub ended_at: Option<String>,
    /// Why the run failed, when it did.
    pub failure: Option<String>,
}

impl Manifest {
    pub fn start(plan: &Plan) -> Manifest {
        let dir = plan.pipeline_file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let git_commit = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["rev-parse", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
        Manifest {
            run_id: plan.run_id.clone(),
            name: plan.config.run.name.clone(),
            status: Status::Running,
            runner_version: env!("CARGO_PKG_VERSION").into(),
            git_commit,
            libtorch_version: env!("RUNNER_LIBTORCH_VERSION").into(),
            host: nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            world_size: plan.world_size(),
            threads_per_rank: plan.threads_per_rank,
            pipeline: plan.pipeline_file.display().to_string(),
            started_at: now(),
            ended_at: None,
            failure: None,
        }
    }

    pub fn end(&mut self, status: Status, failure: Option<String>) {
        self.status = status;
        self.failure = failure;
        self.ended_at = Some(now());
    }

    pub fn write(&self, run_dir: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_string_pretty(self)? + "\n";
        crate::trace::atomic_write(&run_dir.join("manifest.json"), json.as_bytes())
    }

    pub fn read(run_dir: &Path) -> anyhow::Result<Manifest> {
        use anyhow::Context;
        let path = run_dir.join("manifest.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not a runner manifest", path.display()))
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}
