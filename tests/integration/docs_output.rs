//! What the docs show a command printing is what it prints now: every ```` ```console ```` block
//! of README.md and docs/ (`$ command` lines, each followed by its output) is run in a sandbox of
//! its page and compared with snapbox, the timings, rates and temporary paths of both sides
//! redacted, so that a changed loss, run id, shape or message fails and a changed timing does not.
//!
//! - ```` ```console ```` blocks (validate, refusals, schema, --help, short runs) run here, in
//!   `cargo test`.
//! - ```` ```console long=NAME ```` blocks (runs of minutes) run only when regenerated; their
//!   whole output, redacted, is stored in `tests/docs-output/NAME.txt`. Here the page's block must
//!   agree with that snapshot, and the snapshot's plan (the lines before the first epoch) with
//!   what `runner validate` prints for the same command now: a changed run id, plan row or
//!   memory estimate fails until the docs are regenerated.
//!
//! `scripts/docs-output.sh` rewrites every block and snapshot from the current binary (see
//! docs/development.md). A block may elide lines with `...` on a line of its own (kept when
//! regenerated) and characters with `[..]`.

use crate::common::pages;

use std::path::{Path, PathBuf};
use std::process::Command;

use snapbox::assert::Action;
use snapbox::Redactions;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fenced block of a page: its info string, its lines, and where they are in the page
/// (0-based index of the first body line, and the count).
#[derive(Debug, Clone)]
struct Block {
    info: String,
    body: Vec<String>,
    start: usize,
    indent: usize,
}

impl Block {
    fn lang(&self) -> &str {
        self.info.split_whitespace().next().unwrap_or("")
    }

    fn flag(&self, name: &str) -> Option<&str> {
        self.info.split_whitespace().find_map(|w| match w.split_once('=') {
            Some((k, v)) if k == name => Some(v),
            None if w == name => Some(""),
            _ => None,
        })
    }

    fn long(&self) -> Option<&str> {
        self.flag("long")
    }
}

fn blocks(md: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, raw) in md.lines().enumerate() {
        let trimmed = raw.trim_start();
        let ticks = trimmed.len() - trimmed.trim_start_matches('`').len();
        let fence = (ticks >= 3 && !trimmed[ticks..].contains('`')).then(|| trimmed[ticks..].trim());
        if let Some(mut b) = open.take() {
            if fence == Some("") {
                out.push(b);
            } else {
                let cut = (raw.len() - trimmed.len()).min(b.indent);
                b.body.push(raw[cut..].to_owned());
                open = Some(b);
            }
        } else if let Some(info) = fence {
            let indent = raw.len() - trimmed.len();
            open = Some(Block { info: info.to_owned(), body: Vec::new(), start: i + 1, indent });
        }
    }
    out
}

/// A `$ command` of a block and the output shown after it. A command whose quotes are left open
/// goes on over the next lines (a `python3 -c "..."` of several lines).
#[derive(Debug)]
struct Step {
    command: String,
    shown: Vec<String>,
}

fn steps(body: &[String]) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    let mut continuing = false;
    for line in body {
        if continuing {
            let step = out.last_mut().unwrap();
            step.command.push('\n');
            step.command.push_str(line);
            continuing = open_quotes(&step.command);
        } else if let Some(command) = line.strip_prefix("$ ") {
            out.push(Step { command: command.to_owned(), shown: Vec::new() });
            continuing = open_quotes(command);
        } else if let Some(step) = out.last_mut() {
            step.shown.push(line.clone());
        }
    }
    out
}

fn open_quotes(command: &str) -> bool {
    let (mut single, mut double, mut escaped) = (false, false, false);
    for c in command.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' if !single => escaped = true,
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            _ => {}
        }
    }
    single || double
}

