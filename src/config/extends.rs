//! `extends = "base.toml"`: a pipeline or experiment file built on another of its kind. The
//! chain is read from the file to its first base (paths relative to the file that names them),
//! refused on a cycle, a missing base or a base of the other kind, each time naming the chain;
//! then merged from the first base to the file: tables key by key, any other value (arrays
//! included) replaced. A file's `unset = ["train.epochs"]` removes keys its bases set before its
//! own values apply. [`Layers::origin`] says which file and line set a key.
use std::path::{Component, Path, PathBuf};

use super::ConfigError;

/// The most files a chain may hold, the file itself included: deeper is a mistake, not a design.
pub const MAX_CHAIN: usize = 32;

/// The two kinds of configuration file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Pipeline,
    Experiment,
}

impl FileKind {
    fn name(self) -> &'static str {
        match self {
            FileKind::Pipeline => "a pipeline",
            FileKind::Experiment => "an experiment file",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            FileKind::Pipeline => "pipelines",
            FileKind::Experiment => "experiment files",
        }
    }

    /// What a file's top-level keys say it is; `None` when they do not tell (only `extends`).
    fn of(table: &toml::Table) -> Option<FileKind> {
        const EXPERIMENT: &[&str] = &["pipeline", "set", "sweep", "scaling", "search"];
        let keys: Vec<&str> = table.keys().map(String::as_str).filter(|k| !["extends", UNSET].contains(k)).collect();
        if keys.iter().any(|k| EXPERIMENT.contains(k)) {
            Some(FileKind::Experiment)
        } else if keys.is_empty() {
            None
        } else {
            Some(FileKind::Pipeline)
        }
    }
}

/// The top-level key of a file that removes keys its bases set.
pub const UNSET: &str = "unset";

/// One file of a chain: its path, its text with the `extends` line blanked (line numbers kept),
/// its values, and the keys of its bases it removes (`unset`).
#[derive(Debug, Clone)]
pub struct Layer {
    pub file: PathBuf,
    pub text: String,
    pub table: toml::Table,
    pub unset: Vec<String>,
}

/// A file and its bases, the first base first and the file itself last.
#[derive(Debug, Clone)]
pub struct Layers(pub Vec<Layer>);

impl Layers {
    /// Reads `file` and every base it extends. `what` names the file in errors ("the pipeline file").
    pub fn read(file: &Path, kind: FileKind, what: &str) -> Result<Layers, ConfigError> {
        let mut chain: Vec<Layer> = Vec::new();
        let mut seen: std::collections::HashSet<PathBuf> = std::collections::HashSet::new();
        let mut next = Some(file.to_owned());
        while let Some(path) = next.take() {
            let names = |last: &Path| {
                let mut names: Vec<String> = chain.iter().map(|l| l.file.display().to_string()).collect();
                names.push(last.display().to_string());
                names.join(" → ")
            };
            let real = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
            if seen.contains(&real) {
                return Err(ConfigError::new(format!("extends cycle: {}", names(&path))));
            }
            if chain.len() == MAX_CHAIN {
                let first: Vec<String> = chain.iter().take(3).map(|l| l.file.display().to_string()).collect();
                return Err(ConfigError::new(format!(
                    "{}: the extends chain is longer than {MAX_CHAIN} files ({} → ... → {}): merge some of its bases",
                    at_extends(&chain[0]),
                    first.join(" → "),
                    path.display()
                )));
            }
            if !chain.is_empty() && !path.is_file() {
                let child = &chain[chain.len() - 1];
                return Err(ConfigError::new(format!(
                    "{}: extends {}, which is not a file (the path is relative to the file that names it); \
                     extends chain: {}",
                    at_extends(child),
                    path.display(),
                    names(&path)
                )));
            }
            let text =
                crate::input::read_capped(&path, crate::input::CONFIG_FILE_CAP, what).map_err(ConfigError::new)?;
            let origin = path.display().to_string();
            let (text, base) = take_extends(&text, &origin)?;
            let mut table: toml::Table = toml::from_str(&text).unwrap_or_default();
            let unset = take_unset(&mut table, &text, &origin)?;
            if let (Some(found), false) = (FileKind::of(&table), chain.is_empty()) {
                if found != kind {
                    return Err(ConfigError::new(format!(
                        "{origin} is {}, but {} is {}: {} extend only {}; extends chain: {}",
                        found.name(),
                        chain[0].file.display(),
                        kind.name(),
                        kind.plural(),
                        kind.plural(),
                        names(&path)
                    )));
                }
            }
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            next = base.map(|b| normalize(&dir.join(b)));
            seen.insert(real);
            chain.push(Layer { file: path, text, table, unset });
        }
        chain.reverse();
        if kind == FileKind::Pipeline {
            let top = chain.last().and_then(|l| l.file.parent()).map(Path::to_path_buf).unwrap_or_default();
            for layer in &mut chain {
                let dir = layer.file.parent().map(Path::to_path_buf).unwrap_or_default();
                super::paths::rebase(&mut layer.table, &dir, &top);
            }
        }
        let layers = Layers(chain);
        layers.check_unset()?;
        Ok(layers)
    }

