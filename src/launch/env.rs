//! The torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...): set by `runner run` for the
//! ranks it spawns, or by torchrun or another launcher; under srun, the Slurm variables
//! ([`super::slurm`]).
use anyhow::{bail, Context};

/// Set on ranks spawned by `runner run`: the launcher's pid (so a rank dies with it).
pub const LAUNCHER_PID: &str = "RUNNER_LAUNCHER_PID";
/// Set by `runner sweep` on the launchers it starts: its pid (the launcher stops with it).
pub const SWEEP_PID: &str = "RUNNER_SWEEP_PID";
/// torchrun's flag for "the launcher hosts the store; every rank is a client".
pub const AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// Set on ranks by an elastic launcher ([`super::elastic`]): the prefix of the attempt's keys in
/// the store, which outlives attempts (named where the ranks' loop reads it).
pub use crate::stages::preempt::STORE_PREFIX;
/// How many times torchrun restarted this job's workers (its `--max-restarts`).
pub const TORCHRUN_RESTARTS: &str = "TORCHELASTIC_RESTART_COUNT";
/// How many times Slurm requeued this job.
pub const SLURM_RESTARTS: &str = "SLURM_RESTART_COUNT";

/// A count of restarts its launcher gives in `var`: 0 when absent or not a number.
pub fn restarts(var: &str) -> usize {
    std::env::var(var).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// What started this rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Launcher {
    /// `runner run` itself (its ranks carry RUNNER_LAUNCHER_PID).
    Runner,
    /// torchrun or another launcher that sets RANK and WORLD_SIZE.
    Torchrun,
    /// srun: one task per rank.
    Srun,
}

impl Launcher {
    /// How the mismatch message names the launcher and its count of ranks.
    pub fn started(self, n: usize) -> String {
        match self {
            Launcher::Runner => format!("the launcher started {n} ranks"),
            Launcher::Torchrun => format!("the launcher started {n} ranks (WORLD_SIZE={n})"),
            Launcher::Srun => format!("srun started {n} tasks (SLURM_STEP_NUM_TASKS={n}), one rank each"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RankEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The store is hosted by the launcher, not by rank 0.
    pub agent_store: bool,
    pub launcher_pid: Option<u32>,
    pub launcher: Launcher,
    /// How many times the launcher started the job's ranks again (torchrun's
    /// TORCHELASTIC_RESTART_COUNT, Slurm's SLURM_RESTART_COUNT): above 0, a run of this
    /// configuration left unfinished in the run directory goes on from its newest checkpoint.
    pub restarts: usize,
}

impl RankEnv {
    /// `None` when RANK is not set and this is not one of several srun tasks per node (then
    /// `runner run` launches the ranks itself).
    pub fn from_env() -> anyhow::Result<Option<RankEnv>> {
        let Ok(rank) = std::env::var("RANK") else {
            return match super::slurm::Step::from_env()? {
                Some(step) if step.tasks_are_ranks() => Ok(Some(step.rank_env()?)),
                _ => Ok(None),
            };
        };
        let var = |k: &str| {
            std::env::var(k).with_context(|| format!("RANK is set, so {k} must be set too (torchrun sets both)"))
        };
        let num = |k: &str, v: String| v.parse::<usize>().with_context(|| format!("{k}={v:?} is not a number"));
        let rank = num("RANK", rank)?;
        let world_size = num("WORLD_SIZE", var("WORLD_SIZE")?)?;
        if rank >= world_size {
            bail!("RANK={rank} is not below WORLD_SIZE={world_size}");
        }
        let local_rank = std::env::var("LOCAL_RANK").ok().map(|v| num("LOCAL_RANK", v)).transpose()?.unwrap_or(rank);
        let local_world_size = std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .map(|v| num("LOCAL_WORLD_SIZE", v))
            .transpose()?
            .unwrap_or(world_size);
        if local_world_size == 0 || local_world_size > world_size {
            bail!("LOCAL_WORLD_SIZE={local_world_size} must be between 1 and WORLD_SIZE={world_size}");
        }
        if local_rank >= local_world_size {
            bail!("LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}");
        }
        if world_size > crate::limits::MAX_WORLD_SIZE {
            bail!("WORLD_SIZE={world_size} is more than the {} ranks the runner takes", crate::limits::MAX_WORLD_SIZE);
        }
        let master_addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
        let port = var("MASTER_PORT")?;
        let master_port = port.parse().with_context(|| format!("MASTER_PORT={port:?} is not a port number"))?;
        let agent_store = std::env::var(AGENT_STORE).is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        let launcher_pid = std::env::var(LAUNCHER_PID).ok().and_then(|v| v.parse().ok());
        Ok(Some(RankEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            agent_store,
            launcher_pid,
            launcher: if launcher_pid.is_some() { Launcher::Runner } else { Launcher::Torchrun },
            restarts: if launcher_pid.is_some() { 0 } else { restarts(TORCHRUN_RESTARTS) },
        }))
    }

    /// Whether every rank runs on this host (so the transport can stay on loopback).
    pub fn single_node(&self) -> bool {
        self.local_world_size == self.world_size && is_loopback(&self.master_addr)
    }
}

pub fn is_loopback(addr: &str) -> bool {
    addr == "localhost" || addr.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}
