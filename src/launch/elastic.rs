//! Elastic world size: `--nnodes MIN:MAX` (torchrun's syntax), and restarts over several nodes.
//! Node 0 hosts the rendezvous: its store lives as long as its launcher, so node 0 must survive,
//! as the host of torchrun's c10d rendezvous must. The job runs in rounds. For each round the
//! nodes that are up join; node 0 closes the round with every node that joined (MAX at once, or
//! at least MIN once the wait is over: `run.timeout_s` for the first round, then
//! `run.rejoin_timeout_s`), and the round's world size is their ranks. At another world size
//! than the last round's, the run goes on from the newest checkpoint with the same global batch
//! (gradient accumulation, or else the batch per rank, makes up the difference), or stops with
//! the reason. A lost node ends the round (its peers' collectives fail), and the next round goes
//! on without it. A node that comes back, or a new one, waits for the round in progress to reach
//! its next checkpoint, where every rank stops after writing it; the next round takes it in.
//!
//! Each round's keys go under a prefix of their own in the store (the ranks get it in
//! [`STORE_PREFIX`](super::env::STORE_PREFIX)). The run directory must be one every node sees:
//! every rank reads the checkpoints. Node 0 owns it (the lock, the manifest, plan.json); the
//! other nodes read the round's plan there and run their ranks. Node 0 says its lock's token
//! through the store: a node whose `--out` is another folder (its lock without that token) is
//! refused before it joins a round.
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::restart::{child_args, launch_guarded, pending_plan, Attempt};
use super::spawn::{self, Meeting, Outcome};
use crate::config::ConfigError;
use crate::dist::Store;
use crate::plan::Plan;
use crate::rundir::{self, manifest::Manifest};

/// How many nodes a run takes: `--nnodes N` or `--nnodes MIN:MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nodes {
    pub min: usize,
    pub max: usize,
}

impl std::str::FromStr for Nodes {
    type Err = String;

    fn from_str(s: &str) -> Result<Nodes, String> {
        let count = |v: &str| v.trim().parse::<usize>().map_err(|_| format!("{v:?} is not a number of nodes"));
        let (min, max) = match s.split_once(':') {
            Some((min, max)) => (count(min)?, count(max)?),
            None => (count(s)?, count(s)?),
        };
        if min == 0 || min > max {
            return Err(format!("{s:?}: MIN:MAX needs 1 <= MIN <= MAX"));
        }
        Ok(Nodes { min, max })
    }
}

/// The store's keys of the rounds (outside any round's prefix).
const OPEN: &str = "runner/elastic/open";
/// The token of node 0's hold of its run directory's lock ([`crate::rundir::lock`]).
const RUN_DIR: &str = "runner/elastic/run-dir";

fn join_key(round: usize, node: usize) -> String {
    format!("runner/elastic/{round}/join/{node}")
}

/// How many nodes read a round's refusal (node 0 waits for them before its store ends).
fn refused_key(round: usize) -> String {
    format!("runner/elastic/{round}/refused-read")
}

fn verdict_key(round: usize) -> String {
    format!("runner/elastic/{round}/verdict")
}

/// The prefix of round `round`'s keys.
fn round_prefix(round: usize) -> String {
    format!("runner/round-{round}")
}

/// What node 0 publishes when it closes a round.
#[derive(Debug, Serialize, Deserialize)]
enum Verdict {
    /// The nodes of the round, in rank order, the plan they run (as its file in the shared run
    /// directory holds it: plan.json, or a resume's pending plan) and that file.
    Go { members: Vec<usize>, plan: String, file: std::path::PathBuf, resume: bool },
    /// The run is over: why, and whether it is complete.
    Stop { why: String, complete: bool },
    /// The nodes do not run the same configuration: each differing key with every node's value.
    Refuse { why: String },
}