/// What varies from run to run and is never a result: timings, throughputs, measured memory,
/// temporary paths, dates, an MLflow run's id. Each pattern is as narrow as the output it redacts.
fn redactions() -> Redactions {
    let mut r = Redactions::new();
    let mut add = |placeholder: &'static str, pattern: &str| {
        r.insert(placeholder, regex::Regex::new(pattern).unwrap()).unwrap();
    };
    // The last two columns of an epoch or step table's rows: seconds and samples/s.
    add("[TIMINGS]", r"(?m)^  \d+(?: +-?[\d.]+(?:e-?\d+)?)*? +(?<redacted>\d+\.\d+ +\d+)$");
    add("[SECONDS]", r"\b(?<redacted>\d+\.\d+)s\b");
    add("[RATE]", r"\b(?<redacted>\d+(?:\.\d+)?) (?:samples|tokens)/s\b");
    add("[RATE]", r"\b(?<redacted>\d+(?:\.\d+)?) GFLOP/s\b");
    // A run's measured peak memory per rank, beside the plan's estimate (which stays).
    add("[PEAK]", r"\brank \d+ (?<redacted>[\d.]+ [MG]iB) \(estimated ");
    add("[TMP]", r"(?<redacted>/tmp/[^\s'`\x22),:]+)");
    add("[DATE]", r"(?<redacted>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})?)");
    add("[MLFLOWRUN]", r"mlflow: run (?<redacted>[0-9a-f]{32})\b");
    r
}

/// A line of `...` alone, however indented, elides lines.
fn is_elision(line: &str) -> bool {
    line.trim() == "..." || line.trim() == "…"
}

/// The text snapbox compares: elisions as its `...`, and every value that varies redacted.
fn comparable(lines: &[String], r: &Redactions) -> String {
    let mut out = String::new();
    for l in lines {
        out += if is_elision(l) { "..." } else { l.trim_end() };
        out.push('\n');
    }
    r.redact(&out)
}

/// A page's sandbox: the repository's folders linked in, `results/` a folder of its own (with
/// the committed sweeps linked in), and the page's `file=` blocks written as the page goes.
struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        for entry in
            ["pipelines", "experiments", "tests", "scripts", "benches", "docs", "src", "README.md", "Cargo.toml"]
        {
            std::os::unix::fs::symlink(root().join(entry), dir.path().join(entry)).unwrap();
        }
        std::fs::create_dir(dir.path().join("results")).unwrap();
        for e in std::fs::read_dir(root().join("results")).unwrap() {
            let e = e.unwrap();
            std::os::unix::fs::symlink(e.path(), dir.path().join("results").join(e.file_name())).unwrap();
        }
        Sandbox { dir }
    }

    fn write(&self, name: &str, body: &[String]) {
        let path = self.dir.path().join(name);
        if !path.exists() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, body.join("\n") + "\n").unwrap();
        }
    }

    /// Runs one `$` line with bash, stdout and stderr as a terminal interleaves them, the
    /// tests' runner binary first on PATH; its output's lines.
    fn run(&self, command: &str) -> Vec<String> {
        let bin = Path::new(env!("CARGO_BIN_EXE_runner")).parent().unwrap().to_owned();
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
        let mut cmd = Command::new("bash");
        cmd.arg("-c").arg(format!("{command}\n")).current_dir(self.dir.path()).env("PATH", path);
        // The page's command sees what a user's shell gives it: none of the tests' settings.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().to_string();
            // COLUMNS would fit the plan's table to the tests' terminal: the snapshots are unfitted.
            if k.starts_with("RUNNER_")
                || k.starts_with("MKL_")
                || k == "CI"
                || k.starts_with("CARGO_")
                || k == "COLUMNS"
            {
                cmd.env_remove(k);
            }
        }
        let (mut reader, writer) = std::io::pipe().unwrap();
        cmd.stdout(writer.try_clone().unwrap()).stderr(writer);
        let mut child = cmd.spawn().unwrap();
        drop(cmd);
        let mut out = String::new();
        std::io::Read::read_to_string(&mut reader, &mut out).unwrap();
        child.wait().unwrap();
        out.lines().map(|l| l.trim_end().to_owned()).collect()
    }
}

