//! Resuming a run: the run's saved plan goes on. Only keys that extend a run, or that spread its
//! work another way while keeping its global batch, may change, each change recorded with where
//! it came from; anything else (the seed, the model, the optimizer, the content of an input
//! file) is refused, naming the keys.
use std::collections::BTreeMap;

use super::Plan;
use crate::config::resolve::flatten;
use crate::config::schema::WrapStrategy;
use crate::config::ConfigError;

/// Keys a resumed run may change: they extend it without changing what it has done so far.
/// None of the training recipe's keys (issue 14) is among them: the schedule, clipping and
/// precision each change the steps an uninterrupted run would take from the checkpoint on, and
/// early stopping's rule decides which epochs run at all. train.epochs itself is refused with a
/// schedule whose rates depend on the run's length (linear, cosine): the steps already taken
/// followed the old length's curve.
pub const EXTENDS_A_RUN: &[&str] = &["train.epochs", "train.steps"];

/// Keys that spread a run's work over the ranks another way (checkpoints load under any world
/// size and strategy): they may change on resume as long as every optimizer step still covers
/// the same samples, i.e. the global batch (batch × data-parallel copies × accumulate) and the
/// steps per epoch stay.
pub const RESHARDS_A_RUN: &[&str] = &[
    "run.world_size",
    "run.threads_per_rank",
    "wrap.strategy",
    "wrap.bucket_cap_mb",
    "wrap.fsdp.reshard_after_forward",
    "wrap.threads_per_replica",
    "wrap.pipeline.stages",
    "wrap.pipeline.micro_batches",
    "wrap.pipeline.schedule",
    "wrap.pipeline.replicas",
    "wrap.mesh.data",
    "wrap.mesh.tensor",
    "wrap.mesh.pipeline",
    "wrap.mesh.sequence_parallel",
    "train.batch_size",
    "train.global_batch_size",
    "train.accumulate",
];

/// The keys compared on resume, every one with its value (a key a stored configuration leaves out
/// at its stored default, such as run.numerics = "portable", is shown as its value): tracking
/// (TensorBoard, MLflow) is taken from `asked` as it is.
fn leaves(plan: &Plan) -> BTreeMap<String, toml::Value> {
    let mut out = Vec::new();
    let value = crate::config::schema::with_every_key(|| toml::Value::try_from(plan.config.without_tracking()));
    flatten("", &value.expect("a Config serializes"), &mut out);
    out.into_iter().collect()
}

/// The keys [`crate::config::schema::Config::without_tracking`] leaves out of the comparison.
fn is_tracking(key: &str) -> bool {
    key.starts_with("track.")
        || [
            "trace.tensorboard",
            "trace.log_every_steps",
            "run.max_restarts",
            "run.rejoin_timeout_s",
            "checkpoint.async",
        ]
        .contains(&key)
}

/// Every leaf key of the configuration, tracking included.
fn all_leaves(plan: &Plan) -> BTreeMap<String, toml::Value> {
    let mut out = Vec::new();
    flatten("", &toml::Value::try_from(&plan.config).expect("a Config serializes"), &mut out);
    out.into_iter().collect()
}

