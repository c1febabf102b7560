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
use serde::{Deserialize, Serialize};

use crate::config::ConfigError;
use crate::plan::Plan;

mod follow;
mod host;

pub use follow::follow;
pub use host::{AtSize, Host};

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

#[cfg(test)]
mod tests {
    use std::path::Path;

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