/// The configuration of `plan`'s run at `world` ranks with the same global batch: gradient
/// accumulation, or else the batch per rank, makes up for the other number of data-parallel
/// copies. Refused, with the reason, where neither divides.
pub fn resized(plan: &Plan, world: usize) -> anyhow::Result<Plan> {
    let c = &plan.config;
    let g = plan.global_batch();
    let mut config = c.clone();
    config.run.world_size = world;
    let mut changed = vec!["run.world_size"];
    if c.train.global_batch_size.is_none() {
        // Data-parallel copies scale with the ranks (a pipeline's stages stay).
        let copies = (plan.layout.world_size * world).checked_div(plan.world_size()).unwrap_or(0);
        let (b, a) = (c.train.batch_size, c.train.accumulate);
        if copies > 0 && g.is_multiple_of(b * copies) {
            config.train.accumulate = g / (b * copies);
            changed.push("train.accumulate");
        } else if copies > 0 && g.is_multiple_of(a * copies) {
            config.train.batch_size = g / (a * copies);
            changed.push("train.batch_size");
        } else {
            return Err(ConfigError::new(format!(
                "at world size {world} the run cannot keep its global batch of {g} samples per step \
                 (train.batch_size {b} × train.accumulate {a} × {} data-parallel copies): {copies} copies divide \
                 neither; choose --nnodes whose every size divides it",
                plan.layout.world_size
            ))
            .into());
        }
    }
    let mut sources = plan.sources.clone();
    let mut started_with = plan.started_with.clone();
    let first = serde_json::to_value(c).ok();
    for key in &changed {
        sources.insert((*key).to_owned(), format!("--nnodes (elastic, at world size {world})"));
        // The run stays the run it is: its id is that of the configuration it started with.
        let value = first.as_ref().and_then(|v| key.split('.').try_fold(v, |v, k| v.get(k)));
        let value = value.and_then(|v| toml::Value::try_from(v).ok());
        started_with.entry((*key).to_owned()).or_insert(value);
    }
    let resolved =
        crate::config::Resolved { config, sources, file: plan.pipeline_file.clone(), extends: plan.extends.clone() };
    let asked = Plan::new(resolved).map_err(|e| anyhow::anyhow!("at world size {world}: {e}"))?;
    let asked = Plan { run_id: plan.run_id.clone(), started_with, ..asked };
    anyhow::ensure!(
        asked.global_batch() == g,
        "at world size {world} the global batch would be {} samples, not the run's {g}",
        asked.global_batch()
    );
    Ok(asked)
}

/// `plan` at another world size, from the newest checkpoint (true) or from the start.
pub type AtSize<'a> = &'a dyn Fn(&Plan, usize) -> anyhow::Result<(Plan, bool)>;

/// Node 0's rounds: an [`Attempt`] of the restart loop ([`super::restart::supervise`]).
pub struct Host<'a> {
    store: Store,
    addr: String,
    port: u16,
    run_dir: &'a Path,
    nodes: Nodes,
    per_node: usize,
    /// The next round.
    round: usize,
    at_size: AtSize<'a>,
    /// How the run ended, for the nodes still waiting for a round; `None` once they were told.
    ended: Option<(String, bool)>,
    /// The run's configuration as node 0 started it: what every joining node must run.
    config: super::agree::FlatConfig,
    refused: bool,
}

