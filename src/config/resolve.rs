//! Layering: defaults < the bases a pipeline file extends < the file < environment
//! (`RUNNER_SECTION__KEY`) < `--set key=value`, with errors that name where the bad value came
//! from and the closest valid key.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::de::DeserializeOwned;

use super::extends::{FileKind, Layers};
use super::schema::Config;
use super::ConfigError;

/// A resolved configuration and, per dotted key, where its value came from.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub config: Config,
    pub sources: BTreeMap<String, String>,
    pub file: PathBuf,
    /// The files `file` extends, nearest first.
    pub extends: Vec<PathBuf>,
}

/// The labels that an experiment's overrides carry into the resolved configuration (and
/// config.toml): the sources of the values a sweep sets.
pub const SET_LABEL: &str = "experiment [set]";
pub const AXIS_LABEL: &str = "sweep axis";
pub const SCALING_LABEL: &str = "sweep [scaling]";

/// One `--set key=value`, with the label its source gets (`--set`, `sweep axis`, ...).
#[derive(Debug, Clone)]
pub struct Override {
    pub label: String,
    pub text: String,
}

impl Override {
    pub fn set(text: &str) -> Override {
        Override { label: "--set".into(), text: text.into() }
    }
}

pub fn resolve(file: &Path, overrides: &[Override]) -> Result<Resolved, ConfigError> {
    let layers = Layers::read(file, FileKind::Pipeline, "the pipeline file")?;
    parse_layers::<Config>(&layers)?;
    let merged = toml::to_string(&layers.merged()).map_err(|e| ConfigError::new(format!("{}: {e}", file.display())))?;
    let mut figment = Figment::new()
        .merge(SetArg::stored_differently())
        .merge(Toml::string(&merged))
        // Every config key is `section.key`: only variables with `__` are meant for us, which
        // leaves alone the RUNNER_* that CI systems set (RUNNER_OS, RUNNER_TEMP, ...).
        .merge(Env::prefixed("RUNNER_").filter(|k| k.as_str().contains("__")).split("__"));
    for o in overrides {
        figment = figment.merge(SetArg::parse(o)?);
    }
    let config: Config = figment.extract().map_err(|e| figment_error(e, &layers))?;
    let sources = sources(&figment, &config, &layers);
    Ok(Resolved { config, sources, file: file.to_owned(), extends: layers.bases() })
}

/// Deserializes a file and its bases merged; errors name the file and line that set the key
/// (a file alone: its own line and column).
pub fn parse_layers<T: DeserializeOwned>(layers: &Layers) -> Result<T, ConfigError> {
    if let [only] = &layers.0[..] {
        return parse_strict(&only.text, &only.file.display().to_string());
    }
    for l in &layers.0 {
        let origin = l.file.display().to_string();
        toml::from_str::<toml::Table>(&l.text).map_err(|e| toml_error(&e, None, &l.text, &origin))?;
    }
    let text = toml::to_string(&layers.merged()).map_err(|e| ConfigError::new(e.to_string()))?;
    let de = toml::Deserializer::parse(&text).map_err(|e| ConfigError::new(e.to_string()))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let mut key = path.as_str();
        let at = loop {
            match layers.origin(key) {
                Some((f, Some(line))) => break format!("{}:{line}", f.display()),
                Some((f, None)) => break f.display().to_string(),
                None => match key.rsplit_once('.') {
                    Some((head, _)) => key = head,
                    None => break layers.file().file.display().to_string(),
                },
            }
        };
        let path = Some(path).filter(|p| p != ".");
        ConfigError::new(format!("{at}: {}", explain(e.inner().message(), path.as_deref())))
    })
}

/// Deserializes `text` alone, so that errors carry the file's line and column.
pub fn parse_strict<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, ConfigError> {
    let de = toml::Deserializer::parse(text).map_err(|e| toml_error(&e, None, text, origin))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        toml_error(e.inner(), Some(path), text, origin)
    })
}

fn toml_error(e: &toml::de::Error, path: Option<String>, text: &str, origin: &str) -> ConfigError {
    let at = match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            let source = text.lines().nth(line - 1).unwrap_or("");
            (format!("{origin}:{line}:{col}"), format!("\n  {line} | {source}"))
        }
        None => (origin.to_owned(), String::new()),
    };
    let (at, excerpt) = at;
    let path = path.filter(|p| p != ".");
    ConfigError::new(format!("{at}: {}{excerpt}", explain(e.message(), path.as_deref())))
}

/// Rewrites serde's messages about unknown keys and variants into ones that name the full key
/// and the closest valid choice.
fn explain(message: &str, path: Option<&str>) -> String {
    let quoted: Vec<&str> = message.split('`').skip(1).step_by(2).collect();
    let full = |name: &str| match path {
        // serde_path_to_error's path ends at the unknown key itself.
        Some(p) if p.ends_with(name) => p.to_owned(),
        Some(p) => format!("{p}.{name}"),
        None => name.to_owned(),
    };
    if message.starts_with("unknown field") {
        let (field, valid) = quoted.split_first().map(|(f, v)| (*f, v.to_vec())).unwrap_or(("?", vec![]));
        let key = full(field);
        let section = key.rsplit_once('.').map(|(s, _)| s);
        let prefix = section.map(|s| format!("{s}.")).unwrap_or_default();
        let mut out = format!("unknown key `{key}`");
        if let Some(best) = closest(field, &valid) {
            out += &format!("; did you mean `{prefix}{best}`?");
        }
        let list = valid.iter().map(|v| format!("{prefix}{v}")).collect::<Vec<_>>().join(", ");
        let place = section.map(|s| format!("[{s}]")).unwrap_or_else(|| "the file".into());
        out + &format!(" (valid keys in {place}: {list})")
    } else if message.starts_with("unknown variant") {
        let (value, valid) = quoted.split_first().map(|(f, v)| (*f, v.to_vec())).unwrap_or(("?", vec![]));
        let key = path.unwrap_or("value");
        let mut out = format!("`{key}` cannot be \"{value}\"");
        if let Some(best) = closest(value, &valid) {
            out += &format!("; did you mean \"{best}\"?");
        }
        out + &format!(" (one of: {})", valid.iter().map(|v| format!("\"{v}\"")).collect::<Vec<_>>().join(", "))
    } else {
        match path {
            Some(p) => format!("`{p}`: {message}"),
            None => message.to_owned(),
        }
    }
}

