//! A saved plan (the run directory's `plan.json`) is read back as untrusted input: ranks,
//! `--resume` and `runner predict` load it, and an edited or damaged one must be refused, never
//! run. Its run id must match the digest of its configuration and input files (as the run
//! started: keys a resume extended are recorded with their first values), the configuration
//! passes the plan's own checks of its values, and every derived field (the layout, the batch,
//! the model's layers, the stages) must be what that configuration gives.
use std::collections::BTreeMap;

use super::Plan;

/// Keys whose values a resume changed, with their values when the run started (`None`: absent).
pub type StartedWith = BTreeMap<String, Option<toml::Value>>;

impl Plan {
    /// The checks above; the message names the first field that does not hold.
    pub(super) fn check_saved(&self) -> Result<(), String> {
        let advice = "the plan was edited or damaged; restore it or start a new run";
        let id = self.started_run_id()?;
        if id != self.run_id {
            return Err(format!(
                "its run id {} does not match the digest of its configuration and input files ({id}): {advice}",
                self.run_id
            ));
        }
        let c = &self.config;
        let mut problems = Vec::new();
        let mut bad = |key: &str, msg: String| problems.push(format!("`{key}`: {msg}"));
        super::values::run_values(c, super::Machine::This, &mut bad);
        super::recipe::train_values(c, &self.sources, &mut bad);
        let sized = crate::limits::sizes(c, &self.data, &mut bad) && crate::model::check(&c.wrap.model, &mut bad);
        if !problems.is_empty() {
            return Err(format!("its configuration is invalid ({}): {advice}", problems.join("; ")));
        }
        let mismatch = |field: &str, saved: String, derived: String| {
            Err(format!("`{field}` is {saved} but its configuration gives {derived}: {advice}"))
        };
        let layout = super::data::shard_layout(c, &self.data, &mut |_: &str, _| {});
        if layout.as_ref() != Some(&self.layout) {
            return mismatch("layout", format!("{:?}", self.layout), format!("{layout:?}"));
        }
        let batch = self.layout.split_batch.unwrap_or(c.train.batch_size);
        if self.batch_per_rank != batch || batch == 0 {
            return mismatch("batch_per_rank", self.batch_per_rank.to_string(), batch.to_string());
        }
        if !(1..=1024).contains(&self.threads_per_rank) {
            return mismatch("threads_per_rank", self.threads_per_rank.to_string(), "1 to 1024".into());
        }
        if !sized {
            return Err(format!("its data or model is out of bounds: {advice}"));
        }
        let layers = crate::model::layer_parameters(self.model().as_ref());
        if layers != self.layer_parameters || self.parameters != layers.iter().sum::<usize>() {
            let saved = format!("{:?} ({} in all)", self.layer_parameters, self.parameters);
            return mismatch("layer_parameters", saved, format!("{layers:?}"));
        }
        let stages = super::stages::of_ranks(c, &self.sources, &layers, &mut |_: &str, _| {});
        if stages.as_ref() != Some(&self.stages) {
            return mismatch("stages", format!("{:?}", self.stages), format!("{stages:?}"));
        }
        Ok(())
    }

    /// The run id of the configuration as the run started (extended keys at their first values).
    fn started_run_id(&self) -> Result<String, String> {
        let mut config = self.config.clone();
        if !self.started_with.is_empty() {
            let mut value = toml::Value::try_from(&config).map_err(|e| e.to_string())?;
            for (key, first) in &self.started_with {
                set_leaf(&mut value, key, first.clone())?;
            }
            config = value.try_into().map_err(|e| format!("its first configuration cannot be read ({e})"))?;
        }
        Ok(super::input::run_id(&config, &self.inputs))
    }
}

/// Sets the dotted `key` of a configuration's value to `to` (`None`: removes it), making the
/// tables on its way where the serialized configuration left them out (a table at its default).
pub(super) fn set_leaf(value: &mut toml::Value, key: &str, to: Option<toml::Value>) -> Result<(), String> {
    let parts: Vec<&str> = key.split('.').collect();
    let (last, path) = parts.split_last().filter(|(l, _)| !l.is_empty()).ok_or("an empty key")?;
    let mut table = value.as_table_mut().ok_or("a configuration that is not a table")?;
    for part in path {
        let next = table.entry(part.to_string()).or_insert_with(|| toml::Value::Table(Default::default()));
        table = next.as_table_mut().ok_or(format!("`{key}` is not a key of the configuration"))?;
    }
    match to {
        Some(v) => drop(table.insert(last.to_string(), v)),
        None => drop(table.remove(*last)),
    }
    Ok(())
}