impl<'a> Host<'a> {
    /// Serves the job's store on `addr:port` for as long as this launcher lives; `token`: that
    /// of this launcher's hold of `run_dir`'s lock, by which the other nodes know the directory.
    pub fn serve(
        plan: &Plan,
        (addr, port): (&str, u16),
        nodes: Nodes,
        run_dir: &'a Path,
        token: &str,
        at_size: AtSize<'a>,
    ) -> anyhow::Result<Host<'a>> {
        let timeout = Duration::from_secs_f64(plan.config.run.timeout_s);
        let listener = TcpListener::bind((addr, port))
            .with_context(|| format!("cannot listen on {addr}:{port} (--master-addr must be this node's address)"))?;
        let store = Store::serve(listener, plan.world_size(), timeout)?;
        store.set(RUN_DIR, token.as_bytes())?;
        let per_node = plan.world_size() / nodes.max;
        let config = super::agree::flat_config(plan);
        Ok(Host {
            store,
            addr: addr.to_owned(),
            port,
            run_dir,
            nodes,
            per_node,
            round: 0,
            at_size,
            ended: None,
            config,
            refused: false,
        })
    }

    /// Says how the run ended to the nodes that wait for another round.
    pub fn finish(&mut self, why: String, complete: bool) {
        self.ended = Some((why, complete));
    }

    /// The nodes that joined `round`, node 0 first: all of them, or at least MIN once the wait
    /// is over.
    fn gather(&self, round: usize, wait: Duration) -> anyhow::Result<Result<Vec<usize>, Outcome>> {
        self.store.set(OPEN, round.to_string().as_bytes())?;
        let deadline = Instant::now() + wait;
        loop {
            let mut joined = vec![0];
            for node in 1..self.nodes.max {
                if self.store.contains(&join_key(round, node))? {
                    joined.push(node);
                }
            }
            let over = Instant::now() >= deadline;
            if joined.len() == self.nodes.max || (over && joined.len() >= self.nodes.min) {
                return Ok(Ok(joined));
            }
            if over {
                anyhow::bail!(
                    "only {} of at least {} nodes joined within {} s{}: the run cannot go on",
                    joined.len(),
                    self.nodes.min,
                    wait.as_secs_f64(),
                    if round == 0 { " (run.timeout_s)" } else { " (run.rejoin_timeout_s)" }
                );
            }
            if let Some(i) = crate::signals::interruption() {
                return Ok(Err(Outcome::before_start(i, false)));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Refuses the round, on every node, when a node that joined runs another configuration
    /// than node 0 (the run's own, as it started: a resized round's plan is node 0's to make).
    fn same_config(&mut self, round: usize, members: &[usize]) -> anyhow::Result<()> {
        let mut all = vec![(0, self.config.clone())];
        for &node in &members[1..] {
            let said = self.store.get(&join_key(round, node))?;
            all.push((
                node,
                serde_json::from_slice(&said).with_context(|| format!("node {node} sent no configuration"))?,
            ));
        }
        let numbered: Vec<(usize, &super::agree::FlatConfig)> = all.iter().map(|(n, c)| (*n, c)).collect();
        let Some(why) = super::agree::differences_of(&numbered, "node") else { return Ok(()) };
        self.publish(round, &Verdict::Refuse { why: why.clone() })?;
        self.refused = true;
        // The store ends with this process: it stays until every other node has read the verdict.
        let deadline = Instant::now() + self.store.timeout();
        while self.store.add(&refused_key(round), 0)? < members.len() as i64 - 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(ConfigError::new(why).into())
    }

    fn publish(&self, round: usize, verdict: &Verdict) -> anyhow::Result<()> {
        Ok(self.store.set(&verdict_key(round), serde_json::to_string(verdict)?.as_bytes())?)
    }
}

impl Attempt for Host<'_> {
    fn run(&mut self, mut plan: Plan, mut resume: bool, manifest: &mut Manifest) -> anyhow::Result<(Plan, Outcome)> {
        loop {
            let round = self.round;
            let wait = Duration::from_secs_f64(match round {
                0 => plan.config.run.timeout_s,
                _ => plan.config.run.rejoin_timeout_s,
            });
            let members = match self.gather(round, wait)? {
                Ok(members) => members,
                Err(stopped) => return Ok((plan, stopped)),
            };
            self.same_config(round, &members)?;
            let world = members.len() * self.per_node;
            if world != plan.world_size() {
                (plan, resume) = (self.at_size)(&plan, world)?;
                crate::say_err!(
                    "{} of {} nodes: the run goes on at world size {world}{}",
                    members.len(),
                    self.nodes.max,
                    plan.reshards.last().map(|r| format!(" from step {}", r.step)).unwrap_or_default()
                );
                // Into the run directory with the round's plan, once every rank accepted it.
                manifest.reshards = plan.reshards.clone();
            }
            let file = pending_plan(self.run_dir, &plan, resume)?;
            let text = std::fs::read_to_string(&file)?;
            self.publish(round, &Verdict::Go { members: members.clone(), plan: text, file: file.clone(), resume })?;
            self.round += 1;
            self.store.set(OPEN, self.round.to_string().as_bytes())?;

            let prefix = round_prefix(round);
            let scoped = self.store.prefixed(&prefix)?;
            let meeting = Meeting {
                store: &scoped,
                addr: self.addr.clone(),
                port: self.port,
                prefix: Some(prefix),
                first_rank: 0,
                per_node: self.per_node,
                world,
            };
            // A node waiting for the next round, while this one runs with fewer than MAX: every
            // rank stops at the next checkpoint.
            let (mut asked, mut looked) = (false, Instant::now());
            let next = self.round;
            let (store, max) = (&self.store, self.nodes.max);
            let mut watch = || {
                if asked || members.len() == max || looked.elapsed() < Duration::from_millis(200) {
                    return;
                }
                looked = Instant::now();
                let waiting =
                    (1..max).any(|n| !members.contains(&n) && store.contains(&join_key(next, n)).unwrap_or(false));
                if waiting && scoped.set(crate::stages::preempt::REJOIN, b"1").is_ok() {
                    asked = true;
                    crate::say_err!("a node asks to join: every rank stops at the next checkpoint");
                }
            };
            let args = child_args(&file, self.run_dir, resume);
            let mut write = || plan.commit_run_dir(self.run_dir, manifest);
            let commit: Option<spawn::Commit> = resume.then_some(&mut write);
            let outcome = launch_guarded(|| spawn::start(&plan, &meeting, self.run_dir, &args, commit, &mut watch));
            rundir::remove_unfinished(self.run_dir);
            let outcome = outcome?;
            if asked && outcome.preempted && !crate::signals::preempted() {
                // The ranks stopped for the node that joins: the next round takes it in.
                resume = true;
                continue;
            }
            return Ok((plan, outcome));
        }
    }
}

impl Drop for Host<'_> {
    fn drop(&mut self) {
        if self.refused {
            return;
        }
        let (why, complete) = self.ended.take().unwrap_or(("node 0's launcher ended".into(), false));
        let _ = self.publish(self.round, &Verdict::Stop { why, complete });
    }
}

