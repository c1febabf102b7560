//! `runner run` as a launcher: hosts the store on a loopback socket it bound itself, spawns one
//! process per rank with the torchrun variables, forwards their stderr, and supervises them.
//! When a rank fails, the others get `run.abort_after_s` to stop on their own (they fail their
//! next collective, naming it), then are killed. No rank outlives the launcher.
use std::collections::VecDeque;

use anyhow::Context;
use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::env::{AGENT_STORE, LAUNCHER_PID, STORE_PREFIX};
use crate::dist::Store;
use crate::plan::Plan;

const STDERR_TAIL: usize = 12;

/// How the ranks ended.
#[derive(Debug)]
pub struct Outcome {
    /// The first rank to fail, how, and its last stderr lines.
    pub failure: Option<Failure>,
    /// The signal ([`crate::signals::stop`]) that interrupted the run.
    pub interrupted: Option<i32>,
    /// Every rank stopped on `run.preempt_signal` after writing its part of a checkpoint, or the
    /// signal came before any rank started.
    pub preempted: bool,
    /// Whether any rank was started.
    pub started: bool,
    /// From the start of the launch until every rank of this node was training (its position
    /// said so): a restart's time to get going again. `None` when they never were.
    pub training_after: Option<Duration>,
    /// Whether the run's directory took its files: always for a fresh run; for a resume, once
    /// every rank accepted its plan (and the launcher wrote them).
    pub committed: bool,
}

impl Outcome {
    /// The launcher was stopped or preempted before it started any rank.
    pub fn before_start(i: crate::signals::Interruption, committed: bool) -> Outcome {
        Outcome {
            failure: None,
            interrupted: (!i.preempt).then_some(i.signal),
            preempted: i.preempt,
            started: false,
            training_after: None,
            committed,
        }
    }
}

#[derive(Debug)]
pub struct Failure {
    pub rank: usize,
    pub how: String,
    /// Stage, epoch and step the rank had reached.
    pub position: Option<String>,
    /// Optimizer steps the run had done, as the rank last recorded.
    pub steps_done: Option<usize>,
    /// From the failure (for a stalled rank: its last progress) until every rank had stopped.
    pub detect: Duration,
    pub stderr_tail: Vec<String>,
    /// Ranks killed because they had not stopped within abort_after_s, and where they were
    /// (a rank stalled in a collective shows here).
    pub killed: Vec<(usize, Option<String>)>,
}

impl Failure {
    pub fn summary(&self) -> String {
        let mut s = format!("rank {} {}", self.rank, self.how);
        if let Some(p) = &self.position {
            s += &format!(" during {p}");
        }
        for (rank, position) in &self.killed {
            s += &format!("; rank {rank} did not stop within abort_after_s and was killed");
            if let Some(p) = position {
                s += &format!(" (it was in {p})");
            }
        }
        s
    }

    /// How it ended and the error it gave: "was killed by SIGKILL", "exited with code 1: the
    /// training loss became NaN ..." (the rank's own `error:` line, without its rank).
    pub fn cause(&self) -> String {
        let error = self.stderr_tail.iter().rev().find_map(|l| l.strip_prefix("error: ")).map(|e| {
            let without_rank = e.strip_prefix("rank ").and_then(|r| r.split_once(": ")).map(|(_, rest)| rest);
            without_rank.unwrap_or(e).to_owned()
        });
        match error {
            Some(e) => format!("{}: {e}", self.how),
            None => self.how.clone(),
        }
    }
}

pub(super) struct Rank {
    pub(super) child: Child,
    pub(super) status: Option<ExitStatus>,
    pub(super) tail: Arc<Mutex<VecDeque<String>>>,
}