/// The new text of a block from the commands' output: the block's elisions kept where what
/// they stand between is still found (by a line's first words), the whole output otherwise.
fn regenerated(old: &[String], actual: &[String], r: &Redactions) -> Vec<String> {
    // A line's first two words, a number among them as `#`: "epoch 2/2", "5 train", "run ddp".
    let key = |line: &str| -> String {
        let red = r.redact(line.trim_end());
        red.split_whitespace()
            .take(2)
            .enumerate()
            .map(|(i, w)| if i > 0 && w.parse::<f64>().is_ok() { "#" } else { w })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut out = Vec::new();
    let mut at = 0;
    let mut i = 0;
    while i < old.len() {
        if is_elision(&old[i]) {
            let Some(next) = old[i + 1..].iter().find(|l| !is_elision(l)) else {
                out.push(old[i].clone());
                at = actual.len();
                break;
            };
            let exact = actual[at..].iter().position(|a| r.redact(a.trim_end()) == r.redact(next.trim_end()));
            let found = exact.or_else(|| actual[at..].iter().position(|a| key(a) == key(next)));
            match found {
                Some(skip) if skip > 0 => {
                    out.push(old[i].clone());
                    at += skip;
                }
                Some(_) => {}
                None => return actual.to_vec(),
            }
        } else {
            match actual.get(at) {
                Some(a) => out.push(a.clone()),
                None => return actual.to_vec(),
            }
            at += 1;
        }
        i += 1;
    }
    if at < actual.len() {
        return actual.to_vec();
    }
    out
}

fn overwrite() -> bool {
    std::env::var("SNAPSHOTS").is_ok_and(|v| v == "overwrite")
}

/// `DOCS_OUTPUT=all` runs the long blocks too (scripts/docs-output.sh sets it).
fn run_long() -> bool {
    std::env::var("DOCS_OUTPUT").is_ok_and(|v| v == "all")
}

fn snapshot_path(name: &str) -> PathBuf {
    root().join("tests/docs-output").join(format!("{name}.txt"))
}

/// The lines of a session as the page shows it: each `$` line and what follows it.
fn session(steps: &[(String, Vec<String>)]) -> Vec<String> {
    steps
        .iter()
        .flat_map(|(c, out)| std::iter::once(format!("$ {c}")).chain(out.iter().cloned()))
        .flat_map(|l| l.split('\n').map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

/// Checks (or, with SNAPSHOTS=overwrite, rewrites) one page; its problems.
fn check_page(page: &Path, r: &Redactions, assert: &snapbox::Assert) -> Vec<String> {
    let shown = page.strip_prefix(root()).unwrap().display().to_string();
    let md = std::fs::read_to_string(page).unwrap();
    let lines: Vec<String> = md.lines().map(str::to_owned).collect();
    let sandbox = Sandbox::new();
    let mut problems = Vec::new();
    let mut edits: Vec<(usize, usize, Vec<String>)> = Vec::new();
    for block in blocks(&md) {
        if block.lang() == "toml" {
            if let Some(name) = block.flag("file") {
                sandbox.write(name, &block.body);
            }
            continue;
        }
        if block.lang() != "console" {
            continue;
        }
        let at = format!("{shown}:{}", block.start);
        let long = block.long().map(str::to_owned);
        if long.is_some() && !run_long() {
            problems.extend(check_long(&at, &block, long.as_deref().unwrap(), r, assert, &sandbox));
            continue;
        }
        let steps = steps(&block.body);
        let ran: Vec<(String, Vec<String>)> =
            steps.iter().map(|s| (s.command.clone(), sandbox.run(&s.command))).collect();
        let actual = session(&ran);
        if overwrite() {
            let new = regenerated(&block.body, &actual, r);
            if let Some(name) = &long {
                std::fs::create_dir_all(snapshot_path(name).parent().unwrap()).unwrap();
                std::fs::write(snapshot_path(name), comparable(&actual, r)).unwrap();
            }
            if new != block.body {
                edits.push((block.start, block.body.len(), new));
            }
            continue;
        }
        let expected = comparable(&block.body, r);
        if let Err(e) = assert.try_eq(Some(&at), comparable(&actual, r).into(), expected.into()) {
            problems.push(format!("{at}: the block is not what its commands print now:\n{e}"));
        }
    }
    if !edits.is_empty() {
        let mut lines = lines;
        for (start, len, new) in edits.into_iter().rev() {
            let indent = " ".repeat(blocks(&md).iter().find(|b| b.start == start).map_or(0, |b| b.indent));
            let new: Vec<String> =
                new.iter().map(|l| if l.is_empty() { l.clone() } else { format!("{indent}{l}") }).collect();
            lines.splice(start..start + len, new);
        }
        std::fs::write(page, lines.join("\n") + "\n").unwrap();
    }
    problems
}

/// A long block without running it: the page against its snapshot, and the snapshot's plan
/// against `runner validate` now.
fn check_long(
    at: &str,
    block: &Block,
    name: &str,
    r: &Redactions,
    assert: &snapbox::Assert,
    sandbox: &Sandbox,
) -> Vec<String> {
    let mut problems = Vec::new();
    let path = snapshot_path(name);
    let Ok(stored) = std::fs::read_to_string(&path) else {
        return vec![format!("{at}: no snapshot {}: run scripts/docs-output.sh", path.display())];
    };
    let expected = comparable(&block.body, r);
    // The page may elide what the snapshot holds: the snapshot is the actual side.
    if let Err(e) = assert.try_eq(Some(&format!("{}", path.display())), stored.clone().into(), expected.into()) {
        problems.push(format!("{at}: the block differs from its snapshot {}:\n{e}", path.display()));
    }
    let steps = steps(&block.body);
    let Some(first) = steps.first() else { return problems };
    if let Some(args) = first.command.strip_prefix("runner run ").filter(|a| !a.contains("--resume")) {
        // The plan a run prints is what validate prints, before the run starts.
        let args = args.split(" --out ").next().unwrap_or(args);
        let validate = sandbox.run(&format!("runner validate {args}"));
        let plan = plan_lines(&validate);
        let stored_lines: Vec<String> = stored.lines().skip(1).map(str::to_owned).collect();
        let stored_plan = plan_lines(&stored_lines);
        if stored_plan.is_empty() {
            // The block hides the run's output (`> /dev/null`): nothing of the plan to compare.
            return problems;
        }
        let now = comparable(&plan, r);
        let then = comparable(&stored_plan, r);
        if let Err(e) = assert.try_eq(Some(&format!("runner validate {args}")), now.into(), then.into()) {
            problems.push(format!(
                "{at}: the plan of `{}` changed since {} was made: run scripts/docs-output.sh\n{e}",
                first.command,
                path.display()
            ));
        }
    }
    problems
}

/// The plan of a run's or validate's output: from the `run NAME (ID)` line to the memory
/// estimate's lines, the extends line left out.
fn plan_lines(out: &[String]) -> Vec<String> {
    let start = out.iter().position(|l| l.starts_with("run ")).unwrap_or(0);
    let mut end = start;
    for (i, l) in out.iter().enumerate().skip(start) {
        if l.starts_with("  memory") || l.starts_with("  training state") {
            end = i + 1;
        } else if end > start && !l.starts_with("  ") {
            break;
        }
    }
    out[start..end].to_vec()
}

#[test]
fn every_printed_output_of_the_docs_is_what_the_command_prints_now() {
    let r = redactions();
    let action = if overwrite() { Action::Overwrite } else { Action::Verify };
    let assert = snapbox::Assert::new().action(action).redact_with(r.clone());
    let mut problems = Vec::new();
    // DOCS_PAGE=PATH (scripts/docs-output.sh PATH) checks or rewrites the pages whose path holds it.
    let only = std::env::var("DOCS_PAGE").unwrap_or_default();
    for page in pages().into_iter().filter(|p| p.to_string_lossy().contains(&only)) {
        problems.extend(check_page(&page, &r, &assert));
    }
    assert!(
        problems.is_empty(),
        "{} blocks differ from what their commands print (scripts/docs-output.sh rewrites them):\n\n{}",
        problems.len(),
        problems.join("\n\n")
    );
}

/// Output shown after a `$ ... runner ...` line outside a ```` ```console ```` block would escape
/// the check above: every such block is found, so a page cannot show an output no test compares.
#[test]
fn every_block_that_shows_a_runner_command_with_its_output_is_a_checked_block() {
    let mut unchecked = Vec::new();
    for page in pages() {
        let shown = page.strip_prefix(root()).unwrap().display().to_string();
        for block in blocks(&std::fs::read_to_string(&page).unwrap()) {
            if block.lang() == "console" {
                continue;
            }
            for step in steps(&block.body) {
                let runs_runner = step.command.split_whitespace().any(|w| w == "runner" || w.ends_with("/runner"));
                if runs_runner && step.shown.iter().any(|l| !l.trim().is_empty()) {
                    unchecked.push(format!("{shown}:{}: `$ {}`", block.start, step.command));
                }
            }
        }
    }
    assert!(
        unchecked.is_empty(),
        "{} blocks show a runner command with its output but are not ```console blocks, so no test compares \
         that output with what the command prints: make each a ```console block (```console long=NAME for a \
         run of minutes, then scripts/docs-output.sh PAGE), or show the command alone:\n{}",
        unchecked.len(),
        unchecked.join("\n")
    );
}

/// The redactions hide what varies and nothing else: a changed loss, id or message is found.
#[test]
fn the_redactions_hide_timings_and_paths_but_not_results() {
    let r = redactions();
    let a = r.redact("  epoch 1/5  loss 0.7978  acc 0.7101  val f1 0.6076  0.57s  4405 samples/s per rank\n  1      0.7978  0.7101      0.5737    0.7700        0.57     4405\n/tmp/abc/x: run 0123456789ab\n");
    let b = r.redact("  epoch 1/5  loss 0.7978  acc 0.7101  val f1 0.6076  12.07s  98 samples/s per rank\n  1      0.7978  0.7101      0.5737    0.7700        12.07    98\n/tmp/zzz/x: run 0123456789ab\n");
    assert_eq!(a, b);
    for (i, changed) in [
        "  epoch 1/5  loss 0.7979  acc 0.7101  val f1 0.6076  0.57s  4405 samples/s per rank\n",
        "  1      0.7978  0.7102      0.5737    0.7700        0.57     4405\n",
        "/tmp/abc/x: run 0123456789ac\n",
    ]
    .into_iter()
    .enumerate()
    {
        assert_ne!(r.redact(changed).trim_end(), a.lines().nth(i).unwrap(), "{changed}");
    }
}

/// An elided block keeps its elisions when regenerated, and the lines between them are replaced.
#[test]
fn regenerating_keeps_a_block_s_elisions() {
    let r = redactions();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let old =
        s(&["$ runner run p.toml", "run p (aaaaaaaaaaaa): 2 ranks", "  ...", "  epoch 2/2  loss 0.5  0.1s", "  ..."]);
    let actual = s(&[
        "$ runner run p.toml",
        "run p (bbbbbbbbbbbb): 2 ranks",
        "  plan",
        "  epoch 1/2  loss 0.6  0.2s",
        "  epoch 2/2  loss 0.4  0.2s",
        "",
        "  table",
    ]);
    assert_eq!(
        regenerated(&old, &actual, &r),
        s(&["$ runner run p.toml", "run p (bbbbbbbbbbbb): 2 ranks", "  ...", "  epoch 2/2  loss 0.4  0.2s", "  ..."])
    );
}