/// A node other than 0 of an elastic run: joins each round node 0 opens and runs its ranks
/// there, until the run is over. Returns the exit code.
pub fn follow(plan: &Plan, me: usize, master: (&str, u16), nodes: Nodes, run_dir: &Path) -> anyhow::Result<u8> {
    let timeout = Duration::from_secs_f64(plan.config.run.timeout_s);
    let (addr, port) = master;
    let store = Store::connect(addr, port, timeout)
        .map_err(|e| super::rank::unreachable(e, "node 0's", addr, port, timeout))?;
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
        store.set(&join_key(round, me), serde_json::to_string(&super::agree::flat_config(plan))?.as_bytes())?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_counts_read_as_torchrun_writes_them() {
        assert_eq!("2".parse::<Nodes>(), Ok(Nodes { min: 2, max: 2 }));
        assert_eq!("1:4".parse::<Nodes>(), Ok(Nodes { min: 1, max: 4 }));
        for bad in ["0", "0:2", "3:2", "a:2", "1:", ""] {
            assert!(bad.parse::<Nodes>().is_err(), "{bad:?} must be refused");
        }
    }

    fn plan(dir: &Path, batch: usize, accumulate: usize) -> Plan {
        let file = dir.join("p.toml");
        let text = format!(
            "[run]\nworld_size = 4\n[load]\nrows = 512\nfeatures = 4\nclasses = 2\nvalidation_rows = 16\n\
             [train]\nbatch_size = {batch}\naccumulate = {accumulate}\n"
        );
        std::fs::write(&file, text).unwrap();
        Plan::new(crate::config::resolve(&file, &[]).unwrap()).unwrap()
    }

    #[test]
    fn a_smaller_world_keeps_the_global_batch_by_accumulation_or_else_the_batch() {
        let dir = tempfile::tempdir().unwrap();
        let p = plan(dir.path(), 8, 1);
        let half = resized(&p, 2).unwrap();
        assert_eq!((half.world_size(), half.config.train.accumulate, half.global_batch()), (2, 2, 32));
        assert_eq!(half.sources["train.accumulate"], "--nnodes (elastic, at world size 2)");
        // Still the run it is: its ranks load it from plan.json (a run may start below MAX nodes).
        assert_eq!(half.run_id, p.run_id);
        let file = dir.path().join("plan.json");
        half.save(&file).unwrap();
        assert_eq!(Plan::load(&file).unwrap().config.run.world_size, 2);
        // 32 samples over 3 copies: neither the accumulation nor the batch divides.
        let e = resized(&p, 3).unwrap_err().to_string();
        assert!(e.contains("cannot keep its global batch of 32 samples"), "{e}");
        // From 2 copies of accumulate 2 back to 4 copies: accumulate 1.
        let back = resized(&half, 4).unwrap();
        assert_eq!((back.config.train.accumulate, back.config.train.batch_size), (1, 8));
        // Batches of 2 accumulated 3 times over 4 ranks: 24 samples; at 3 ranks, 4 times.
        let odd = resized(&plan(dir.path(), 2, 3), 3).unwrap();
        assert_eq!((odd.config.train.accumulate, odd.config.train.batch_size, odd.global_batch()), (4, 2, 24));
        // Batches of 4 over 4 ranks: 16 samples; at 8 ranks the batch halves.
        let wide = resized(&plan(dir.path(), 4, 1), 8).unwrap();
        assert_eq!((wide.config.train.accumulate, wide.config.train.batch_size, wide.global_batch()), (1, 2, 16));
    }
}