/// Which part of the job this launcher runs: `nnodes` launchers (one per node) each start
/// world_size / nnodes ranks; node 0 hosts the store at `master`.
#[derive(Debug, Clone)]
pub struct Topology {
    /// The nodes of the job (the most, for an elastic one).
    pub nnodes: usize,
    /// The fewest it goes on with (`--nnodes MIN:MAX`); `nnodes` for a job of fixed size.
    pub min_nodes: usize,
    pub node_rank: usize,
    /// Address and port of node 0's store; None on a single node (loopback, OS-chosen port).
    pub master: Option<(String, u16)>,
    /// The engine whose variables gave the layout, and which ones ([`super::engines`]).
    pub engine: Option<String>,
}

impl Topology {
    pub fn single() -> Topology {
        Topology { nnodes: 1, min_nodes: 1, node_rank: 0, master: None, engine: None }
    }
}

/// Meets the job's other nodes (the store; `met` where the launcher met them already, to settle
/// the run directory first: [`super::nodes`]), then starts and supervises this node's ranks
/// ([`start`]; `commit` as there).
pub fn launch(
    plan: &Plan,
    topology: &Topology,
    run_dir: &Path,
    child_args: &[OsString],
    commit: Option<Commit>,
    met: Option<Met>,
) -> anyhow::Result<Outcome> {
    // Ctrl-C, SIGTERM, SIGHUP, ... stop the ranks through the supervision loop below; the
    // preemption signal is forwarded to them ([`crate::signals`], set up since the first instruction).
    crate::signals::set_preempt(plan.config.run.preempt_signal.number());
    let world = plan.world_size();
    let per_node = world / topology.nnodes;
    let timeout = Duration::from_secs_f64(plan.config.run.timeout_s);
    let Met { store, addr, port } = match met.map_or_else(|| rendezvous(topology, world, timeout), Ok) {
        Ok(met) => met,
        Err(e) => return stopped(e, commit.is_none()),
    };
    if topology.nnodes > 1 {
        let parties = super::agree::Parties { label: "node", me: topology.node_rank, count: topology.nnodes };
        if let Err(e) = super::agree::same_config(&store, plan, parties) {
            return stopped(e, commit.is_none());
        }
    }
    let meeting =
        Meeting { store: &store, addr, port, prefix: None, first_rank: topology.node_rank * per_node, per_node, world };
    start(plan, &meeting, run_dir, child_args, commit, &mut || {})
}

/// A signal ends the rendezvous' waits: the run then ends as the signal says, not as failed.
/// `committed`: whether the run directory already holds this run's files (not a resume).
pub fn stopped(e: anyhow::Error, committed: bool) -> anyhow::Result<Outcome> {
    match crate::signals::interruption() {
        Some(i) => Ok(Outcome::before_start(i, committed)),
        None => Err(e),
    }
}

/// Where this node's ranks meet the job's: the store (under the attempt's prefix), its address
/// as the ranks reach it, and which of the `world` ranks this node runs.
pub struct Meeting<'a> {
    pub store: &'a Store,
    pub addr: String,
    pub port: u16,
    /// The prefix of the attempt's keys in the store, when it outlives attempts (the elastic
    /// host's); the ranks take it from [`STORE_PREFIX`].
    pub prefix: Option<String>,
    pub first_rank: usize,
    pub per_node: usize,
    pub world: usize,
}

/// What writes a resumed run's files (plan.json, config.toml, the manifest) into its directory
/// once every rank accepted the plan ([`super::rank::Commit`]): this node's share of it (node 0's
/// launcher writes them; another node's has nothing to write where the directory is shared, but
/// answers all the same).
pub type Commit<'a> = &'a mut dyn FnMut() -> anyhow::Result<()>;