    /// Every `unset` key is set by a base of its file: removing nothing is a typo, or a base
    /// that changed.
    fn check_unset(&self) -> Result<(), ConfigError> {
        for (i, layer) in self.0.iter().enumerate() {
            let below = Layers(self.0[..i].to_vec()).merged();
            for key in &layer.unset {
                if get(&below, key).is_none() {
                    let line = key_line(&std::fs::read_to_string(&layer.file).unwrap_or_default(), UNSET);
                    let at = line.map_or(layer.file.display().to_string(), |l| format!("{}:{l}", layer.file.display()));
                    let why = match i {
                        0 => {
                            "this file extends no other: `unset` removes keys that the files it extends set".to_owned()
                        }
                        _ => format!("no file it extends sets `{key}` (extends chain: {})", self.chain()),
                    };
                    return Err(ConfigError::new(format!("{at}: unset {key:?}: {why}")));
                }
            }
        }
        Ok(())
    }

    /// The file itself (the last layer).
    pub fn file(&self) -> &Layer {
        self.0.last().expect("a chain holds its file")
    }

    /// The bases, nearest first (empty without `extends`).
    pub fn bases(&self) -> Vec<PathBuf> {
        self.0.iter().rev().skip(1).map(|l| l.file.clone()).collect()
    }

    /// `child.toml → base.toml → root.toml`.
    pub fn chain(&self) -> String {
        self.0.iter().rev().map(|l| l.file.display().to_string()).collect::<Vec<_>>().join(" → ")
    }

    /// Every layer merged: each removes the keys it unsets from its bases', then its tables
    /// merge key by key and its other values replace the bases'.
    pub fn merged(&self) -> toml::Table {
        let mut out = toml::Table::new();
        for layer in &self.0 {
            for key in &layer.unset {
                remove(&mut out, key);
            }
            merge(&mut out, &layer.table);
        }
        out
    }

    /// The file that sets `dotted` last, and the line where it does (when it can be found).
    pub fn origin(&self, dotted: &str) -> Option<(&Path, Option<usize>)> {
        self.0
            .iter()
            .rev()
            .find(|l| get(&l.table, dotted).is_some())
            .map(|l| (l.file.as_path(), key_line(&l.text, dotted)))
    }

    /// Where `key` of table `section` (dotted: `search.space`) is set when the key itself holds
    /// dots (a sweep axis, `"run.seed" = [0, 1]`): the file, and the line that starts with the
    /// quoted key.
    pub fn origin_of_quoted(&self, section: &str, key: &str) -> Option<(&Path, Option<usize>)> {
        self.0.iter().rev().find(|l| get(&l.table, section).and_then(|t| t.get(key)).is_some()).map(|l| {
            let quoted = [format!("\"{key}\""), format!("'{key}'")];
            let line = l.text.lines().position(|line| quoted.iter().any(|q| line.trim_start().starts_with(q.as_str())));
            (l.file.as_path(), line.map(|i| i + 1))
        })
    }

    /// Where `dotted` is set, in an order that follows the chain (first base first) then lines.
    pub fn position(&self, dotted: &str) -> (usize, usize) {
        match self.0.iter().rposition(|l| get(&l.table, dotted).is_some()) {
            Some(i) => (i, key_line(&self.0[i].text, dotted).unwrap_or(usize::MAX)),
            None => (usize::MAX, usize::MAX),
        }
    }

