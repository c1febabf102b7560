//! Layering: defaults < the bases a pipeline file extends < the file < environment
//! (`RUNNER_SECTION__KEY`) < `--set key=value`, with errors that name where the bad value came
//! from and the closest valid key. `--set ~key` (Hydra's spelling) removes a key from every layer
//! below it, so that it takes its default.
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
    let mut table = layers.merged();
    // `--set ~key` removes the key from the files, the environment and the overrides before it.
    let mut removed: Vec<String> = Vec::new();
    let mut sets: Vec<SetArg> = Vec::new();
    for o in overrides {
        match o.text.trim().strip_prefix('~') {
            Some(key) => {
                let key = removal_key(o, key)?;
                let from_file = super::extends::remove(&mut table, &key);
                let from_env = !env_vars_setting(&key).is_empty();
                let before = sets.len();
                sets.retain(|s| !under(&s.key, &key));
                if !(from_file || from_env || sets.len() < before) {
                    return Err(ConfigError::new(format!(
                        "{} {}: no layer sets `{key}` (the file, the files it extends, RUNNER_ variables or an \
                         earlier --set): there is nothing to remove",
                        o.label, o.text
                    )));
                }
                removed.push(key);
            }
            None => sets.push(SetArg::parse(o)?),
        }
    }
    let merged = toml::to_string(&table).map_err(|e| ConfigError::new(format!("{}: {e}", file.display())))?;
    let mut figment = Figment::new()
        .merge(SetArg::stored_differently())
        .merge(Toml::string(&merged))
        // Every config key is `section.key`: only variables with `__` are meant for us, which
        // leaves alone the RUNNER_* that CI systems set (RUNNER_OS, RUNNER_TEMP, ...).
        .merge(
            Env::prefixed("RUNNER_")
                .filter(move |k| {
                    let dotted = k.as_str().to_ascii_lowercase().replace("__", ".");
                    k.as_str().contains("__") && !removed.iter().any(|r| under(&dotted, r))
                })
                .split("__"),
        );
    for set in sets {
        figment = figment.merge(set);
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
        // An unknown key is named by the message, below the path: the file that sets it is the
        // one to name (a base's typo is the base's, at its line, not at the child's table header).
        let unknown = e.inner().message().strip_prefix("unknown field `").and_then(|m| m.split('`').next());
        let full = match (unknown, path.as_str()) {
            (Some(field), ".") => field.to_owned(),
            (Some(field), p) if !p.ends_with(field) => format!("{p}.{field}"),
            _ => path.clone(),
        };
        let mut key = full.as_str();
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
                format!("environment variable {}", env_vars_under(&path).join(", "))
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

/// The `RUNNER_..__..` variables that set `path` or a key below it (`RUNNER_FOO__BAR` for an
/// unknown section `foo`), as the environment spells them.
fn env_vars_under(path: &[String]) -> Vec<String> {
    let mut names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| {
            let lower = k.to_ascii_lowercase();
            let Some(rest) = lower.strip_prefix("runner_").filter(|r| r.contains("__")) else { return false };
            let parts: Vec<&str> = rest.split("__").collect();
            parts.len() >= path.len() && parts.iter().zip(path).all(|(a, b)| *a == b.to_lowercase())
        })
        .collect();
    names.sort();
    if names.is_empty() {
        names.push(format!("RUNNER_{}", path.join("__").to_uppercase()));
    }
    names
}

/// The key of a `~key` override, checked: a dotted name without a value.
fn removal_key(o: &Override, key: &str) -> Result<String, ConfigError> {
    let key = key.trim();
    let valid = !key.is_empty()
        && !key.contains('=')
        && key.split('.').all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    if valid {
        Ok(key.to_owned())
    } else {
        Err(ConfigError::new(format!(
            "{} {}: `~KEY` removes a key (e.g. --set '~train.epochs') and takes no value",
            o.label, o.text
        )))
    }
}

/// Whether dotted key `key` is `prefix` or lies below it.
fn under(key: &str, prefix: &str) -> bool {
    key == prefix || key.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('.'))
}

