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

/// How a run's work is spread: its ranks, its strategy, the ranks of each copy of the model (a
/// pipeline's stages × the tensor ranks; 1 for the other strategies without tensor parallelism)
/// and the tensor ranks each layer is split across (`wrap.mesh.tensor`; 1, and left out of the
/// file, without tensor parallelism, as runs before it wrote).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    pub world_size: usize,
    pub strategy: crate::config::schema::WrapStrategy,
    pub ranks_per_copy: usize,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub tensor: usize,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let strategy = format!("{:?}", self.strategy).to_lowercase();
        write!(f, "world size {}, {strategy}", self.world_size)?;
        let stages = self.ranks_per_copy / self.tensor.max(1);
        if stages > 1 {
            write!(f, " of {stages} stages")?;
        }
        if self.tensor > 1 {
            write!(f, " × tensor {}", self.tensor)?;
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

/// A rank that failed, as the launcher saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// The rank that failed first, where its launcher saw it (torchrun and srun restart the
    /// ranks themselves: there the failure is rank 0's account of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// The host it ran on (with its node index in a multi-node run).
    pub node: String,
    /// How it ended and the error it gave: "was killed by SIGKILL", "exited with code 1: the
    /// training loss became NaN ...".
    pub cause: String,
    /// Where it was: "train, epoch 1, step 7", "checkpoint, epoch 2", "load".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<String>,
    /// Optimizer steps the run had done when it failed.
    pub step: usize,
    pub at: String,
    /// Seconds from the failure until every rank had stopped (for a stalled rank, from its last
    /// progress), where the launcher that saw it is the runner's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detect_s: Option<f64>,
}

impl FailureRecord {
    /// Whether `other` is the same failure again: the same kind of cause ([`kind_of`]) at the
    /// same step and place, whichever rank met it first (a NaN that every rank meets names the
    /// one that said so) and whichever process wrote the file it failed on.
    pub fn repeats(&self, other: &FailureRecord) -> bool {
        kind_of(&self.cause) == kind_of(&other.cause) && self.step == other.step && self.position == other.position
    }

    /// "rank 1 was killed by SIGKILL during train, epoch 1, step 7 (after step 30)".
    pub fn summary(&self) -> String {
        let at = self.position.as_ref().map(|p| format!(" during {p}")).unwrap_or_default();
        let who = self.rank.map(|r| format!("rank {r} ")).unwrap_or_default();
        format!("{who}{}{at} (after step {})", self.cause, self.step)
    }
}

/// A restart of every rank after a failure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestartRecord {
    pub at: String,
    /// What restarted the ranks: "runner" (`run.max_restarts`), "torchrun" (its
    /// `--max-restarts`), "slurm" (the job requeued itself).
    pub by: String,
    /// The step of the checkpoint it resumed from; 0: the run started over.
    pub from_step: usize,
    pub world_size: usize,
    /// Optimizer steps the failed attempt had done past that checkpoint: computed twice.
    pub recomputed_steps: usize,
    /// Seconds from every rank stopped until the restarted ranks trained again (absent while the
    /// restart is under way, or where they never got that far).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_s: Option<f64>,
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
    /// Every rank failure, oldest first (older runners' manifests have none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<FailureRecord>,
    /// Every automatic restart, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restarts: Vec<RestartRecord>,
    /// What failures cost in wall time, once the run ended after one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput: Option<super::goodput::Goodput>,
    /// Each rank's host, by rank, where the ranks are not all `host`'s: recorded by rank 0 under
    /// torchrun or srun.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
}