/// One key whose value differs between a run's plan and another configuration's.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    pub key: String,
    /// Whether the value is an input file's content (compared by digest, never changed on resume).
    pub file: bool,
    /// "0.1 in the run, 0.05 now (--set train.lr=0.05)", or how a file differs.
    pub text: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}`: {}", self.key, self.text)
    }
}

impl Plan {
    /// Every key whose value differs between this plan (a run's) and `now`, each with both values
    /// and where the new one came from; input files by content (the path may be written another
    /// way). Tracking keys are not compared.
    pub fn differences(&self, now: &Plan) -> Vec<Difference> {
        let (old, new) = (leaves(self), leaves(now));
        let from = |key: &str| now.sources.get(key).map(String::as_str).unwrap_or("default").to_owned();
        let show = |v: Option<&toml::Value>| v.map_or("(absent)".to_owned(), |v| v.to_string());
        let mut out = Vec::new();
        for key in old.keys().chain(new.keys().filter(|k| !old.contains_key(*k))) {
            let then: Vec<&super::InputFile> = self.inputs.iter().filter(|f| f.key == *key).collect();
            let text = if then.is_empty() {
                let (was, is) = (old.get(key), new.get(key));
                (was != is).then(|| format!("{} in the run, {} now ({})", show(was), show(is), from(key)))
            } else {
                let is: Vec<&super::InputFile> = now.inputs.iter().filter(|f| f.key == *key).collect();
                if is.is_empty() {
                    Some(format!("the run read {}, now none ({})", then[0].path.display(), from(key)))
                } else if is.len() != then.len() {
                    Some(format!("the run read {} files, now {} ({})", then.len(), is.len(), from(key)))
                } else {
                    then.iter().zip(&is).find(|(a, b)| a.digest != b.digest).map(|(was, is)| {
                        format!(
                            "{} changed since the run started (digest {} then, {} now)",
                            is.path.display(),
                            was.digest,
                            is.digest
                        )
                    })
                }
            };
            if let Some(text) = text {
                out.push(Difference { key: key.clone(), file: !then.is_empty(), text });
            }
        }
        out
    }

    /// `self` (the run directory's plan.json) continued under `asked`: the configuration the user
    /// resumes with (the run's config.toml or another file, the environment and --set).
    pub fn resumed(self, asked: &Plan) -> Result<Plan, ConfigError> {
        let new = leaves(asked);
        let from = |key: &str| asked.sources.get(key).map(String::as_str).unwrap_or("default").to_owned();
        let mut refused = Vec::new();
        let mut changed = Vec::new();
        for d in self.differences(asked) {
            let key = d.key.as_str();
            if d.file {
                refused.push(d.to_string());
            } else if EXTENDS_A_RUN.contains(&key) && super::schedule::Schedule::of(&self).depends_on_length() {
                refused.push(format!(
                    "{d}: the {} learning-rate schedule spans the run's length, so the steps already taken followed \
                     another curve; start a new run to train longer",
                    format!("{:?}", self.config.train.schedule.kind).to_lowercase()
                ));
            } else if EXTENDS_A_RUN.contains(&key) || RESHARDS_A_RUN.contains(&key) {
                changed.push(d.key);
            } else {
                refused.push(d.to_string());
            }
        }
        if !refused.is_empty() {
            return Err(ConfigError::new(format!(
                "run {} cannot resume with another configuration:\n  {}\nOnly {} (to train longer) and {} (keeping the \
                 global batch) may change when resuming; start a new run (without --resume) for the rest. The run's \
                 checkpoints are sound: resume with the run's own values to continue it.",
                self.run_id,
                refused.join("\n  "),
                EXTENDS_A_RUN.join(", "),
                RESHARDS_A_RUN.join(", ")
            )));
        }
        let reshards = changed.iter().any(|k| RESHARDS_A_RUN.contains(&k.as_str()));
        if reshards {
            self.check_reshard(asked, &changed)?;
        }
        let value = crate::config::schema::with_every_key(|| toml::Value::try_from(&self.config));
        let mut value = value.expect("a Config serializes");
        let old = leaves(&self);
        let mut plan = self;
        for key in changed {
            super::saved::set_leaf(&mut value, &key, new.get(&key).cloned())
                .map_err(|e| ConfigError::new(format!("resumed configuration: {e}")))?;
            // The run id stays that of the configuration the run started with.
            plan.started_with.entry(key.clone()).or_insert_with(|| old.get(&key).cloned());
            plan.sources.insert(key.clone(), format!("{} (on resume)", from(&key)));
        }
        plan.config = value.try_into().map_err(|e| ConfigError::new(format!("resumed configuration: {e}")))?;
        (plan.config.trace.tensorboard, plan.config.trace.log_every_steps) =
            (asked.config.trace.tensorboard, asked.config.trace.log_every_steps);
        plan.config.track = asked.config.track.clone();
        let (run, k) = (&asked.config.run, &asked.config.checkpoint);
        (plan.config.run.max_restarts, plan.config.run.rejoin_timeout_s) = (run.max_restarts, run.rejoin_timeout_s);
        plan.config.checkpoint.asynchronous = k.asynchronous;
        // Tracking is taken as asked: so are the sources of its keys (those at their default
        // value included, which the serialized configuration may leave out).
        plan.sources.retain(|key, _| !is_tracking(key));
        plan.sources.extend(asked.sources.iter().filter(|(k, _)| is_tracking(k)).map(|(k, v)| (k.clone(), v.clone())));
        if reshards {
            // What the new layout derives: the shards, each rank's batch, threads and layers.
            plan.layout = asked.layout;
            plan.batch_per_rank = asked.batch_per_rank;
            plan.threads_per_rank = asked.threads_per_rank;
            plan.stages = asked.stages.clone();
            plan.memory = asked.memory;
            // The training state a rank holds under the new layout, not the run's first one.
            plan.memory_by_rank = asked.memory_by_rank.clone();
            plan.state = asked.state.clone();
        }
        Ok(plan)
    }

    /// A resume spreading the run another way (`changed` keys) must keep what one optimizer step
    /// covers: the global batch and the steps per epoch. The message says which keys keep it.
    fn check_reshard(&self, asked: &Plan, changed: &[String]) -> Result<(), ConfigError> {
        let (old, new) = (self.config.wrap.strategy, asked.config.wrap.strategy);
        let alone = |s: WrapStrategy, ws: usize| s == WrapStrategy::None && ws > 1;
        if alone(old, self.world_size())
            || alone(new, asked.world_size())
            || (old != new && (old == WrapStrategy::None || new == WrapStrategy::None))
        {
            return Err(ConfigError::new(format!(
                "run {} cannot resume at {} from {}: wrap.strategy = \"none\" trains each rank's replica alone, so its \
                 checkpoint (rank 0's replica) stands for no other layout; resume with the run's own world size and \
                 strategy",
                self.run_id,
                asked.layout(),
                self.layout()
            )));
        }
        let what = changed
            .iter()
            .filter(|k| RESHARDS_A_RUN.contains(&k.as_str()))
            .map(|k| format!("{k} = {}", value_of(asked, k)))
            .collect::<Vec<_>>()
            .join(", ");
        let (g, g_new) = (self.global_batch(), asked.global_batch());
        if g != g_new {
            return Err(ConfigError::new(format!(
                "run {} cannot resume with {what}: its global batch (samples per optimizer step) was {g} ({}), it would \
                 be {g_new} ({}); every step must cover the same samples: {}",
                self.run_id,
                self.describe_batch(),
                asked.describe_batch(),
                asked.keeping_batch(g)
            )));
        }
        let (e, e_new) = (self.optimizer_steps_per_epoch(), asked.optimizer_steps_per_epoch());
        if !self.data.random_windows() && e != e_new {
            return Err(ConfigError::new(format!(
                "run {} cannot resume with {what}: an epoch was {e} optimizer steps, it would be {e_new} (the last \
                 batches of an epoch divide otherwise); keep train.accumulate at {}",
                self.run_id, self.config.train.accumulate
            )));
        }
        Ok(())
    }

    /// "train.batch_size 16 × 2 ranks" and the like: how the global batch is made.
    fn describe_batch(&self) -> String {
        let c = &self.config;
        let copies = self.layout.world_size;
        let mut s = match c.train.global_batch_size {
            Some(g) if self.layout.split_batch.is_some() => format!("train.global_batch_size {g}"),
            _ => {
                let unit = match (self.is_pipeline(), copies) {
                    (true, 1) => "pipeline copy",
                    (true, _) => "pipeline copies",
                    (false, 1) => "rank",
                    (false, _) => "ranks",
                };
                format!("train.batch_size {} × {copies} {unit}", c.train.batch_size)
            }
        };
        if c.train.accumulate > 1 {
            s += &format!(" × train.accumulate {}", c.train.accumulate);
        }
        s
    }

    /// What keeps a global batch of `g` under this plan's layout.
    fn keeping_batch(&self, g: usize) -> String {
        let c = &self.config;
        let a = c.train.accumulate;
        if self.layout.split_batch.is_some() {
            let w = self.world_size();
            return if g.is_multiple_of(a) && (g / a).is_multiple_of(w) {
                format!("set train.global_batch_size = {}", g / a)
            } else {
                format!(
                    "train.global_batch_size fixes the global batch, and {} ranks do not divide {}: choose a world size \
                     that divides it",
                    w,
                    g / a.max(1)
                )
            };
        }
        let copies = self.layout.world_size;
        if g.is_multiple_of(copies * a) {
            return format!("set train.batch_size = {}", g / (copies * a));
        }
        if g.is_multiple_of(copies * c.train.batch_size) {
            return format!("set train.accumulate = {}", g / (copies * c.train.batch_size));
        }
        format!("no batch size gives {g} over {copies} data-parallel copies: choose a world size that divides {g}")
    }
}

impl Plan {
    /// Refuses, before `asked` is planned, a resume at a world size that does not split the
    /// run's fixed global batch (`train.global_batch_size`): the plan's own message would advise
    /// another global batch, which a resume cannot take.
    pub fn check_resumable_world_size(&self, asked: &crate::config::schema::Config) -> Result<(), ConfigError> {
        let (Some(g), Some(g_new)) = (self.config.train.global_batch_size, asked.train.global_batch_size) else {
            return Ok(());
        };
        let w = asked.run.world_size;
        if g != g_new || w == 0 || g.is_multiple_of(w) || asked.shard.strategy != self.config.shard.strategy {
            return Ok(());
        }
        let mut fits: Vec<String> = (1..=g).filter(|d| g % d == 0).take(9).map(|d| d.to_string()).collect();
        if fits.len() == 9 {
            fits[8] = "...".into();
        }
        Err(ConfigError::new(format!(
            "run {} cannot resume at world size {w}: its train.global_batch_size = {g} fixes the samples of every \
             optimizer step, and {w} ranks do not split {g} evenly; resume at a world size that divides it ({})",
            self.run_id,
            fits.join(", ")
        )))
    }
}

/// `key`'s value in `plan`'s configuration, as TOML.
fn value_of(plan: &Plan, key: &str) -> String {
    all_leaves(plan).get(key).map_or("(absent)".to_owned(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys docs/checkpoints.md says a resume may change (`wrap.fsdp.*` standing for every
    /// key of its table), as the paragraph that lists them names them.
    fn documented() -> Vec<String> {
        let page = include_str!("../../docs/checkpoints.md");
        let start = page.find("The keys that may change on resume").expect("the paragraph listing the keys");
        let paragraph = &page[start..start + page[start..].find("\n\n").expect("the paragraph's end")];
        let all: Vec<String> = crate::config::reference::keys().into_iter().map(|k| k.path).collect();
        let mut keys = Vec::new();
        for quoted in paragraph.split('`').skip(1).step_by(2) {
            match quoted.strip_suffix(".*") {
                Some(table) => keys.extend(all.iter().filter(|k| k.starts_with(&format!("{table}."))).cloned()),
                None => keys.push(quoted.to_owned()),
            }
        }
        keys.sort();
        keys
    }

    #[test]
    fn the_docs_list_exactly_the_keys_a_resume_may_change() {
        let mut listed: Vec<String> = EXTENDS_A_RUN.iter().chain(RESHARDS_A_RUN).map(|k| k.to_string()).collect();
        listed.sort();
        assert_eq!(documented(), listed);
    }

    #[test]
    fn every_key_a_resume_may_change_can_be_set_in_a_serialized_configuration() {
        // Left out at its default, as plan.json leaves tables out: the tables on its way are made.
        let config = crate::config::schema::Config::default();
        for key in EXTENDS_A_RUN.iter().chain(RESHARDS_A_RUN) {
            let mut value = toml::Value::try_from(&config).unwrap();
            let leaf = crate::config::schema::with_every_key(|| toml::Value::try_from(&config).unwrap());
            let mut all = Vec::new();
            flatten("", &leaf, &mut all);
            let now = all.into_iter().find(|(k, _)| k == key).map(|(_, v)| v);
            if let Some(v) = now.clone() {
                super::super::saved::set_leaf(&mut value, key, Some(v)).unwrap_or_else(|e| panic!("{key}: {e}"));
                let back: crate::config::schema::Config = value.try_into().unwrap_or_else(|e| panic!("{key}: {e}"));
                assert_eq!(back, config, "{key}");
            }
        }
        let mut value = toml::Value::try_from(&config).unwrap();
        super::super::saved::set_leaf(&mut value, "wrap.fsdp.reshard_after_forward", Some(false.into())).unwrap();
        let back: crate::config::schema::Config = value.try_into().unwrap();
        assert!(!back.wrap.fsdp.reshard_after_forward);
        assert!(super::super::saved::set_leaf(&mut toml::Value::Integer(1), "a.b", None).is_err());
    }
}