/// The `RUNNER_..__..` variables that set `dotted` or a key below it.
fn env_vars_setting(dotted: &str) -> Vec<String> {
    std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| {
            let lower = k.to_ascii_lowercase();
            lower.strip_prefix("runner_").is_some_and(|r| r.contains("__") && under(&r.replace("__", "."), dotted))
        })
        .collect()
}

/// Where each leaf value of `config` came from.
fn sources(figment: &Figment, config: &Config, layers: &Layers) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    // Every key, those that hold their default included: one given as its default value still
    // came from where it was given.
    let value = super::schema::with_every_key(|| toml::Value::try_from(config)).expect("a Config serializes");
    let mut leaves = Vec::new();
    flatten("", &value, &mut leaves);
    let defaults: BTreeMap<String, toml::Value> = {
        let value = super::schema::with_every_key(|| toml::Value::try_from(Config::default())).expect("serializes");
        let mut leaves = Vec::new();
        flatten("", &value, &mut leaves);
        leaves.into_iter().collect()
    };
    for (key, value) in leaves {
        let source = match figment.find_metadata(&key) {
            Some(m) if m.name.contains("environment") => {
                format!("env RUNNER_{}", key.replace('.', "__").to_uppercase())
            }
            // A run's config.toml read back keeps its provenance: a value it marks `# default`
            // (and that is the default) was set by no one.
            Some(m) if m.name.contains("TOML") && layers.says_default(&key) && defaults.get(&key) == Some(&value) => {
                "default".into()
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

/// `text` with the password of every URL's credentials (`http://user:password@host`) replaced by
/// `***`: what names a value's source (`--set track.mlflow=...`) never shows one.
pub fn redact_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out += head;
        let end = tail.find(|c: char| "/?#\"' ".contains(c)).unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rsplit_once('@') {
            Some((user, host)) => {
                out += user.split(':').next().unwrap_or_default();
                out += ":***@";
                out += host;
            }
            None => out += authority,
        }
        rest = &tail[end..];
    }
    out + rest
}

/// A `--set key=value` as a figment provider; the value is read as TOML (so `0.05`, `[64, 64]`
/// and `true` keep their types), or taken as a string when it is not valid TOML.
struct SetArg {
    label: String,
    /// The dotted key it sets.
    key: String,
    dict: Dict,
}

impl SetArg {
    fn parse(o: &Override) -> Result<SetArg, ConfigError> {
        let label = redact_credentials(&format!("{} {}", o.label, o.text));
        let (key, raw) = o
            .text
            .split_once('=')
            .filter(|(k, _)| !k.trim().is_empty())
            .ok_or_else(|| ConfigError::new(format!("{label}: expected KEY=VALUE, e.g. train.lr=0.05")))?;
        let key = key.trim();
        let raw = raw.trim();
        let parsed = toml::from_str::<toml::Table>(&format!("v = {raw}")).ok().and_then(|mut t| t.remove("v"));
        // A number TOML cannot hold (1e400) is not a string: say so rather than "found a string".
        if parsed.is_none() && raw.parse::<f64>().is_ok_and(f64::is_infinite) {
            return Err(ConfigError::new(format!(
                "{label}: {raw} is beyond the range of a float (about ±1.8e308); give a finite number"
            )));
        }
        let parsed = parsed.unwrap_or_else(|| toml::Value::String(raw.to_owned()));
        let mut value = Value::serialize(&parsed).map_err(|e| ConfigError::new(format!("{label}: {e}")))?;
        for part in key.rsplit('.') {
            let mut dict = Dict::new();
            dict.insert(part.to_owned(), value);
            value = Value::from(dict);
        }
        let dict = value.into_dict().expect("built as a dict");
        Ok(SetArg { label, key: key.to_owned(), dict })
    }
}

impl SetArg {
    /// The defaults that a stored configuration without the key does not mean (config/schema/): a
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_urls_are_redacted_and_the_rest_kept() {
        assert_eq!(
            redact_credentials("--set track.mlflow=\"http://me:s3cret@h:5000/x\""),
            "--set track.mlflow=\"http://me:***@h:5000/x\""
        );
        assert_eq!(redact_credentials("a http://h:1 b https://u:p@q c"), "a http://h:1 b https://u:***@q c");
        assert_eq!(redact_credentials("no url"), "no url");
    }
}
