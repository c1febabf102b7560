//! TensorBoard event files: `RUN_DIR/tensorboard/events.out.tfevents.<time>.<host>.<pid>.0`,
//! written by rank 0 as the run goes (each event written through at once, so `tensorboard
//! --logdir` shows a run while it trains): scalars, the resolved configuration as text (the text
//! plugin) and the hparams of the run (the hparams plugin's session start and end).
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;

use super::event::*;

pub struct EventWriter {
    file: File,
    pub path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl EventWriter {
    /// A new event file in `run_dir/tensorboard/` (a resumed run adds one beside the first).
    pub fn create(run_dir: &Path) -> std::io::Result<EventWriter> {
        let dir = run_dir.join(crate::rundir::TENSORBOARD);
        std::fs::create_dir_all(&dir)?;
        let host = crate::rundir::manifest::hostname();
        let name = format!("events.out.tfevents.{:010}.{host}.{}.0", now() as u64, std::process::id());
        let path = dir.join(name);
        let file = File::options().create_new(true).write(true).open(&path)?;
        let mut w = EventWriter { file, path };
        w.write(Event { wall_time: now(), step: 0, file_version: Some("brain.Event:2".into()), summary: None })?;
        Ok(w)
    }

    fn write(&mut self, event: Event) -> std::io::Result<()> {
        // One write per record on an unbuffered file: a reader never waits for a flush.
        self.file.write_all(&record(&event))
    }

    fn summary(&mut self, step: u64, value: Vec<SummaryValue>) -> std::io::Result<()> {
        let summary = Some(Summary { value });
        self.write(Event { wall_time: now(), step: step as i64, file_version: None, summary })
    }

    /// Scalars at `step`, as TensorBoard keeps them: float32.
    pub fn scalars(&mut self, step: u64, scalars: &[(String, f64)]) -> std::io::Result<()> {
        let value = scalars
            .iter()
            .map(|(tag, v)| SummaryValue { tag: tag.clone(), simple_value: Some(*v as f32), ..Default::default() })
            .collect();
        self.summary(step, value)
    }

    /// A text summary (a string tensor for the text plugin, which renders it as markdown).
    pub fn text(&mut self, tag: &str, text: &str) -> std::io::Result<()> {
        let value = SummaryValue {
            tag: tag.into(),
            tensor: Some(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape::default()),
                string_val: vec![text.as_bytes().to_vec()],
            }),
            metadata: Some(plugin("text", Vec::new())),
            ..Default::default()
        };
        self.summary(0, vec![value])
    }

    /// The hparams plugin's session start: this run's hyperparameters, in `group` (the run's name).
    pub fn hparams_start(&mut self, hparams: BTreeMap<String, HParamValue>, group: &str) -> std::io::Result<()> {
        let start = SessionStartInfo { hparams, group_name: group.into(), start_time_secs: now() };
        self.hparams(
            "_hparams_/session_start_info",
            HParamsPluginData { session_start_info: Some(start), ..Default::default() },
        )
    }

    /// The hparams plugin's session end: the run succeeded or failed.
    pub fn hparams_end(&mut self, succeeded: bool) -> std::io::Result<()> {
        let end = SessionEndInfo { status: if succeeded { 1 } else { 2 }, end_time_secs: now() };
        self.hparams(
            "_hparams_/session_end_info",
            HParamsPluginData { session_end_info: Some(end), ..Default::default() },
        )
    }

    fn hparams(&mut self, tag: &str, data: HParamsPluginData) -> std::io::Result<()> {
        // The plugin's own writer puts an empty float tensor beside its metadata.
        let null = TensorProto {
            dtype: DT_FLOAT,
            tensor_shape: Some(TensorShape { dim: vec![Dim { size: 0 }] }),
            string_val: Vec::new(),
        };
        let value = SummaryValue {
            tag: tag.into(),
            tensor: Some(null),
            metadata: Some(plugin("hparams", data.encode_to_vec())),
            ..Default::default()
        };
        self.summary(0, vec![value])
    }
}

fn plugin(name: &str, content: Vec<u8>) -> SummaryMetadata {
    SummaryMetadata {
        plugin_data: Some(PluginData { plugin_name: name.into(), content }),
        data_class: DATA_CLASS_TENSOR,
    }
}

/// A configuration value as an hparam: numbers, strings and bools as they are, lists as text.
pub fn hparam(v: &toml::Value) -> HParamValue {
    let kind = match v {
        toml::Value::Integer(i) => Kind::Number(*i as f64),
        toml::Value::Float(f) => Kind::Number(*f),
        toml::Value::Boolean(b) => Kind::Bool(*b),
        toml::Value::String(s) => Kind::Text(s.clone()),
        other => Kind::Text(other.to_string()),
    };
    HParamValue { kind: Some(kind) }
}