/// The valid name nearest to `given`, if it is near enough to be a likely typo.
pub fn closest<'a>(given: &str, valid: &[&'a str]) -> Option<&'a str> {
    valid
        .iter()
        .map(|v| (strsim::damerau_levenshtein(given, v), *v))
        .filter(|(d, v)| *d <= 2.max(v.len() / 3) || v.starts_with(given) || given.starts_with(v))
        .min_by_key(|(d, _)| *d)
        .map(|(_, v)| v)
}

fn figment_error(e: figment::Error, layers: &Layers) -> ConfigError {
    let messages: Vec<String> = e
        .into_iter()
        .map(|e| {
            let name = e.metadata.as_ref().map(|m| m.name.to_string()).unwrap_or_default();
            let mut path = e.path.clone();
            let message = match &e.kind {
                figment::error::Kind::UnknownField(f, expected) => {
                    if path.last() != Some(f) {
                        path.push(f.clone());
                    }
                    let valid = expected.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(", ");
                    format!("unknown field `{f}`, expected one of {valid}")
                }
                // figment's own wording ("expected `a` or `b`") does not keep the names quoted
                // one by one, as `explain` reads them.
                figment::error::Kind::UnknownVariant(v, expected) => {
                    let valid = expected.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(", ");
                    format!("unknown variant `{v}`, expected one of {valid}")
                }
                kind => kind.to_string(),
            };
            let origin = if name.contains("environment") {
                format!("environment variable RUNNER_{}", path.join("__").to_uppercase())
            } else if name.contains("TOML") {
                match layers.origin(&path.join(".")) {
                    Some((file, Some(line))) => format!("{}:{line}", file.display()),
                    Some((file, None)) => file.display().to_string(),
                    None => layers.file().file.display().to_string(),
                }
            } else {
                name // an override: "--set train.lr=0.1", a sweep axis, ...
            };
            let key = path.join(".");
            format!("{origin}: {}", explain(&message, Some(key.as_str()).filter(|k| !k.is_empty())))
        })
        .collect();
    ConfigError::new(messages.join("\n"))
}

/// Where each leaf value of `config` came from.
fn sources(figment: &Figment, config: &Config, layers: &Layers) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let value = toml::Value::try_from(config).expect("a Config serializes");
    let mut leaves = Vec::new();
    flatten("", &value, &mut leaves);
    for (key, _) in leaves {
        let source = match figment.find_metadata(&key) {
            Some(m) if m.name.contains("environment") => {
                format!("env RUNNER_{}", key.replace('.', "__").to_uppercase())
            }
            Some(m) if m.name.contains("TOML") => {
                layers.source(&key).unwrap_or_else(|| format!("file {}", layers.file().file.display()))
            }
            Some(m) => m.name.to_string(),
            None => "default".into(),
        };
        out.insert(key, source);
    }
    out
}

/// Dotted keys and values of the leaves (non-table values) of `v`.
pub fn flatten(prefix: &str, v: &toml::Value, out: &mut Vec<(String, toml::Value)>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        leaf => out.push((prefix.to_owned(), leaf.clone())),
    }
}

/// A `--set key=value` as a figment provider; the value is read as TOML (so `0.05`, `[64, 64]`
/// and `true` keep their types), or taken as a string when it is not valid TOML.
struct SetArg {
    label: String,
    dict: Dict,
}

impl SetArg {
    fn parse(o: &Override) -> Result<SetArg, ConfigError> {
        let label = format!("{} {}", o.label, o.text);
        let (key, raw) = o
            .text
            .split_once('=')
            .filter(|(k, _)| !k.trim().is_empty())
            .ok_or_else(|| ConfigError::new(format!("{label}: expected KEY=VALUE, e.g. train.lr=0.05")))?;
        let key = key.trim();
        let raw = raw.trim();
        let parsed: toml::Value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(raw.to_owned()));
        let mut value = Value::serialize(&parsed).map_err(|e| ConfigError::new(format!("{label}: {e}")))?;
        for part in key.rsplit('.') {
            let mut dict = Dict::new();
            dict.insert(part.to_owned(), value);
            value = Value::from(dict);
        }
        let dict = value.into_dict().expect("built as a dict");
        Ok(SetArg { label, dict })
    }
}

impl SetArg {
    /// The defaults that a stored configuration without the key does not mean (schema.rs): a
    /// pipeline file without run.numerics computes natively, a plan.json without it portably.
    fn stored_differently() -> SetArg {
        let native = toml::Value::try_from(super::schema::CpuNumerics::default()).expect("an enum serializes");
        let text = format!("run.numerics={native}");
        let o = Override { label: String::new(), text };
        SetArg { label: "default".into(), ..SetArg::parse(&o).expect("a valid key and value") }
    }
}

impl Provider for SetArg {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.label.clone())
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}
