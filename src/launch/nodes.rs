//! Whose run directory it is, over the nodes of a fixed-size multi-node run (`--nnodes N`).
//! Node 0 owns the run directory: its launcher takes `.runner.lock`, writes plan.json, the
//! configuration and the manifest, removes what cut-short writes left, and records how the run
//! ended; its rank 0 writes the trace, the model and each checkpoint's index. The nodes meet
//! before any of them takes a directory: node 0 takes its own and says through the store how it
//! went (refused: why; taken: the lock's token, the file its ranks run the plan from, whether the
//! run resumes). Another node's `--out` is node 0's directory when its lock holds that token (one
//! folder on a file system every node shares, under any path): that node takes no lock, writes
//! and removes nothing at the directory's top level, and its ranks write only their own files
//! (their `.rank-N.position`, their `rank-N.safetensors` of each checkpoint). Any other `--out`
//! is the node's own (a local disk), which it takes as a single node would, with the same checks:
//! one that holds another run refuses the run on every node ([`super::agree::refuse`]).
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::restart::{child_args, launch_guarded};
use super::spawn::{self, Met, Topology};
use crate::config::ConfigError;
use crate::plan::Plan;

/// Node 0's word on the run directory.
const OWNER: &str = "runner/run-dir/owner";
/// How many other nodes read node 0's refusal (its store stays until they all did).
const OWNER_READ: &str = "runner/run-dir/owner-read";

/// What node 0 says once it took its run directory, or could not.
#[derive(Debug, Serialize, Deserialize)]
enum Owner {
    Took(Taken),
    Refused { why: String },
}

/// Node 0's run directory, as another node recognizes and uses it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Taken {
    /// The token of node 0's hold of `.runner.lock` ([`crate::rundir::lock`]).
    token: String,
    /// The name, in the run directory, of the file node 0's ranks run the plan from.
    plan_file: String,
    /// Whether the ranks resume from the newest checkpoint.
    resume: bool,
}

/// Which directory this node's ranks run in.
pub enum Role {
    /// Node 0's (the same folder): node 0 owns it.
    Shared(Taken),
    /// One of this node's own.
    Own,
}

/// Node 0: says that it took the run directory (its lock's `token`; its ranks run the plan from
/// `plan_file`, resuming when `resume`).
pub fn took(met: &Met, token: &str, plan_file: &Path, resume: bool) -> anyhow::Result<()> {
    let plan_file = plan_file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let said = Owner::Took(Taken { token: token.to_owned(), plan_file, resume });
    Ok(met.store.set(OWNER, serde_json::to_string(&said)?.as_bytes())?)
}

/// Node 0: says why it could not take the run directory, and waits (at most `run.timeout_s`) for
/// the other nodes to read it before its store ends with it.
pub fn refused(met: &Met, why: &str, nnodes: usize) {
    let said = Owner::Refused { why: why.to_owned() };
    let Ok(json) = serde_json::to_string(&said) else { return };
    if met.store.set(OWNER, json.as_bytes()).is_err() {
        return;
    }
    let deadline = Instant::now() + met.store.timeout();
    while met.store.add(OWNER_READ, 0).is_ok_and(|n| n < nnodes as i64 - 1) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Another node: waits for node 0's word; whether `run_dir` is node 0's directory. Node 0's
/// refusal is this node's, naming node 0.
pub fn role(met: &Met, run_dir: &Path, me: usize) -> anyhow::Result<Role> {
    let bytes = met.store.get(OWNER).map_err(|e| {
        let timeout = met.store.timeout().as_secs_f64();
        match crate::signals::interruption() {
            Some(_) => anyhow::Error::from(e),
            None => anyhow::anyhow!(
                "node {me}: node 0 did not say within run.timeout_s ({timeout} s) whether it took its run directory; \
                 see node 0's output"
            ),
        }
    })?;
    match serde_json::from_slice(&bytes)? {
        Owner::Refused { why } => {
            let _ = met.store.add(OWNER_READ, 1);
            Err(ConfigError::new(format!("node {me}: node 0 refused to start the run: {why}")).into())
        }
        Owner::Took(taken) if crate::rundir::lock::token_of(run_dir).as_deref() == Some(taken.token.as_str()) => {
            Ok(Role::Shared(taken))
        }
        Owner::Took(_) => Ok(Role::Own),
    }
}

/// Another node whose `--out` is a directory of its own: refused, saying why, where the run writes
/// checkpoints. Rank 0 writes each checkpoint's index beside the pieces every rank writes, and
/// every rank reads them to resume: checkpoints need the one directory every node shares.
pub fn own_run_dir(plan: &Plan, run_dir: &Path) -> anyhow::Result<()> {
    let c = &plan.config.checkpoint;
    let setting = match (c.every, c.every_steps) {
        (_, Some(n)) => format!("checkpoint.every_steps = {n}"),
        (0, None) => return Ok(()),
        (n, None) => format!("checkpoint.every = {n}"),
    };
    Err(ConfigError::new(format!(
        "--out {} is not node 0's run directory, and the run writes checkpoints ({setting}): every rank \
         writes its pieces of a checkpoint into the directory where rank 0 writes its index, and reads them to \
         resume; give every node node 0's --out on a file system they all share, or run without checkpoints",
        run_dir.display()
    ))
    .into())
}

/// Another node whose `--out` is node 0's directory: runs its ranks there on node 0's plan file,
/// writing nothing of the directory's own (node 0 records the run). Returns the exit code.
pub fn follow(plan: &Plan, topology: &Topology, met: Met, run_dir: &Path, taken: &Taken) -> anyhow::Result<u8> {
    let me = topology.node_rank;
    let file: PathBuf = run_dir.join(&taken.plan_file);
    let args = child_args(&file, run_dir, taken.resume);
    // Node 0 writes a resumed run's files; this node only answers that it may.
    let mut nothing_to_write = || Ok(());
    let commit: Option<spawn::Commit> = taken.resume.then_some(&mut nothing_to_write);
    let outcome = launch_guarded(|| spawn::launch(plan, topology, run_dir, &args, commit, Some(met)))?;
    if let Some(sig) = outcome.interrupted {
        crate::say_err!("\nnode {me}: interrupted by {}; node 0 records how the run ended", crate::signals::name(sig));
        return Ok(128 + sig as u8);
    }
    if outcome.preempted {
        crate::say_err!("node {me}: preempted; node 0 says how the run goes on");
        return Ok(128 + plan.config.run.preempt_signal.number() as u8);
    }
    if let Some(f) = &outcome.failure {
        crate::say_err!("\nerror: the run failed: {}", f.summary());
        if !f.stderr_tail.is_empty() {
            crate::say_err!("  last lines rank {} wrote to stderr:", f.rank);
            for line in &f.stderr_tail {
                crate::say_err!("    {line}");
            }
        }
        crate::say_err!("  node 0 records the failure in {}", run_dir.display());
        return Ok(1);
    }
    crate::say!("  run directory: {} (node 0's: it records the run)", run_dir.display());
    Ok(0)
}
