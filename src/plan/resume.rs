//! Resuming a run: the run's saved plan goes on. Only keys that extend a run may change, each
//! change recorded with where it came from; anything else (the seed, the model, the optimizer,
//! the strategy, the content of an input file) is refused, naming the keys.
use std::collections::BTreeMap;

use super::Plan;
use crate::config::resolve::flatten;
use crate::config::ConfigError;

/// Keys a resumed run may change: they extend it without changing what it has done so far.
/// None of the training recipe's keys (issue 14) is among them: the schedule, accumulation,
/// clipping and precision each change the steps an uninterrupted run would take from the
/// checkpoint on, and early stopping's rule decides which epochs run at all. train.epochs itself
/// is refused with a schedule whose rates depend on the run's length (linear, cosine): the steps
/// already taken followed the old length's curve.
pub const EXTENDS_A_RUN: &[&str] = &["train.epochs", "train.steps"];

/// The keys compared on resume, every one with its value (a key a stored configuration leaves out
/// at its stored default, such as run.numerics = "portable", is shown as its value): tracking
/// (TensorBoard, MLflow) is taken from `asked` as it is.
fn leaves(plan: &Plan) -> BTreeMap<String, toml::Value> {
    let mut out = Vec::new();
    let value = crate::config::schema::with_every_key(|| toml::Value::try_from(plan.config.without_tracking()));
    flatten("", &value.expect("a Config serializes"), &mut out);
    out.into_iter().collect()
}

impl Plan {
    /// `self` (the run directory's plan.json) continued under `asked`: the configuration the user
    /// resumes with (the run's config.toml or another file, the environment and --set).
    pub fn resumed(self, asked: &Plan) -> Result<Plan, ConfigError> {
        let (old, new) = (leaves(&self), leaves(asked));
        let from = |key: &str| asked.sources.get(key).map(String::as_str).unwrap_or("default").to_owned();
        let mut refused = Vec::new();
        let mut extended = Vec::new();
        for key in old.keys().chain(new.keys().filter(|k| !old.contains_key(*k))) {
            // Files are compared by content: the path may be written another way.
            let then: Vec<&super::InputFile> = self.inputs.iter().filter(|f| f.key == *key).collect();
            if !then.is_empty() {
                let now: Vec<&super::InputFile> = asked.inputs.iter().filter(|f| f.key == *key).collect();
                if now.is_empty() {
                    refused.push(format!("`{key}`: the run read {}, now none ({})", then[0].path.display(), from(key)));
                } else if now.len() != then.len() {
                    refused.push(format!(
                        "`{key}`: the run read {} files, now {} ({})",
                        then.len(),
                        now.len(),
                        from(key)
                    ));
                } else if let Some((was, is)) = then.iter().zip(&now).find(|(a, b)| a.digest != b.digest) {
                    refused.push(format!(
                        "`{key}`: {} changed since the run started (digest {} then, {} now)",
                        is.path.display(),
                        was.digest,
                        is.digest
                    ));
                }
                continue;
            }
            let (was, now) = (old.get(key), new.get(key));
            if was == now {
                continue;
            }
            if EXTENDS_A_RUN.contains(&key.as_str()) {
                let schedule = super::schedule::Schedule::of(&self);
                if schedule.depends_on_length() {
                    refused.push(format!(
                        "`{key}`: {} in the run, {} now ({}): the {} learning-rate schedule spans the run's length, \
                         so the steps already taken followed another curve; start a new run to train longer",
                        old.get(key).map_or("(absent)".to_owned(), |v| v.to_string()),
                        new.get(key).map_or("(absent)".to_owned(), |v| v.to_string()),
                        from(key),
                        format!("{:?}", self.config.train.schedule.kind).to_lowercase()
                    ));
                    continue;
                }
                extended.push(key.clone());
                continue;
            }
            let show = |v: Option<&toml::Value>| v.map_or("(absent)".to_owned(), |v| v.to_string());
            refused.push(format!("`{key}`: {} in the run, {} now ({})", show(was), show(now), from(key)));
        }
        if !refused.is_empty() {
            return Err(ConfigError::new(format!(
                "run {} cannot resume with another configuration:\n  {}\nOnly {} may change when resuming; start a new \
                 run (without --resume) for the rest.",
                self.run_id,
                refused.join("\n  "),
                EXTENDS_A_RUN.join(", ")
            )));
        }
        let mut value = toml::Value::try_from(&self.config).expect("a Config serializes");
        let mut plan = self;
        for key in extended {
            let mut table = &mut value;
            let parts: Vec<&str> = key.split('.').collect();
            for part in &parts[..parts.len() - 1] {
                table = table.get_mut(*part).expect("a key of the configuration");
            }
            table[parts[parts.len() - 1]] = new[&key].clone();
            // The run id stays that of the configuration the run started with.
            plan.started_with.entry(key.clone()).or_insert_with(|| old.get(&key).cloned());
            plan.sources.insert(key.clone(), format!("{} (on resume)", from(&key)));
        }
        plan.config = value.try_into().map_err(|e| ConfigError::new(format!("resumed configuration: {e}")))?;
        (plan.config.trace.tensorboard, plan.config.trace.log_every_steps) =
            (asked.config.trace.tensorboard, asked.config.trace.log_every_steps);
        plan.config.track = asked.config.track.clone();
        Ok(plan)
    }
}
