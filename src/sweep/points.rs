//! Named points (`[[points]]`): each a name and the keys it sets, for the comparisons a grid's
//! product cannot spell ("DDP, FSDP, TP = 4, FSDP × TP 2 × 2"). With `[sweep]` axes too, every
//! named point runs at every combination of the axes, the points outermost. [`check`] reads them
//! and reports every bad one by name and line: a name missing, not path-safe or given twice, a
//! key the pipeline does not have or a value it does not take, a key that `[set]` fixes or
//! `[sweep]` sweeps (each key has one place).
use std::path::Path;

use crate::config::extends::{key_line, Layers};
use crate::config::resolve::flatten;

/// Where a named point's values come from, in a point's config.toml (`experiment [[points]]
/// tp4 wrap.mesh.tensor=4`).
pub const POINT_LABEL: &str = "experiment [[points]]";

/// The longest name a point may have (it names a directory, and a row of the table).
const MAX_NAME: usize = 64;

/// One `[[points]]` table: its name and the keys it sets, in the file's order.
#[derive(Debug, Clone, PartialEq)]
pub struct Named {
    pub name: String,
    pub set: Vec<(String, toml::Value)>,
}

impl Named {
    /// The label of this point's overrides.
    pub fn label(&self) -> String {
        format!("{POINT_LABEL} {}", self.name)
    }
}

/// A problem, with where it is in the chain (layer, line) for ordering.
pub type Problem = ((usize, usize), String);

/// The keys a point may not set: `[set]`'s and the axes'.
pub struct Taken<'a> {
    pub fixed: &'a [String],
    pub swept: &'a [String],
}

/// Checks the `[[points]]` tables: their names, and every key each sets against the pipeline
/// (`resolves` says what the resolver says of a key and value, `Ok` when it takes them). Returns
/// the points, and every problem found.
pub fn check(
    entries: &[toml::Table],
    layers: &Layers,
    taken: &Taken,
    resolves: &dyn Fn(&str, &str, &toml::Value) -> Result<(), String>,
) -> (Vec<Named>, Vec<Problem>) {
    let at = Locator::new(layers);
    let mut problems: Vec<Problem> = Vec::new();
    let mut points: Vec<Named> = Vec::new();
    if entries.is_empty() {
        problems.push(at.problem(
            None,
            None,
            "`points` is empty: give at least one [[points]] table, or leave it out".into(),
        ));
    }
    for (i, entry) in entries.iter().enumerate() {
        let name = match name_of(entry) {
            Ok(name) => name,
            Err(why) => {
                problems.push(at.problem(
                    Some(i),
                    Some("name"),
                    format!("the {} [[points]] table: {why}", ordinal(i + 1)),
                ));
                continue;
            }
        };
        if let Some(first) = points.iter().position(|p| p.name == name) {
            let why = format!(
                "two points are named `{name}` (the {} and the {} [[points]] tables): give each point its own name",
                ordinal(first + 1),
                ordinal(i + 1)
            );
            problems.push(at.problem(Some(i), Some("name"), why));
        }
        let mut set = Vec::new();
        let mut rest = entry.clone();
        rest.remove("name");
        flatten("", &toml::Value::Table(rest), &mut set);
        let label = format!("{POINT_LABEL} {name}");
        for (key, value) in &set {
            let clash = if taken.fixed.contains(key) {
                Some("[set] fixes it for every point")
            } else if taken.swept.contains(key) {
                Some("[sweep] sweeps it")
            } else {
                None
            };
            let why = match clash {
                Some(clash) => Err(format!("point `{name}` sets `{key}`, but {clash}: keep the key in one place")),
                // The resolver's message starts with the label, which names the point.
                None => resolves(&label, key, value),
            };
            if let Err(why) = why {
                problems.push(at.problem(Some(i), Some(key), why));
            }
        }
        points.push(Named { name, set });
    }
    (points, problems)
}

/// A point's name: a string of letters, digits and `._+-` (it names the point's directory and its
/// row of the table as written), or why not.
fn name_of(entry: &toml::Table) -> Result<String, String> {
    let example = "e.g. name = \"fsdp-tp2\"";
    let name = match entry.get("name") {
        None => return Err(format!("no `name`: give each point a name, {example}")),
        Some(toml::Value::String(s)) => s.clone(),
        Some(other) => return Err(format!("`name` must be a string, not {other}; {example}")),
    };
    let safe = |c: char| c.is_ascii_alphanumeric() || "._+-".contains(c);
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(safe) || name.starts_with('.') {
        return Err(format!(
            "the name {name:?} cannot name a directory: use 1 to {MAX_NAME} letters, digits, `.`, `_`, `+` or `-` \
             (not starting with `.`), {example}"
        ));
    }
    Ok(name)
}

fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// Finds the lines of the `[[points]]` tables in the file of the chain that sets them.
struct Locator<'a> {
    file: &'a Path,
    layer: usize,
    text: &'a str,
}

