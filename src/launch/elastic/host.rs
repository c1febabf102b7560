//! Node 0 of an elastic run: it hosts the rendezvous and closes each round (see the parent module).
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::{join_key, refused_key, round_prefix, verdict_key, Nodes, Verdict, OPEN, RUN_DIR};
use crate::config::ConfigError;
use crate::dist::Store;
use crate::launch::restart::{child_args, launch_guarded, pending_plan, Attempt};
use crate::launch::spawn::{self, Meeting, Outcome};
use crate::plan::Plan;
use crate::rundir::{self, manifest::Manifest};

/// `plan` at another world size, from the newest checkpoint (true) or from the start.
pub type AtSize<'a> = &'a dyn Fn(&Plan, usize) -> anyhow::Result<(Plan, bool)>;

/// Node 0's rounds: an [`Attempt`] of the restart loop ([`crate::launch::restart::supervise`]).
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
    config: crate::launch::agree::FlatConfig,
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
        let config = crate::launch::agree::flat_config(plan);
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
        let numbered: Vec<(usize, &crate::launch::agree::FlatConfig)> = all.iter().map(|(n, c)| (*n, c)).collect();
        let Some(why) = crate::launch::agree::differences_of(&numbered, "node") else { return Ok(()) };
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
