//! One rank: join the store and the process group, run the stages, report how it ended.
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::env::{is_loopback, RankEnv};
use crate::config::schema::Backend as BackendKind;
use crate::dist::{Backend, ProcessGroup, Store};
use crate::plan::Plan;
use crate::trace::EpochRow;

/// Who writes a resumed run's new plan, configuration and manifest into its directory, once
/// every rank has accepted the plan (loaded it and the checkpoint): until then the directory
/// stays as it was, and a resume that fails leaves a complete run complete.
pub enum Commit<'a> {
    /// Runner's own launcher, told through the store ([`ACCEPTED`], [`committed`]).
    Launcher,
    /// This process (rank 0 under torchrun or srun, which owns the directory).
    Here(&'a dyn Fn() -> anyhow::Result<()>),
    /// Another process: this rank only waits for the others.
    Elsewhere,
}

/// The store key rank 0 sets once every rank accepted a resumed run's plan.
pub const ACCEPTED: &str = "runner/resume/accepted";

/// The store key node `node`'s launcher sets once it wrote the resumed run's files: empty, or
/// why it could not.
pub fn committed(node: usize) -> String {
    format!("runner/resume/committed/{node}")
}

/// Runs this rank of `plan` over `store` ([`open_store`]).
pub fn run(
    plan: &Plan,
    env: &RankEnv,
    store: Arc<Store>,
    run_dir: &Path,
    resume: bool,
    commit: Commit,
) -> anyhow::Result<Vec<EpochRow>> {
    check_world_size(plan, env)?;
    let device = plan.device(env.local_rank);
    crate::device::check_rank(device)?;
    if let (true, tch::Device::Cuda(index)) = (plan.config.run.cuda_graphs, device) {
        // Before anything runs on the device: every kernel of the rank on the stream it captures on.
        crate::dist::use_side_stream(index)?;
    }
    let timeout = Duration::from_secs_f64(plan.config.run.timeout_s);
    let host =
        if env.single_node() { "127.0.0.1".to_string() } else { address_towards(&env.master_addr, env.master_port)? };
    let backend = match plan.config.run.backend {
        BackendKind::Gloo => Backend::Gloo,
        BackendKind::Nccl => Backend::Nccl { device: env.local_rank },
    };
    let pg = ProcessGroup::new(backend, store.clone(), env.rank, env.world_size, &host, timeout)?;
    pin_main_thread(env, plan.threads_per_rank);
    let accept = || -> anyhow::Result<()> {
        if !resume {
            return Ok(());
        }
        // Every rank holds the plan and its checkpoint: the run directory may take them.
        pg.barrier()?;
        if env.rank == 0 {
            match commit {
                Commit::Launcher => launcher_commits(&store, env)?,
                Commit::Here(write) => write()?,
                Commit::Elsewhere => {}
            }
        }
        Ok(pg.barrier()?)
    };
    match crate::stages::run(plan, &pg, device, run_dir, resume, &accept) {
        Ok(rows) => {
            pg.barrier()?;
            Ok(rows)
        }
        // Every rank stopped after the same step and wrote its part of the checkpoint.
        Err(e) if e.is::<crate::stages::preempt::Preempted>() => Err(e),
        Err(e) => {
            // Peers blocked on this rank learn why, rather than only that a socket closed.
            pg.leave(&format!("failed: {}", first_line(&format!("{e:#}"))));
            Err(e)
        }
    }
}

/// Tells every node's launcher that the ranks accepted the resumed plan, and waits until each
/// has written it into its run directory.
fn launcher_commits(store: &Store, env: &RankEnv) -> anyhow::Result<()> {
    store.set(ACCEPTED, b"1")?;
    for node in 0..env.world_size / env.local_world_size.max(1) {
        let said = store.get(&committed(node))?;
        anyhow::ensure!(said.is_empty(), "{}", String::from_utf8_lossy(&said));
    }
    Ok(())
}