impl<'a> Locator<'a> {
    fn new(layers: &'a Layers) -> Locator<'a> {
        let layer = layers.0.iter().rposition(|l| l.table.contains_key("points")).unwrap_or(layers.0.len() - 1);
        let l = &layers.0[layer];
        Locator { file: &l.file, layer, text: &l.text }
    }

    /// `file:line: why`, at the `index`th table's `key` where it can be found, else its header,
    /// else the `points` key.
    fn problem(&self, index: Option<usize>, key: Option<&str>, why: String) -> Problem {
        let line = index.and_then(|i| table_line(self.text, i, key)).or_else(|| key_line(self.text, "points"));
        let at = match line {
            Some(line) => format!("{}:{line}", self.file.display()),
            None => self.file.display().to_string(),
        };
        ((self.layer, line.unwrap_or(usize::MAX)), format!("{at}: {why}"))
    }
}

/// The line (1-based) of the `index`th `[[points]]` header of `text`, or of `key` within that
/// table (its own lines and its `[points.…]` subtables); none where the points are written inline.
fn table_line(text: &str, index: usize, key: Option<&str>) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let header = |l: &str| l.trim_start().starts_with("[[points]]");
    let start = lines.iter().enumerate().filter(|(_, l)| header(l)).nth(index)?.0;
    let Some(key) = key else { return Some(start + 1) };
    let end = lines[start + 1..]
        .iter()
        .position(|l| {
            let l = l.trim_start();
            l.starts_with('[') && !l.starts_with("[points.")
        })
        .map_or(lines.len(), |n| start + 1 + n);
    let block = lines[start..end].join("\n");
    key_line(&block, &format!("points.{key}")).map(|n| start + n).or(Some(start + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::extends::FileKind;

    fn load(text: &str) -> (Vec<Named>, Vec<String>) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("e.toml");
        std::fs::write(&file, text).unwrap();
        let layers = Layers::read(&file, FileKind::Experiment, "the experiment file").unwrap();
        let entries: Vec<toml::Table> = match layers.merged().get("points") {
            Some(toml::Value::Array(a)) => a.iter().map(|v| v.as_table().unwrap().clone()).collect(),
            _ => vec![],
        };
        let (fixed, swept) = (["train.epochs".to_owned()], ["run.seed".to_owned()]);
        let taken = Taken { fixed: &fixed, swept: &swept };
        let resolves = |label: &str, key: &str, _: &toml::Value| {
            if key.starts_with("wrap.") || key.starts_with("run.") {
                Ok(())
            } else {
                Err(format!("{label} {key}: unknown key"))
            }
        };
        let (points, problems) = check(&entries, &layers, &taken, &resolves);
        let at = file.display().to_string();
        (points, problems.into_iter().map(|(_, m)| m.replace(&at, "e.toml")).collect())
    }

    #[test]
    fn points_keep_their_names_and_keys_in_the_files_order() {
        let (points, problems) = load(
            "[[points]]\nname = \"ddp\"\n\n[[points]]\nname = \"tp4\"\n\"wrap.mesh.tensor\" = 4\n\n\
             [[points]]\nname = \"fsdp-tp\"\n[points.wrap]\nstrategy = \"fsdp\"\nmesh = { data = 2, tensor = 2 }\n",
        );
        assert!(problems.is_empty(), "{problems:?}");
        let names: Vec<&str> = points.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["ddp", "tp4", "fsdp-tp"]);
        assert!(points[0].set.is_empty());
        assert_eq!(points[1].set, [("wrap.mesh.tensor".to_owned(), toml::Value::Integer(4))]);
        let keys: Vec<&str> = points[2].set.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["wrap.strategy", "wrap.mesh.data", "wrap.mesh.tensor"]);
        assert_eq!(points[1].label(), "experiment [[points]] tp4");
    }

    #[test]
    fn bad_points_are_refused_by_name_with_their_lines() {
        let (_, problems) = load(
            "[[points]]\nname = \"a\"\n\"train.epochs\" = 2\n\n[[points]]\nname = \"b\"\n\n[points.run]\nseed = 3\n\n\
             [[points]]\nname = \"a\"\n\"wrap.mesh.tensor\" = 2\n\"train.lrr\" = 0.1\n\n[[points]]\n\"run.seed\" = 1\n\n\
             [[points]]\nname = \"x/y\"\n",
        );
        assert_eq!(
            problems,
            [
                "e.toml:3: point `a` sets `train.epochs`, but [set] fixes it for every point: keep the key in one place",
                "e.toml:9: point `b` sets `run.seed`, but [sweep] sweeps it: keep the key in one place",
                "e.toml:12: two points are named `a` (the 1st and the 3rd [[points]] tables): give each point its own name",
                "e.toml:14: experiment [[points]] a train.lrr: unknown key",
                "e.toml:16: the 4th [[points]] table: no `name`: give each point a name, e.g. name = \"fsdp-tp2\"",
                "e.toml:20: the 5th [[points]] table: the name \"x/y\" cannot name a directory: use 1 to 64 letters, \
                 digits, `.`, `_`, `+` or `-` (not starting with `.`), e.g. name = \"fsdp-tp2\"",
            ]
        );
        let (_, problems) = load("points = []\n");
        assert_eq!(problems, ["e.toml:1: `points` is empty: give at least one [[points]] table, or leave it out"]);
        let (_, problems) = load("points = [{ name = 3 }]\n");
        assert_eq!(
            problems,
            ["e.toml:1: the 1st [[points]] table: `name` must be a string, not 3; e.g. name = \"fsdp-tp2\""]
        );
    }
}