/// Starts this node's ranks of `plan` and supervises them until every one has ended. `commit`:
/// with a resume, called once rank 0 said through the store that every rank accepted the plan and
/// loaded the checkpoint; the ranks wait for every node's answer ([`super::rank::committed`]).
/// `tick` runs at every turn of the supervision (the elastic host watches for joining nodes there).
pub fn start(
    plan: &Plan,
    meeting: &Meeting,
    run_dir: &Path,
    child_args: &[OsString],
    commit: Option<Commit>,
    tick: &mut dyn FnMut(),
) -> anyhow::Result<Outcome> {
    if let Some(i) = crate::signals::interruption() {
        return Ok(Outcome::before_start(i, commit.is_none()));
    }
    let (ranks, readers) = spawn_ranks(plan, meeting, child_args)?;
    let mut watch = super::supervise::Supervisor::new(plan, meeting, run_dir, ranks, commit);
    while !watch.turn(tick)? {
        std::thread::sleep(Duration::from_millis(20));
    }
    for reader in readers {
        let _ = reader.join();
    }
    Ok(watch.outcome())
}

/// This node's ranks, started with the torchrun variables, and the threads that forward each
/// one's stderr (keeping its last lines).
fn spawn_ranks(
    plan: &Plan,
    meeting: &Meeting,
    child_args: &[OsString],
) -> anyhow::Result<(Vec<Rank>, Vec<std::thread::JoinHandle<()>>)> {
    let exe = std::env::current_exe()?;
    let Meeting { first_rank, per_node, world, .. } = *meeting;
    let mut ranks = Vec::with_capacity(per_node);
    let mut readers = Vec::with_capacity(per_node);
    for local in 0..per_node {
        let r = first_rank + local;
        let mut command = Command::new(&exe);
        command
            .args(child_args)
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", per_node.to_string())
            .env("MASTER_ADDR", &meeting.addr)
            .env("MASTER_PORT", meeting.port.to_string())
            .env(AGENT_STORE, "True")
            .env(LAUNCHER_PID, std::process::id().to_string())
            .env("OMP_NUM_THREADS", plan.threads_per_rank.to_string())
            .stdin(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(prefix) = &meeting.prefix {
            command.env(STORE_PREFIX, prefix);
        }
        // Started with the signals blocked: one forwarded while the rank still loads waits for
        // the rank's own setup instead of killing it.
        let mut child = crate::signals::blocked(|| command.spawn())?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let stderr = child.stderr.take().expect("piped");
        let sink = Arc::clone(&tail);
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                crate::say_err!("[rank {r}] {line}");
                let mut t = sink.lock().unwrap();
                if t.len() == STDERR_TAIL {
                    t.pop_front();
                }
                t.push_back(line);
            }
        }));
        ranks.push(Rank { child, status: None, tail });
    }
    Ok((ranks, readers))
}

/// The job's store, with the address and port the ranks reach it at.
pub struct Met {
    pub store: Store,
    pub addr: String,
    pub port: u16,
}

/// The job's store: served on this node (node 0, or a single node on an OS-chosen loopback
/// port) or joined at node 0's.
pub fn rendezvous(topology: &Topology, world: usize, timeout: Duration) -> anyhow::Result<Met> {
    let (store, addr, port) = match &topology.master {
        None => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let port = listener.local_addr()?.port();
            (Store::serve(listener, world, timeout)?, "127.0.0.1".to_string(), port)
        }
        Some((addr, port)) if topology.node_rank == 0 => {
            // Bound here, on the master address only, then handed to the store.
            let listener = TcpListener::bind((addr.as_str(), *port)).with_context(|| {
                format!("cannot listen on {addr}:{port} (--master-addr must be this node's address)")
            })?;
            (Store::serve(listener, world, timeout)?, addr.clone(), *port)
        }
        Some((addr, port)) => {
            let store = Store::connect(addr, *port, timeout)
                .map_err(|e| super::rank::unreachable(e, "node 0's", addr, *port, timeout))?;
            (store, addr.clone(), *port)
        }
    };
    Ok(Met { store, addr, port })
}

/// Whether `pid` is stopped (state T) or traced (t).
pub(super) fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with(['T', 't'])))
        .unwrap_or(false)
}

pub(super) fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => {
            let name = nix::sys::signal::Signal::try_from(sig)
                .map(|s| s.as_str().to_owned())
                .unwrap_or_else(|_| format!("signal {sig}"));
            format!("was killed by {name}")
        }
        _ => "ended".into(),
    }
}