    /// `file base.toml:12` for the saved configuration's comments.
    pub fn source(&self, dotted: &str) -> Option<String> {
        self.origin(dotted).map(|(file, line)| match line {
            Some(line) => format!("file {}:{line}", file.display()),
            None => format!("file {}", file.display()),
        })
    }

    /// Whether the line that sets `dotted` ends in `# default`, as a run's `config.toml` marks the
    /// values it did not get from anywhere.
    pub fn says_default(&self, dotted: &str) -> bool {
        let Some(layer) = self.0.iter().rev().find(|l| get(&l.table, dotted).is_some()) else { return false };
        let line = key_line(&layer.text, dotted).and_then(|n| layer.text.lines().nth(n - 1));
        line.and_then(|l| l.rsplit_once('#')).is_some_and(|(_, comment)| comment.trim() == "default")
    }
}

/// `child.toml:1` where the child's `extends` line is.
fn at_extends(child: &Layer) -> String {
    // The line was blanked: find it in the file as written.
    let text = std::fs::read_to_string(&child.file).unwrap_or_default();
    match key_line(&text, "extends") {
        Some(line) => format!("{}:{line}", child.file.display()),
        None => child.file.display().to_string(),
    }
}

fn merge(into: &mut toml::Table, from: &toml::Table) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge(a, b),
            _ => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Removes the dotted key from `table`, and tables it leaves empty; whether it was there.
pub fn remove(table: &mut toml::Table, dotted: &str) -> bool {
    match dotted.split_once('.') {
        None => table.remove(dotted).is_some(),
        Some((head, rest)) => {
            let Some(toml::Value::Table(t)) = table.get_mut(head) else { return false };
            let removed = remove(t, rest);
            if t.is_empty() {
                table.remove(head);
            }
            removed
        }
    }
}

/// The file's top-level `unset = ["section.key", ...]`, taken out of its values.
fn take_unset(table: &mut toml::Table, text: &str, origin: &str) -> Result<Vec<String>, ConfigError> {
    let Some(value) = table.remove(UNSET) else { return Ok(Vec::new()) };
    let keys: Option<Vec<String>> =
        value.as_array().and_then(|a| a.iter().map(|v| v.as_str().map(|s| s.trim().to_owned())).collect());
    match keys {
        Some(keys) if keys.iter().all(|k| !k.is_empty()) => Ok(keys),
        _ => {
            let at = key_line(text, UNSET).map_or(origin.to_owned(), |l| format!("{origin}:{l}"));
            Err(ConfigError::new(format!(
                "{at}: `unset` must be a list of dotted keys that the bases set, e.g. unset = [\"train.epochs\"]"
            )))
        }
    }
}

fn get<'a>(table: &'a toml::Table, dotted: &str) -> Option<&'a toml::Value> {
    let (head, rest) = match dotted.split_once('.') {
        Some((h, r)) => (h, Some(r)),
        None => (dotted, None),
    };
    let v = table.get(head)?;
    match (rest, v) {
        (None, v) => Some(v),
        (Some(rest), toml::Value::Table(t)) => get(t, rest),
        _ => None,
    }
}

/// The text without its top-level `extends = "..."` line (blanked, so lines keep their numbers),
/// and the base it names.
fn take_extends(text: &str, origin: &str) -> Result<(String, Option<String>), ConfigError> {
    let mut out = Vec::new();
    let mut base = None;
    let mut top = true;
    for (i, line) in text.split('\n').enumerate() {
        let t = line.trim();
        if t.starts_with('[') {
            top = false;
        }
        let key = t.split_once('=').map(|(k, _)| k.trim().trim_matches('"'));
        if top && key == Some("extends") && base.is_some() {
            return Err(ConfigError::new(format!(
                "{origin}:{}: `extends` is given twice: a file extends one base (to build on several, let each \
                 base extend the next)",
                i + 1
            )));
        }
        if top && key == Some("extends") {
            let value: Option<String> = toml::from_str::<toml::Table>(t)
                .ok()
                .and_then(|mut v| v.remove("extends"))
                .and_then(|v| v.as_str().map(str::to_owned));
            match value {
                Some(v) if !v.trim().is_empty() => base = Some(v),
                _ => {
                    return Err(ConfigError::new(format!(
                        "{origin}:{}: `extends` must name a file of the same kind, e.g. extends = \"base.toml\"",
                        i + 1
                    )))
                }
            }
            out.push(String::new());
        } else {
            out.push(line.to_owned());
        }
    }
    Ok((out.join("\n"), base))
}

