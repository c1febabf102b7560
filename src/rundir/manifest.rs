//! `manifest.json`: what ran, where, with what, and how it ended. A manifest still `running`
//! whose directory lock is free was left by a launcher that died: [`Manifest::read`] reports it
//! as `crashed`.
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Running,
    Complete,
    Failed,
    Interrupted,
    /// Left `running` by a launcher that is gone (never written, only read).
    Crashed,
    /// Stopped by `run.preempt_signal` after writing a checkpoint at `preempted_at_step`; the
    /// same command line resumes it there.
    Preempted,
}

/// How a run's work is spread: its ranks, its strategy, and the ranks of each copy of the model
/// (a pipeline's stages; 1 for the other strategies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    pub world_size: usize,
    pub strategy: crate::config::schema::WrapStrategy,
    pub ranks_per_copy: usize,
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let strategy = format!("{:?}", self.strategy).to_lowercase();
        write!(f, "world size {}, {strategy}", self.world_size)?;
        if self.ranks_per_copy > 1 {
            write!(f, " of {} stages", self.ranks_per_copy)?;
        }
        Ok(())
    }
}

/// A resume that spread the run another way, from the checkpoint of `step` on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reshard {
    pub step: usize,
    pub from: Layout,
    pub to: Layout,
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
    /// Why a complete run stopped: its last epoch, or early stopping's reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// The optimizer step of the checkpoint a preempted run wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_at_step: Option<usize>,
    /// The CPU and the numerical settings (`MKL_CBWR`) the run computed under; older runs lack it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numerics: Option<crate::numerics::Numerics>,
    /// Each resume that changed the world size or the strategy, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reshards: Vec<Reshard>,
}

impl Manifest {
    /// A run starting now: `pipeline` is the pipeline file (its repository's commit is recorded).
    pub fn start(run_id: &str, name: &str, pipeline: &Path, world_size: usize, threads_per_rank: usize) -> Manifest {
        let dir = pipeline.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let git_commit = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["rev-parse", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
        Manifest {
            run_id: run_id.to_owned(),
            name: name.to_owned(),
            status: Status::Running,
            runner_version: env!("CARGO_PKG_VERSION").into(),
            git_commit,
            libtorch_version: env!("RUNNER_LIBTORCH_VERSION").into(),
            host: nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            world_size,
            threads_per_rank,
            pipeline: pipeline.display().to_string(),
            started_at: now(),
            ended_at: None,
            failure: None,
            stopped: None,
            preempted_at_step: None,
            numerics: Some(crate::numerics::current(threads_per_rank)),
            reshards: Vec::new(),
        }
    }

    pub fn end(&mut self, status: Status, failure: Option<String>) {
        self.status = status;
        self.failure = failure;
        self.ended_at = Some(now());
    }

    /// Records why a complete run stopped: early stopping's reason (its rank 0 wrote it into the
    /// run directory), or the end of its budget: `train.steps` where it sets one, else `epochs`.
    pub fn stopped(&mut self, run_dir: &Path, train: &crate::config::schema::Train) {
        self.stopped = Some(match std::fs::read_to_string(run_dir.join(super::STOPPED)) {
            Ok(why) => why,
            Err(_) => match train.steps {
                Some(steps) => format!("completed train.steps = {steps}"),
                None => format!("completed train.epochs = {}", train.epochs),
            },
        });
    }

    pub fn write(&self, run_dir: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_string_pretty(self)? + "\n";
        super::atomic_write(&run_dir.join(super::MANIFEST), json.as_bytes())
    }

    /// The manifest, with a `running` one whose launcher is gone (the lock is free) as `crashed`.
    pub fn read(run_dir: &Path) -> anyhow::Result<Manifest> {
        let path = run_dir.join(super::MANIFEST);
        let mut m =
            Self::read_raw(run_dir)?.with_context(|| format!("cannot read {}: no such file", path.display()))?;
        if m.status == Status::Running && super::lock::holder(run_dir).is_none() {
            m.status = Status::Crashed;
            m.failure.get_or_insert_with(|| "the launcher ended without recording how the run ended".into());
        }
        Ok(m)
    }

    /// The manifest as written; `None` when there is none.
    pub fn read_raw(run_dir: &Path) -> anyhow::Result<Option<Manifest>> {
        let path = run_dir.join(super::MANIFEST);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        serde_json::from_str(&text).map(Some).with_context(|| format!("{} is not a runner manifest", path.display()))
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}
