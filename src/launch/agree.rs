//! One plan for every launcher. The participants of a job (the nodes' launchers of a multi-node
//! run; the ranks under torchrun or srun) each resolve the configuration they were given and
//! publish it, flattened to dotted keys, in the store; participant 0 compares them all and
//! publishes a verdict every participant waits for. On a mismatch every participant refuses
//! before training starts, naming each key that differs and its value on each participant.
//! Under an external launcher, rank 0 also claims the run directory (writing plan.json) and
//! publishes its plan: every rank trains on rank 0's plan, never on its own resolution.
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::config::ConfigError;
use crate::dist::Store;
use crate::plan::Plan;

/// Who takes part: `count` participants called `label` ("node", "rank"), this one `me`.
#[derive(Debug, Clone, Copy)]
pub struct Parties {
    pub label: &'static str,
    pub me: usize,
    pub count: usize,
}

const VERDICT: &str = "runner/config/verdict";
const READ: &str = "runner/config/verdict-read";
const PLAN: &str = "runner/config/plan";

/// Multi-node: every node's launcher must have resolved the same configuration.
pub fn same_config(store: &Store, plan: &Plan, parties: Parties) -> anyhow::Result<()> {
    agree(store, plan, parties, |_| Ok(((), String::new()))).map(|_| ())
}

/// What rank 0 settled for every rank: the plan, and whether the run resumes (from `--resume`,
/// or a preempted run of this configuration in the run directory).
#[derive(Debug, Serialize, Deserialize)]
pub struct Agreed {
    pub plan: Plan,
    pub resume: bool,
}

/// Under torchrun or srun: what every rank runs, as rank 0 settles it. Once the configurations
/// agree, rank 0 runs `claim` (taking the run directory); its error, like a mismatch, stops
/// every rank.
pub fn rank0_plan<T>(
    store: &Store,
    plan: &Plan,
    parties: Parties,
    claim: impl FnOnce(&Plan) -> anyhow::Result<(Agreed, T)>,
) -> anyhow::Result<(Agreed, Option<T>)> {
    let claimed = agree(store, plan, parties, |plan| {
        let (agreed, claimed) = claim(plan)?;
        let published = serde_json::to_string(&agreed)?;
        Ok(((agreed, claimed), published))
    })?;
    match claimed {
        Some((agreed, claimed)) => Ok((agreed, Some(claimed))),
        None => {
            let bytes = store.get(PLAN).map_err(|e| never(e, store, "rank 0 published no plan", "see its output"))?;
            let agreed = serde_json::from_slice(&bytes).context("rank 0 published a plan this rank cannot read")?;
            Ok((agreed, None))
        }
    }
}

/// Publishes this participant's configuration and waits for participant 0's verdict (an empty
/// one: every configuration is the same). Participant 0 publishes what its `claim` returns
/// beside the verdict; it alone gets `Some`.
fn agree<T>(
    store: &Store,
    plan: &Plan,
    parties: Parties,
    claim: impl FnOnce(&Plan) -> anyhow::Result<(T, String)>,
) -> anyhow::Result<Option<T>> {
    let mine = flat_config(plan);
    let key = |n: usize| config_key(parties.label, n);
    store.set(&key(parties.me), serde_json::to_string(&mine)?.as_bytes())?;
    if parties.me != 0 {
        let verdict = verdict(store, parties)?;
        return if verdict.is_empty() { Ok(None) } else { Err(ConfigError::new(verdict).into()) };
    }
    let mut all = vec![mine];
    for n in 1..parties.count {
        let bytes = store.get(&key(n)).map_err(|e| {
            let how = match parties.label {
                "node" => format!("start `runner run` with --nnodes {} on every node", parties.count),
                _ => format!("start all {} ranks, each with the same MASTER_ADDR and MASTER_PORT", parties.count),
            };
            never(e, store, &format!("{} {n} never joined", parties.label), &how)
        })?;
        all.push(
            serde_json::from_slice(&bytes).with_context(|| format!("{} {n} sent no configuration", parties.label))?,
        );
    }
    let (verdict, claimed) = match refusals(&all, parties.label).or_else(|| differences(&all, parties.label)) {
        Some(verdict) => (verdict, None),
        None => match claim(plan) {
            Ok((claimed, published)) => {
                store.set(PLAN, published.as_bytes())?;
                (String::new(), Some(claimed))
            }
            Err(e) => (format!("{e:#}"), None),
        },
    };
    store.set(VERDICT, verdict.as_bytes())?;
    if verdict.is_empty() {
        return Ok(claimed);
    }
    // The store may end with this process: it stays until every participant has read the verdict.
    let deadline = Instant::now() + store.timeout();
    while store.add(READ, 0)? < parties.count as i64 - 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(ConfigError::new(verdict).into())
}

/// Where participant `n` publishes its configuration.
fn config_key(label: &str, n: usize) -> String {
    format!("runner/config/{label}{n}")
}

/// A participant other than 0: waits for participant 0's verdict (empty when every
/// configuration is the same) and says it read it.
fn verdict(store: &Store, parties: Parties) -> anyhow::Result<String> {
    let verdict = store.get(VERDICT).map_err(|e| {
        never(
            e,
            store,
            &format!("{} 0 gave no verdict on the configurations", parties.label),
            "it waits for every participant, so one may never have started, or it stopped (see its output)",
        )
    })?;
    store.add(READ, 1)?;
    Ok(String::from_utf8_lossy(&verdict).into_owned())
}

