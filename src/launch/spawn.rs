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
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

use super::env::{AGENT_STORE, LAUNCHER_PID, STORE_PREFIX};
use crate::dist::{record_exit, Store};
use crate::plan::Plan;
use crate::rundir::position;

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

struct Rank {
    child: Child,
    status: Option<ExitStatus>,
    tail: Arc<Mutex<VecDeque<String>>>,
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
    mut commit: Option<Commit>,
    tick: &mut dyn FnMut(),
) -> anyhow::Result<Outcome> {
    let mut committed = commit.is_none();
    let preempt_signal = plan.config.run.preempt_signal.number();
    // How a rank that was preempted exits.
    let preempted_exit = Some(128 + preempt_signal);
    let Meeting { store, first_rank, per_node, world, .. } = *meeting;
    let (master_addr, port) = (&meeting.addr, meeting.port);
    let timeout = Duration::from_secs_f64(plan.config.run.timeout_s);
    if let Some(i) = crate::signals::interruption() {
        return Ok(Outcome::before_start(i, committed));
    }
    let exe = std::env::current_exe()?;

    let mut ranks = Vec::with_capacity(world);
    let mut readers = Vec::with_capacity(world);
    for local in 0..per_node {
        let r = first_rank + local;
        let mut command = Command::new(&exe);
        command
            .args(child_args)
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", per_node.to_string())
            .env("MASTER_ADDR", master_addr)
            .env("MASTER_PORT", port.to_string())
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

    let launched = Instant::now();
    let mut training_after = None;
    let abort_after = Duration::from_secs_f64(plan.config.run.abort_after_s);
    // The first failure: its rank, how, when it was noticed and when it began (a stall: its start).
    let mut first_failure: Option<(usize, String, Instant, Instant)> = None;
    let mut interrupted: Option<(i32, Instant)> = None;
    let mut killed = Vec::new();
    let mut stopped_since: Vec<Option<Instant>> = vec![None; ranks.len()];
    let mut stall_blamed = false;
    let mut watchdog = super::watchdog::Watchdog::new(&plan.config.run, ranks.len());
    let mut preempting = false;
    loop {
        tick();
        if crate::signals::preempted() && !preempting && interrupted.is_none() {
            preempting = true;
            for rank in ranks.iter().filter(|r| r.status.is_none()) {
                let _ = signal::kill(Pid::from_raw(rank.child.id() as i32), Signal::try_from(preempt_signal).ok());
            }
        }
        if let (Some(sig), None) = (crate::signals::stop(), interrupted) {
            interrupted = Some((sig, Instant::now()));
            for rank in ranks.iter().filter(|r| r.status.is_none()) {
                let _ = signal::kill(Pid::from_raw(rank.child.id() as i32), Signal::SIGTERM);
            }
        }
        if let Some(write) = commit.as_mut().filter(|_| store.contains(super::rank::ACCEPTED).unwrap_or(false)) {
            let said = write().err().map(|e| format!("cannot write the resumed run's files: {e:#}"));
            committed = said.is_none();
            // This node's place among the job's (in an elastic round, among the round's nodes).
            let node = first_rank / per_node.max(1);
            let _ = store.set(&super::rank::committed(node), said.unwrap_or_default().as_bytes());
            commit = None;
        }
        for (local, rank) in ranks.iter_mut().enumerate() {
            let r = first_rank + local;
            if rank.status.is_some() {
                continue;
            }
            if let Some(status) = rank.child.try_wait()? {
                rank.status = Some(status);
                // A rank exits so only once every rank agreed to stop after the same step and
                // wrote its part of the checkpoint, whoever was sent the signal.
                let preempted = status.code() == preempted_exit;
                if !status.success() && !preempted && first_failure.is_none() && interrupted.is_none() {
                    let how = describe(status);
                    // Peers blocked on this rank name it in their errors.
                    let _ = record_exit(store, r, &how);
                    first_failure = Some((r, how, Instant::now(), Instant::now()));
                }
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        // A stopped rank (SIGSTOP, a debugger) stalls every collective: once it has been stopped
        // for timeout_s, or when a peer fails meanwhile, it is the root cause and is killed.
        for (local, rank) in ranks.iter().enumerate() {
            let stopped = rank.status.is_none() && is_stopped(rank.child.id());
            stopped_since[local] = if stopped { stopped_since[local].or(Some(Instant::now())) } else { None };
        }
        if interrupted.is_none() && !stall_blamed {
            let stalled =
                stopped_since.iter().enumerate().filter_map(|(l, s)| s.map(|s| (l, s))).min_by_key(|(_, s)| *s);
            if let Some((local, since)) = stalled {
                let r = first_rank + local;
                let blame = match &first_failure {
                    None => since.elapsed() >= timeout,
                    Some((f, ..)) => *f != r,
                };
                if blame {
                    let mut how = format!(
                        "was stopped (SIGSTOP or a debugger) for {:.1} s and stalled the job",
                        since.elapsed().as_secs_f64()
                    );
                    match &first_failure {
                        Some((f, then, ..)) => how += &format!("; rank {f} then {then}"),
                        // Peers blocked on this rank name it in their errors.
                        None => drop(record_exit(store, r, &how)),
                    }
                    let at = first_failure.as_ref().map_or(Instant::now(), |f| f.2);
                    first_failure = Some((r, how, at, since));
                    stall_blamed = true;
                    // A stopped rank cannot wind down: it goes now, and its peers' collectives
                    // fail at once rather than at their own timeout.
                    let rank = &mut ranks[local];
                    let _ = rank.child.kill();
                    rank.status = Some(rank.child.wait()?);
                }
            }
        }
        // A rank stuck in one training step (computation that never ends) fails the run.
        if interrupted.is_none() && first_failure.is_none() {
            let running: Vec<bool> = ranks.iter().map(|r| r.status.is_none()).collect();
            if let Some((local, how, since)) = watchdog.stalled(run_dir, first_rank, &running) {
                let r = first_rank + local;
                // The step that never ends may be a stopped rank's, caught here a moment before
                // the stop's own timeout: the stop is the cause.
                let how = match stopped_since[local] {
                    Some(s) => format!(
                        "was stopped (SIGSTOP or a debugger) for {:.1} s and stalled the job",
                        s.elapsed().as_secs_f64()
                    ),
                    None => how,
                };
                // Peers blocked on this rank name it in their errors.
                let _ = record_exit(store, r, &how);
                let rank = &mut ranks[local];
                let _ = rank.child.kill();
                rank.status = Some(rank.child.wait()?);
                first_failure = Some((r, how, Instant::now(), since));
            }
            if training_after.is_none() && watchdog.all_training() {
                training_after = Some(launched.elapsed());
            }
        }
        let since = first_failure.as_ref().map(|f| f.2).or(interrupted.map(|i| i.1));
        if since.is_some_and(|at| at.elapsed() >= abort_after) {
            let cause = first_failure.as_ref().map(|f| f.0);
            for (local, rank) in ranks.iter_mut().enumerate().filter(|(_, r)| r.status.is_none()) {
                let _ = rank.child.kill();
                rank.status = Some(rank.child.wait()?);
                if cause != Some(first_rank + local) {
                    killed.push((first_rank + local, position::read(run_dir, first_rank + local)));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for reader in readers {
        let _ = reader.join();
    }
    let ended = Instant::now();
    let failure = first_failure.map(|(rank, how, _, began)| Failure {
        rank,
        how,
        position: position::read(run_dir, rank),
        steps_done: position::read_done(run_dir, rank),
        detect: ended.saturating_duration_since(began),
        stderr_tail: ranks[rank - first_rank].tail.lock().unwrap().iter().cloned().collect(),
        killed,
    });
    position::remove_all(run_dir, first_rank..first_rank + per_node);
    let preempted = failure.is_none()
        && interrupted.is_none()
        && ranks.iter().any(|r| r.status.and_then(|s| s.code()) == preempted_exit);
    Ok(Outcome { failure, interrupted: interrupted.map(|i| i.0), preempted, started: true, training_after, committed })
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
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with(['T', 't'])))
        .unwrap_or(false)
}

fn describe(status: ExitStatus) -> String {
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