/// The line (1-based) where `dotted` is set, following `[section]` headers and dotted or quoted keys.
pub fn key_line(text: &str, dotted: &str) -> Option<usize> {
    let unquote = |s: &str| -> String {
        s.split('.').map(|p| p.trim().trim_matches('"').trim_matches('\'')).collect::<Vec<_>>().join(".")
    };
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.split(']').next()) {
            current = unquote(header.trim_start_matches('['));
            // A table is set where its header is (`[trian]`, a misspelt section).
            if current == dotted {
                return Some(i + 1);
            }
        } else if let Some((key, _)) = line.split_once('=').filter(|_| !line.starts_with('#')) {
            let key = unquote(key);
            let full = if current.is_empty() { key } else { format!("{current}.{key}") };
            if full == dotted {
                return Some(i + 1);
            }
        }
    }
    None
}

/// `experiments/../pipelines/ddp.toml` → `pipelines/ddp.toml`, without touching the disk.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir if matches!(out.components().next_back(), Some(Component::Normal(_))) => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(s: &str) -> toml::Table {
        toml::from_str(s).unwrap()
    }

    #[test]
    fn tables_merge_key_by_key_and_arrays_replace() {
        let mut a = table("[train]\nlr = 0.1\nepochs = 5\n[wrap.model]\nhidden = [64, 64]\n");
        merge(&mut a, &table("[train]\nlr = 0.2\n[wrap.model]\nhidden = [8]\n"));
        assert_eq!(a, table("[train]\nlr = 0.2\nepochs = 5\n[wrap.model]\nhidden = [8]\n"));
    }

    #[test]
    fn remove_takes_a_dotted_key_and_the_tables_it_empties() {
        let mut a = table("[train]\nepochs = 5\n[train.schedule]\nkind = \"cosine\"\n[run]\nseed = 1\n");
        assert!(remove(&mut a, "train.epochs"));
        assert!(remove(&mut a, "train.schedule.kind"));
        assert!(!remove(&mut a, "train.lr"));
        assert!(!remove(&mut a, "run.seed.x"));
        assert_eq!(a, table("[run]\nseed = 1\n"));
    }

    #[test]
    fn the_extends_line_is_blanked_and_lines_keep_their_numbers() {
        let (text, base) = take_extends("# c\nextends = \"b.toml\"\n[train]\nlr = 1\n", "a.toml").unwrap();
        assert_eq!(base.as_deref(), Some("b.toml"));
        assert_eq!(text, "# c\n\n[train]\nlr = 1\n");
        assert_eq!(key_line(&text, "train.lr"), Some(4));
        let e = take_extends("extends = 3\n", "a.toml").unwrap_err();
        assert!(e.message.starts_with("a.toml:1: `extends` must name a file"), "{}", e.message);
        let e = take_extends("extends = \"b.toml\"\nextends = \"c.toml\"\n", "a.toml").unwrap_err();
        assert!(e.message.starts_with("a.toml:2: `extends` is given twice"), "{}", e.message);
    }

    #[test]
    fn key_lines_follow_sections_and_quotes() {
        let text = "pipeline = \"p.toml\"\n[set]\n\"train.epochs\" = 2\n[sweep]\n\"run.seed\" = [0]\n[sweep.run]\nworld_size = [1, 2]\n";
        assert_eq!(key_line(text, "pipeline"), Some(1));
        assert_eq!(key_line(text, "set.train.epochs"), Some(3));
        assert_eq!(key_line(text, "sweep.run.seed"), Some(5));
        assert_eq!(key_line(text, "sweep.run.world_size"), Some(7));
        assert_eq!(key_line(text, "sweep.train.lr"), None);
        assert_eq!(key_line(text, "sweep.run"), Some(6), "a table, at its header");
    }

    #[test]
    fn paths_are_normalized_lexically() {
        assert_eq!(normalize(Path::new("experiments/../pipelines/ddp.toml")), PathBuf::from("pipelines/ddp.toml"));
        assert_eq!(normalize(Path::new("../a/./b.toml")), PathBuf::from("../a/b.toml"));
    }
}