/// What a participant other than 0 publishes in place of its configuration when it cannot start
/// (its own run directory refused it): participant 0 then refuses on every participant, naming
/// it and why. Waits for the verdict, so that participant 0's store outlives the news.
pub fn refuse(store: &Store, parties: Parties, why: &str) {
    let mine = FlatConfig::from([(REFUSED.to_owned(), why.to_owned())]);
    if let Ok(json) = serde_json::to_string(&mine) {
        if store.set(&config_key(parties.label, parties.me), json.as_bytes()).is_ok() {
            let _ = verdict(store, parties);
        }
    }
}

/// The key of a participant's refusal ([`refuse`]), where its configuration would be.
const REFUSED: &str = "(refused)";

/// The participants that could not start, with why; `None` when none refused.
fn refusals(all: &[FlatConfig], label: &str) -> Option<String> {
    let lines: Vec<String> =
        all.iter().enumerate().filter_map(|(n, c)| Some(format!("{label} {n}: {}", c.get(REFUSED)?))).collect();
    (!lines.is_empty())
        .then(|| format!("a {label} cannot start, so every {label} refused to start:\n  {}", lines.join("\n  ")))
}

/// A wait in the store that ended without an answer: `what` happened, `how` to fix it. A wait
/// that a signal ended keeps the store's own message.
fn never(e: crate::dist::Error, store: &Store, what: &str, how: &str) -> anyhow::Error {
    if crate::signals::interruption().is_some() {
        return e.into();
    }
    anyhow::anyhow!("{what} within run.timeout_s ({} s): {how}", store.timeout().as_secs_f64())
}

pub type FlatConfig = BTreeMap<String, String>;

const RUN_ID_KEY: &str = "run id (configuration and wrap.init file)";

/// The resolved configuration as dotted keys and JSON values, plus the run id (which also
/// covers the initial-weights file's bytes).
pub fn flat_config(plan: &Plan) -> FlatConfig {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut FlatConfig) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    walk(&if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, v, out);
                }
            }
            v => {
                out.insert(prefix.to_owned(), v.to_string());
            }
        }
    }
    let mut out = FlatConfig::new();
    walk("", &serde_json::to_value(&plan.config).unwrap_or_default(), &mut out);
    out.insert(RUN_ID_KEY.into(), plan.run_id.clone());
    out
}

/// Each key whose value differs between participants, with every participant's value; `None`
/// when all agree.
fn differences(all: &[FlatConfig], label: &str) -> Option<String> {
    let numbered: Vec<(usize, &FlatConfig)> = all.iter().enumerate().collect();
    differences_of(&numbered, label)
}

/// [`differences`] of the participants named by their numbers (an elastic round's nodes).
pub fn differences_of(all: &[(usize, &FlatConfig)], label: &str) -> Option<String> {
    let all: Vec<(usize, &FlatConfig)> = all.to_vec();
    let keys: BTreeSet<&String> = all.iter().flat_map(|(_, n)| n.keys()).collect();
    let differ: Vec<&String> =
        keys.into_iter().filter(|k| all.iter().any(|(_, n)| n.get(*k) != all[0].1.get(*k))).collect();
    // The run id differs whenever a key does: it is news only alone (a different wrap.init file).
    let only_id = differ.len() == 1;
    let lines: Vec<String> = differ
        .into_iter()
        .filter(|k| only_id || k.as_str() != RUN_ID_KEY)
        .map(|k| {
            let values: Vec<String> = all
                .iter()
                .map(|(i, n)| format!("{label} {i}: {}", n.get(k).map_or("(absent)", String::as_str)))
                .collect();
            format!("{k}: {}", values.join(", "))
        })
        .collect();
    (!lines.is_empty()).then(|| {
        format!(
            "the {label}s do not run the same configuration; every {label} refused to start:\n  {}",
            lines.join("\n  ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(pairs: &[(&str, &str)]) -> FlatConfig {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn differing_keys_are_named_with_every_value() {
        let a = flat(&[("train.lr", "0.1"), ("run.seed", "1"), (RUN_ID_KEY, "a")]);
        let b = flat(&[("train.lr", "0.2"), ("run.seed", "1"), (RUN_ID_KEY, "b")]);
        let msg = differences(&[a.clone(), b], "rank").unwrap();
        assert!(msg.contains("the ranks do not run the same configuration"), "{msg}");
        assert!(msg.contains("train.lr: rank 0: 0.1, rank 1: 0.2"), "{msg}");
        assert!(!msg.contains("run.seed") && !msg.contains(RUN_ID_KEY), "{msg}");
        assert_eq!(differences(&[a.clone(), a], "node"), None);
    }

    #[test]
    fn a_participant_that_cannot_start_is_named_with_why() {
        let a = flat(&[("train.lr", "0.1")]);
        let b = flat(&[(REFUSED, "--out x is not this run's directory")]);
        let msg = refusals(&[a.clone(), b], "node").unwrap();
        assert_eq!(
            msg,
            "a node cannot start, so every node refused to start:\n  node 1: --out x is not this run's directory"
        );
        assert_eq!(refusals(&[a.clone(), a], "node"), None);
    }

    #[test]
    fn a_different_init_file_alone_shows_as_the_run_id() {
        let a = flat(&[("train.lr", "0.1"), (RUN_ID_KEY, "a")]);
        let b = flat(&[("train.lr", "0.1"), (RUN_ID_KEY, "b")]);
        let msg = differences(&[a, b], "node").unwrap();
        assert!(msg.contains(&format!("{RUN_ID_KEY}: node 0: a, node 1: b")), "{msg}");
    }
}