/// Refuses a plan whose run.world_size is not the number of ranks the launcher started.
pub fn check_world_size(plan: &Plan, env: &RankEnv) -> anyhow::Result<()> {
    if env.world_size != plan.world_size() {
        return Err(crate::config::ConfigError::new(format!(
            "{}, but run.world_size is {}; pass --set run.world_size={}, or start {} ranks",
            env.launcher.started(env.world_size),
            plan.world_size(),
            env.world_size,
            plan.world_size()
        ))
        .into());
    }
    Ok(())
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// The store: a client of the launcher's (torchrun, runner) or, without one, served by rank 0.
/// Under torchrun, and an elastic launcher, its keys go under the attempt's prefix: a restarted
/// job meets in the same store as the attempt before, whose keys are still there.
pub fn open_store(env: &RankEnv, timeout: Duration) -> anyhow::Result<Store> {
    let store = joined_store(env, timeout)?;
    let prefix = match env.launcher {
        super::env::Launcher::Torchrun => Some(format!("runner/attempt-{}", env.restarts)),
        super::env::Launcher::Runner => std::env::var(super::env::STORE_PREFIX).ok(),
        super::env::Launcher::Srun => None,
    };
    match prefix {
        Some(prefix) => Ok(store.prefixed(&prefix)?),
        None => Ok(store),
    }
}

fn joined_store(env: &RankEnv, timeout: Duration) -> anyhow::Result<Store> {
    if env.rank == 0 && !env.agent_store {
        if is_loopback(&env.master_addr) {
            let listener = TcpListener::bind(("127.0.0.1", env.master_port))
                .with_context(|| format!("cannot listen on 127.0.0.1:{} (MASTER_PORT)", env.master_port))?;
            return Ok(Store::serve(listener, env.world_size, timeout)?);
        }
        return Ok(Store::listen(env.master_port, env.world_size, timeout)?);
    }
    let whose = if env.agent_store { "the launcher's" } else { "rank 0's" };
    Store::connect(&env.master_addr, env.master_port, timeout)
        .map_err(|e| unreachable(e, whose, &env.master_addr, env.master_port, timeout))
}

/// A store that could not be joined, said as what to check.
pub fn unreachable(e: crate::dist::Error, whose: &str, addr: &str, port: u16, timeout: Duration) -> anyhow::Error {
    anyhow::anyhow!(
        "cannot join {whose} rendezvous store at {addr}:{port}: {}; check that {whose} `runner run` is up and serving \
         this address and port (run.timeout_s = {} s bounds the wait)",
        e.message.trim_end_matches('.'),
        timeout.as_secs_f64()
    )
}

/// This host's address on the interface that reaches the master: where peers on other nodes
/// reach this rank's gloo transport. (A UDP "connect" only picks the route; nothing is sent.)
fn address_towards(master: &str, port: u16) -> anyhow::Result<String> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
    socket.connect((master, port)).with_context(|| format!("no route to the master {master}:{port}"))?;
    Ok(socket.local_addr()?.ip().to_string())
}

/// Gives this rank's main thread, and the intra-op threads it starts later, cores of its own when
/// the node's ranks × threads fit on its cores (2 ranks × 1 thread on 2 cores: one core each).
/// Left to the scheduler, the threads that hand gloo's messages to each other migrate between
/// cores, and a 20 KB all-reduce between two ranks took 2 ms instead of 0.7 ms on the
/// development machine. gloo's own threads, started with the process group, stay unpinned.
fn pin_main_thread(env: &RankEnv, threads: usize) {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let Ok(allowed) = sched_getaffinity(Pid::from_raw(0)) else { return };
    let cores: Vec<usize> = (0..CpuSet::count()).filter(|&c| allowed.is_set(c).unwrap_or(false)).collect();
    if env.local_world_size < 2 || env.local_world_size * threads > cores.len() {
        return;
    }
    let mut mine = CpuSet::new();
    for &c in &cores[env.local_rank * threads..(env.local_rank + 1) * threads] {
        let _ = mine.set(c);
    }
    // Pid 0 is the calling thread: only it (and what it starts from now on) is pinned.
    let _ = sched_setaffinity(Pid::from_raw(0), &mine);
}

/// Makes the kernel kill this rank when the launcher dies, whatever killed the launcher.
pub fn die_with_launcher(pid: u32) {
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    // The launcher may have died before the line above took effect.
    if nix::unistd::getppid().as_raw() as u32 != pid {
        std::process::exit(1);
    }
}