/// This machine's host name, as the manifest records it.
pub fn hostname() -> String {
    nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default()
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
            host: hostname(),
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
            failures: Vec::new(),
            restarts: Vec::new(),
            goodput: None,
            hosts: Vec::new(),
        }
    }

    /// Takes over the start time, failures and restarts of the run's earlier manifest: a run
    /// that its launcher continues by itself (after a failure, or a preemption) is the same run,
    /// and what its failures cost counts against its whole wall time. (A run resumed by hand with
    /// `--resume` starts a manifest of its own.)
    pub fn carry_history(&mut self, earlier: &Manifest) {
        self.started_at = earlier.started_at.clone();
        self.failures = earlier.failures.clone();
        self.restarts = earlier.restarts.clone();
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

    /// Once the run has ended: what its failures cost ([`super::goodput`]), with the mean step
    /// time from its trace.
    pub fn account(&mut self, run_dir: &Path) {
        let ended = self.ended_at.clone().unwrap_or_else(now);
        self.goodput = super::goodput::Goodput::of(self, &ended, super::goodput::step_seconds(run_dir));
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

/// `text` with every "rank N" as "rank _".
/// The kind of a failure's `cause`: its text with every number that names one instance of it
/// masked (a rank, a process id in a temporary file's name, a port, a size), keeping those that
/// name the kind itself (an exit code, an OS error number). Two attempts that fail alike differ
/// in such numbers ("rank 1" or "rank 3" saying so, `.model.safetensors.tmp-<pid>`).
fn kind_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(|c: char| c.is_ascii_digit()) {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let names_the_kind = out.ends_with("code ") || out.ends_with("os error ");
        out.push_str(if names_the_kind { &rest[..digits] } else { "_" });
        rest = &rest[digits..];
    }
    out + rest
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_repeats_with_the_same_cause_step_and_place_whichever_rank_says_so() {
        let failure = |rank: usize, cause: &str, step: usize| FailureRecord {
            rank: Some(rank),
            node: "h".into(),
            cause: cause.into(),
            position: Some("train, epoch 1, step 2".into()),
            step,
            at: String::new(),
            detect_s: None,
        };
        let nan = |r: usize| format!("exited with code 1: the training loss became NaN on rank {r} in epoch 1");
        assert!(failure(0, &nan(0), 2).repeats(&failure(1, &nan(1), 2)));
        assert!(!failure(0, &nan(0), 2).repeats(&failure(0, &nan(0), 3)));
        assert!(!failure(0, "was killed by SIGKILL", 2).repeats(&failure(0, &nan(0), 2)));
        assert_eq!(kind_of("rank 12 lost rank 3; ranks 4"), "rank _ lost rank _; ranks _");
    }

    #[test]
    fn a_failure_repeats_whatever_process_ids_its_message_carries_but_not_another_exit_or_os_error() {
        let failure = |cause: &str| FailureRecord {
            rank: Some(0),
            node: "h".into(),
            cause: cause.into(),
            position: Some("write model, epoch 4".into()),
            step: 8,
            at: String::new(),
            detect_s: None,
        };
        let full = |pid: u32, errno: u32| {
            format!(
                "exited with code 1: cannot write /r/.model.safetensors.tmp-{pid}: No space left (os error {errno})"
            )
        };
        assert!(failure(&full(4121, 28)).repeats(&failure(&full(4377, 28))));
        assert!(!failure(&full(4121, 28)).repeats(&failure(&full(4121, 5))));
        let code = |c: u32| format!("exited with code {c}: store at 127.0.0.1:{} closed", 40000 + c);
        assert!(failure(&code(1)).repeats(&failure(&code(1).replace("40001", "51234"))));
        assert!(!failure(&code(1)).repeats(&failure(&code(2))));
    }

    #[test]
    fn an_older_manifest_without_failures_reads_as_before() {
        let old = r#"{"run_id": "a", "name": "n", "status": "complete", "runner_version": "0.1.0",
            "git_commit": null, "libtorch_version": "2.13.0", "host": "h", "cores": 2, "world_size": 2,
            "threads_per_rank": 1, "pipeline": "p.toml", "started_at": "t", "ended_at": "u", "failure": null}"#;
        let m: Manifest = serde_json::from_str(old).unwrap();
        assert!(m.failures.is_empty() && m.restarts.is_empty() && m.goodput.is_none());
        // And a manifest without failures writes none of the new fields.
        let text = serde_json::to_string(&m).unwrap();
        assert!(!text.contains("failures") && !text.contains("restarts") && !text.contains("goodput"), "{text}");
    }
}
