//! A node other than 0 of an elastic run: it joins each round node 0 opens (see the parent module).
use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use super::{join_key, refused_key, round_prefix, verdict_key, Nodes, Verdict, OPEN, RUN_DIR};
use crate::config::ConfigError;
use crate::dist::Store;
use crate::launch::restart::{child_args, launch_guarded};
use crate::launch::spawn::{self, Meeting};
use crate::plan::Plan;

/// A node other than 0 of an elastic run: joins each round node 0 opens and runs its ranks
/// there, until the run is over. Returns the exit code.
pub fn follow(plan: &Plan, me: usize, master: (&str, u16), nodes: Nodes, run_dir: &Path) -> anyhow::Result<u8> {
    let timeout = Duration::from_secs_f64(plan.config.run.timeout_s);
    let (addr, port) = master;
    let store = Store::connect(addr, port, timeout)
        .map_err(|e| crate::launch::rank::unreachable(e, "node 0's", addr, port, timeout))?;
    let per_node = plan.world_size() / nodes.max;
    let token = String::from_utf8_lossy(&store.get(RUN_DIR)?).into_owned();
    if crate::rundir::lock::token_of(run_dir).as_deref() != Some(token.as_str()) {
        return Err(ConfigError::new(format!(
            "node {me}: --out {} is not node 0's run directory: an elastic or restarted run over several nodes needs \
             one run directory on a file system every node shares (every rank reads the checkpoints); give every \
             node node 0's --out",
            run_dir.display()
        ))
        .into());
    }
    loop {
        let round: usize = String::from_utf8_lossy(&store.get(OPEN)?).parse().context("node 0's round")?;
        // Its configuration, which node 0 compares with its own before the round.
        store.set(&join_key(round, me), serde_json::to_string(&crate::launch::agree::flat_config(plan))?.as_bytes())?;
        crate::say_err!("node {me}: waiting for round {round} of the run");
        let verdict = match wait_verdict(&store, round)? {
            Ok(v) => v,
            Err(code) => return Ok(code),
        };
        let (members, text, file, resume) = match verdict {
            Verdict::Stop { why, complete } => {
                crate::say_err!("node {me}: {why}");
                return Ok(if complete { 0 } else { 1 });
            }
            Verdict::Refuse { why } => {
                store.add(&refused_key(round), 1)?;
                return Err(ConfigError::new(format!("node {me}: {why}")).into());
            }
            Verdict::Go { members, plan, file, resume } => (members, plan, file, resume),
        };
        let Some(index) = members.iter().position(|&n| n == me) else { continue };
        let (file, round_plan) = round_plan(plan, me, round, run_dir, &file, &text)?;
        let prefix = round_prefix(round);
        let scoped = store.prefixed(&prefix)?;
        let meeting = Meeting {
            store: &scoped,
            addr: addr.to_owned(),
            port,
            prefix: Some(prefix),
            first_rank: index * per_node,
            per_node,
            world: members.len() * per_node,
        };
        let args = child_args(&file, run_dir, resume);
        // Node 0 writes the shared run directory's files; this node only answers that it may.
        let mut nothing_to_write = || Ok(());
        let commit: Option<spawn::Commit> = resume.then_some(&mut nothing_to_write);
        let outcome = launch_guarded(|| spawn::start(&round_plan, &meeting, run_dir, &args, commit, &mut || {}))?;
        if let Some(sig) = outcome.interrupted {
            return Ok(128 + sig as u8);
        }
        match &outcome.failure {
            None if !outcome.preempted => return Ok(0),
            None => crate::say_err!("node {me}: every rank stopped at a checkpoint; joining the next round"),
            Some(f) => crate::say_err!("node {me}: {}; joining the next round", f.summary()),
        }
    }
}

/// Node 0's verdict on `round`, once it is published; `Err(exit code)` if this launcher is interrupted
/// while it waits.
fn wait_verdict(store: &Store, round: usize) -> anyhow::Result<Result<Verdict, u8>> {
    loop {
        if let Some(i) = crate::signals::interruption() {
            return Ok(Err(128 + i.signal as u8));
        }
        match store.contains(&verdict_key(round)) {
            Ok(true) => return Ok(Ok(serde_json::from_slice::<Verdict>(&store.get(&verdict_key(round))?)?)),
            Ok(false) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => anyhow::bail!("node 0, the rendezvous host, is gone ({e}): the run cannot go on without it"),
        }
    }
}

/// The plan node 0 wrote for `round`, read through this node's path to the shared run directory and
/// checked to be node 0's text and this node's configuration.
fn round_plan(
    plan: &Plan,
    me: usize,
    round: usize,
    run_dir: &Path,
    file: &Path,
    text: &str,
) -> anyhow::Result<(std::path::PathBuf, Plan)> {
    let file = run_dir.join(file.file_name().context("node 0's plan file")?);
    if std::fs::read_to_string(&file).ok().as_deref() != Some(text) {
        anyhow::bail!(
            "node {me}: {} does not hold the plan node 0 wrote for round {round}: the shared file system does not \
             show node 0's writes to this node",
            file.display()
        );
    }
    let round_plan: Plan = serde_json::from_str(text)?;
    if round_plan.run_id != plan.run_id {
        anyhow::bail!(
            "node {me} runs another configuration (run id {}) than node 0 (run id {}): start every node with the \
             same pipeline file and --set values",
            plan.run_id,
            round_plan.run_id
        );
    }
    Ok((file, round_plan))
}
