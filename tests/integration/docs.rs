//! The documentation's examples cannot rot: every TOML block and every `runner` command in
//! README.md and docs/ is checked against the real binary and the real command line.
//!
//! - A ```` ```toml ```` block is a pipeline file, checked with `runner validate`; one marked
//!   `fragment` (```` ```toml fragment ````) is part of one, read by the configuration's own
//!   types (unknown keys and wrong types fail); one marked `experiment` is an experiment file,
//!   loaded with every point of its grid planned; one marked `fails` must be refused (an example
//!   of an error). `file=NAME` writes the block to NAME for the page's later steps.
//! - Every `runner …` command, in code blocks and in prose, parses with the real command line,
//!   and every `--set` key exists. A command in a code block must name files that exist or that an
//!   earlier step of the same page made: a `file=` block, the `--out` of an earlier command (a
//!   `runner prepare` is run for real, so that its files are there), `results/` after a `runner
//!   run` or `sweep`, or a shell line ending in `# makes PATH`.
//! - Every key named in prose (`train.lr`) is in the configuration reference.
//! - Every relative link and `#anchor` resolves.
//! - docs/reference/configuration.md is what `runner schema --markdown` prints.
//!
//! The conventions are described in docs/development.md.
use crate::common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use clap::error::ErrorKind;
use clap::Parser;
use common::{pages, runner, text};
use runner::cli::{Cli, Command, PrepareCommand};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What a page holds, in order: code blocks, and the paragraphs of prose between them.
#[derive(Debug)]
enum Part {
    Code { info: String, body: String, line: usize },
    Prose { text: String, line: usize },
}

/// A fence line (CommonMark): three or more backticks, then an info string without backticks.
/// Returns the backticks' count and the info string.
fn fence(line: &str) -> Option<(usize, &str)> {
    let trimmed = line.trim_start();
    let ticks = trimmed.len() - trimmed.trim_start_matches('`').len();
    let info = &trimmed[ticks..];
    (ticks >= 3 && !info.contains('`')).then_some((ticks, info.trim()))
}

fn parts(md: &str) -> Vec<Part> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize, usize, Vec<String>)> = None; // info, indent, line, body
    let mut para: Option<(usize, String)> = None;
    for (i, raw) in md.lines().enumerate() {
        let line = i + 1;
        let trimmed = raw.trim_start();
        if let Some((info, indent, at, body)) = &mut open {
            if fence(raw).is_some_and(|(_, rest)| rest.is_empty()) {
                out.push(Part::Code { info: info.clone(), body: body.join("\n"), line: *at });
                open = None;
            } else {
                let cut = raw.len() - raw.trim_start().len();
                body.push(raw[cut.min(*indent)..].to_owned());
            }
            continue;
        }
        if let Some((_, info)) = fence(raw) {
            if let Some((at, text)) = para.take() {
                out.push(Part::Prose { text, line: at });
            }
            open = Some((info.to_owned(), raw.len() - trimmed.len(), line, Vec::new()));
            continue;
        }
        if trimmed.is_empty() {
            if let Some((at, text)) = para.take() {
                out.push(Part::Prose { text, line: at });
            }
        } else {
            let p = para.get_or_insert((line, String::new()));
            p.1.push_str(raw);
            p.1.push('\n');
        }
    }
    if let Some((_, _, at, _)) = open {
        panic!("the code block opened at line {at} is not closed");
    }
    if let Some((at, text)) = para {
        out.push(Part::Prose { text, line: at });
    }
    out
}

/// The `code spans` of a paragraph (single backticks; they may wrap over lines).
fn code_spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find('`') {
        let after = &rest[start..];
        let ticks = after.len() - after.trim_start_matches('`').len();
        let body = &after[ticks..];
        let close = "`".repeat(ticks);
        match body.find(&close) {
            Some(end) => {
                out.push(body[..end].split_whitespace().collect::<Vec<_>>().join(" "));
                rest = &body[end + ticks..];
            }
            None => break,
        }
    }
    out
}

/// A shell line's words, with quotes removed (enough of sh for the docs' commands).
fn words(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quote, mut any) = (Vec::new(), String::new(), None::<char>, false);
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '\'' | '"') => (quote, any) = (Some(c), true),
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') | (None, '\\') => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            (None, c) if c.is_whitespace() => {
                if any || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            (_, c) => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

const SUBCOMMANDS: &[&str] =
    &["run", "validate", "data", "sweep", "report", "bench", "predict", "eval", "export", "prepare", "schema"];

/// The `runner` commands in a line of shell (joined by `&&` or `;`), each as its arguments after
/// `runner`; a comment, a pipe or a redirection cut off.
fn runner_commands(line: &str) -> Vec<Vec<String>> {
    let line = line.trim().trim_start_matches("$ ");
    let line = line.split(" #").next().unwrap_or_default();
    // A line of output that quotes a command after `; ` is not a command line.
    if runner_command(line.split(" && ").next().unwrap_or_default()).is_none() && !line.starts_with("./") {
        return Vec::new();
    }
    line.split(" && ").flat_map(|part| part.split("; ")).filter_map(runner_command).collect()
}

/// The `runner` command of one simple shell command, as its arguments after `runner`.
fn runner_command(command: &str) -> Option<Vec<String>> {
    let mut cut = command.len();
    for stop in [" | ", " > ", " 2>"] {
        if let Some(at) = command.find(stop) {
            cut = cut.min(at);
        }
    }
    let line = &command[..cut];
    let w = words(line);
    // A command line starts with the command or a launcher of it; any other line of a block
    // (a message, a log line) is output that may quote a command in passing.
    let first = w.first()?;
    let launcher = ["srun", "exec", "torchrun", "cargo", "time", "nohup", "env", "sudo"].contains(&first.as_str())
        || first.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_' || c.is_ascii_digit())
        });
    if !(launcher || first == "runner" || first.ends_with("/runner")) {
        return None;
    }
    let at = w
        .iter()
        .position(|x| x == "runner" || x.ends_with("/runner") || x == "--" && w.iter().any(|y| y == "cargo"))?;
    let args: Vec<String> = w[at + 1..].to_vec();
    if !SUBCOMMANDS.contains(&args.first()?.as_str()) {
        return None;
    }
    // `...` stands for arguments the text leaves out.
    Some(args.into_iter().filter(|a| a != "..." && a != "…").collect())
}

/// A path in a command that stands for one the reader chooses: `<run-id>`, `RUN_DIR`, `DIR`.
fn placeholder(p: &Path) -> bool {
    let s = p.to_string_lossy();
    s.contains('<')
        || s.contains('*')
        || p.components().any(|c| {
            let c = c.as_os_str().to_string_lossy();
            c.len() > 1 && c.chars().all(|ch| ch.is_ascii_uppercase() || ch == '_' || ch.is_ascii_digit())
        })
}

/// Keys of the configuration reference, and the tables above them.
fn known_keys() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for k in runner::config::reference::keys() {
        let path = k.path.replace("[]", "");
        let parts: Vec<&str> = path.split('.').collect();
        for i in 1..=parts.len() {
            out.insert(parts[..i].join("."));
        }
    }
    out
}

const SECTIONS: &[&str] =
    &["run", "load", "shard", "normalize", "wrap", "train", "validate", "trace", "checkpoint", "track"];
const FILE_ENDINGS: &[&str] = &[
    "py",
    "md",
    "toml",
    "rs",
    "bin",
    "json",
    "txt",
    "parquet",
    "csv",
    "log",
    "npy",
    "npz",
    "pt",
    "png",
    "sh",
    "safetensors",
    "lock",
    "tmp",
    "pkl",
];

/// A key named in prose: `train.lr`, `train.lr = 0.1`, `[train.schedule]`; not a file such as
/// `train.py` or `run.log`.
fn key_in_span(span: &str) -> Option<String> {
    let s = span.trim_matches(|c| c == '[' || c == ']');
    let key = s.split(|c: char| c == '=' || c.is_whitespace()).next()?.trim_matches(|c| c == '[' || c == ']');
    let (section, rest) = key.split_once('.')?;
    if !SECTIONS.contains(&section) || rest.is_empty() || key.contains('/') {
        return None;
    }
    if !key.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.') {
        return None;
    }
    if FILE_ENDINGS.contains(&key.rsplit('.').next().unwrap()) {
        return None;
    }
    Some(key.to_owned())
}

/// The page's sandbox: a folder with the repository's committed folders linked in, where the
/// page's files are written and its `runner prepare` steps run.
struct Sandbox {
    dir: tempfile::TempDir,
    made: Vec<PathBuf>,
}

impl Sandbox {
    fn new() -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        for entry in ["pipelines", "experiments", "tests", "scripts", "benches", "results", "docs", "src", "README.md"]
        {
            std::os::unix::fs::symlink(root().join(entry), dir.path().join(entry)).unwrap();
        }
        Sandbox { dir, made: Vec::new() }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn exists(&self, p: &Path) -> bool {
        self.path().join(p).exists() || self.made.iter().any(|m| p.starts_with(m))
    }

    /// Writes a `file=` block; a block naming a file of the repository must be that file, as
    /// shipped (the page quotes it).
    fn write(&mut self, name: &str, body: &str) -> Result<PathBuf, String> {
        let path = self.path().join(name);
        if path.exists() {
            let shipped = std::fs::read_to_string(&path).unwrap_or_default();
            if shipped.trim_end() != body.trim_end() {
                return Err(format!("`file={name}` differs from the file of that name in the repository"));
            }
            return Ok(path);
        }
        let parent = path.parent().unwrap();
        std::fs::create_dir_all(parent).unwrap();
        if !parent.canonicalize().unwrap().starts_with(self.path().canonicalize().unwrap()) {
            return Err(format!("`file={name}` is not a file of the repository: name a new file outside its folders"));
        }
        std::fs::write(&path, body).unwrap();
        Ok(path)
    }
}

/// Checks one page; returns its problems, each with the page and line.
fn check_page(page: &Path, keys: &BTreeSet<String>, anchors: &HashMap<PathBuf, BTreeSet<String>>) -> Vec<String> {
    let shown = page.strip_prefix(root()).unwrap_or(page).display().to_string();
    let md = std::fs::read_to_string(page).unwrap();
    let mut problems = Vec::new();
    let mut sandbox = Sandbox::new();
    let mut snippet = 0;
    for part in parts(&md) {
        match part {
            Part::Prose { text, line } => {
                for span in code_spans(&text) {
                    if let Some(key) = key_in_span(&span) {
                        if !keys.contains(&key) {
                            problems
                                .push(format!("{shown}:{line}: `{key}` is not a key of the configuration reference"));
                        }
                    }
                    // Prose names commands in part (`runner run --resume DIR`, `runner validate`):
                    // what it gives must parse, and what it leaves out may be missing.
                    if span.starts_with("runner ") {
                        for args in runner_commands(&span) {
                            match Cli::try_parse_from(std::iter::once("runner".to_owned()).chain(args.iter().cloned()))
                            {
                                Err(e)
                                    if !matches!(
                                        e.kind(),
                                        ErrorKind::MissingRequiredArgument
                                            | ErrorKind::MissingSubcommand
                                            | ErrorKind::InvalidValue
                                            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                                            | ErrorKind::DisplayHelp
                                            | ErrorKind::DisplayVersion
                                    ) =>
                                {
                                    let first = e.to_string().lines().next().unwrap_or_default().to_owned();
                                    problems.push(format!("{shown}:{line}: `{span}`: {first}"))
                                }
                                _ => {}
                            }
                        }
                    }
                }
                problems.extend(check_links(page, &text, line, anchors).into_iter().map(|p| format!("{shown}:{p}")));
            }
            Part::Code { info, body, line } => {
                let mut info_words = info.split_whitespace();
                let lang = info_words.next().unwrap_or("");
                let flags: Vec<&str> = info_words.collect();
                let file = flags.iter().find_map(|f| f.strip_prefix("file="));
                if lang == "toml" {
                    snippet += 1;
                    let name = file.map(str::to_owned).unwrap_or_else(|| format!("snippet-{snippet}.toml"));
                    let path = match sandbox.write(&name, &body) {
                        Ok(p) => p,
                        Err(e) => {
                            problems.push(format!("{shown}:{line}: {e}"));
                            continue;
                        }
                    };
                    sandbox.made.push(PathBuf::from(&name));
                    let checked = if flags.contains(&"fragment") {
                        runner::config::resolve(&path, &[]).map(|_| ()).map_err(|e| format!("{e:#}"))
                    } else if flags.contains(&"experiment") {
                        runner::sweep::Experiment::load(&path)
                            .and_then(|e| e.points().map(|_| ()))
                            .map_err(|e| format!("{e:#}"))
                    } else {
                        let o = runner().args(["validate", &name]).current_dir(sandbox.path()).output().unwrap();
                        let (out, err) = text(&o);
                        if o.status.success() {
                            Ok(())
                        } else {
                            Err(format!("runner validate {name} failed:\n{out}{err}"))
                        }
                    };
                    match (checked, flags.contains(&"fails")) {
                        (Err(e), false) => problems.push(format!(
                            "{shown}:{line}: this TOML block does not check (a pipeline unless marked `fragment` or \
                             `experiment`): {e}"
                        )),
                        (Ok(()), true) => {
                            problems.push(format!("{shown}:{line}: this TOML block is marked `fails`, but it checks"))
                        }
                        _ => {}
                    }
                    continue;
                }
                if !["", "sh", "console", "bash", "shell"].contains(&lang) {
                    continue;
                }
                for (i, shell) in body.lines().enumerate() {
                    let at = line + 1 + i;
                    if let Some(made) = shell.split("# makes ").nth(1).and_then(|m| m.split_whitespace().next()) {
                        sandbox.made.push(PathBuf::from(made.trim_end_matches([':', ','])));
                    }
                    // Output lines in a `$ command` block are not commands.
                    if body.lines().any(|l| l.starts_with("$ ")) && !shell.starts_with("$ ") {
                        continue;
                    }
                    for args in runner_commands(shell) {
                        match parse(&args, keys) {
                            Err(e) => problems.push(format!("{shown}:{at}: `{}`: {e}", shell.trim())),
                            Ok(None) => {}
                            Ok(Some(cli)) => {
                                for missing in files_of(&cli, &mut sandbox) {
                                    problems.push(format!(
                                        "{shown}:{at}: `{}` names {}, which neither exists nor is made by an earlier \
                                         step of this page",
                                        shell.trim(),
                                        missing.display()
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    problems
}

/// The command as the binary parses it, and its `--set` keys checked; `None` for `--help`.
fn parse(args: &[String], keys: &BTreeSet<String>) -> Result<Option<Cli>, String> {
    let cli = match Cli::try_parse_from(std::iter::once("runner".to_owned()).chain(args.iter().cloned())) {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => return Ok(None),
        Err(e) => return Err(e.to_string().lines().next().unwrap_or_default().to_owned()),
    };
    let sets: &[String] = match &cli.command {
        Command::Run(a) => &a.set,
        Command::Validate(runner::cli::ValidateArgs { config: a, .. })
        | Command::Data(runner::cli::DataArgs { config: a, .. }) => &a.set,
        _ => &[],
    };
    for set in sets {
        // `~key` removes a key (Hydra's spelling).
        let key = set.split('=').next().unwrap_or_default().trim_start_matches('~');
        if !keys.contains(key) {
            return Err(format!("--set {key}: not a key of the configuration reference"));
        }
    }
    Ok(Some(cli))
}

/// The files a parsed command reads that are missing; records what it makes.
fn files_of(cli: &Cli, sandbox: &mut Sandbox) -> Vec<PathBuf> {
    let (reads, makes): (Vec<&PathBuf>, Vec<&PathBuf>) = match &cli.command {
        Command::Run(a) => (a.file.iter().chain(&a.resume).collect(), a.out.iter().collect()),
        Command::Validate(runner::cli::ValidateArgs { config: a, .. })
        | Command::Data(runner::cli::DataArgs { config: a, .. }) => (vec![&a.file], vec![]),
        Command::Sweep(a) => (vec![&a.file], a.out.iter().collect()),
        Command::Report(a) => (vec![&a.dir], vec![]),
        Command::Predict(a) => (std::iter::once(&a.run_dir).chain(&a.data).collect(), a.out.iter().collect()),
        Command::Eval(a) => (a.run_dir.iter().chain(&a.data).collect(), vec![]),
        Command::Prepare(PrepareCommand::Text { file, out, .. }) => (vec![file], vec![out]),
        Command::Export(a) => (vec![&a.run_dir], a.hf.iter().chain(&a.peft).collect()),
        Command::Schema(_) | Command::Bench(_) => (vec![], vec![]),
    };
    let missing: Vec<PathBuf> = reads.into_iter().filter(|p| !placeholder(p) && !sandbox.exists(p)).cloned().collect();
    if missing.is_empty() {
        if let Command::Prepare(PrepareCommand::Text { file, out, tokenizer, vocab, .. }) = &cli.command {
            // Run for real: a later pipeline of the page reads what it makes.
            let o = runner()
                .args(["prepare", "text"])
                .arg(file)
                .arg("--out")
                .arg(out)
                .args(["--tokenizer", tokenizer])
                .args(vocab.iter().flat_map(|v| ["--vocab".to_owned(), v.to_string()]))
                .current_dir(sandbox.path())
                .output()
                .unwrap();
            assert!(o.status.success(), "runner prepare text failed: {:?}", text(&o));
        }
    }
    sandbox.made.extend(makes.into_iter().cloned());
    if matches!(cli.command, Command::Run(_) | Command::Sweep(_)) {
        sandbox.made.push(PathBuf::from("results"));
    }
    missing
}

/// The anchors of every page: GitHub's, from headings (duplicates numbered), and `<a id>`.
fn anchors() -> HashMap<PathBuf, BTreeSet<String>> {
    let mut out = HashMap::new();
    for page in pages() {
        let md = std::fs::read_to_string(&page).unwrap();
        let mut set = BTreeSet::new();
        let mut fence_open = false;
        for line in md.lines() {
            if let Some((_, info)) = fence(line) {
                // Any fence opens a block; only a bare one closes it.
                if !fence_open || info.is_empty() {
                    fence_open = !fence_open;
                }
            }
            if fence_open {
                continue;
            }
            if let Some(h) = line.strip_prefix('#').filter(|_| line.starts_with('#')) {
                let heading = h.trim_start_matches('#');
                if heading.starts_with(' ') {
                    let base = runner::config::reference::anchor(heading);
                    let (mut name, mut n) = (base.clone(), 0);
                    while set.contains(&name) {
                        n += 1;
                        name = format!("{base}-{n}");
                    }
                    set.insert(name);
                }
            }
            for id in line.split("<a id=\"").skip(1) {
                set.insert(id.split('"').next().unwrap().to_owned());
            }
        }
        out.insert(page, set);
    }
    out
}

/// The relative links of a paragraph that do not resolve.
fn check_links(page: &Path, text: &str, line: usize, anchors: &HashMap<PathBuf, BTreeSet<String>>) -> Vec<String> {
    let mut bad = Vec::new();
    for piece in text.split("](").skip(1) {
        let Some(target) = piece.split(')').next() else { continue };
        let target = target.split_whitespace().next().unwrap_or_default();
        if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
            continue;
        }
        let (path, anchor) = target.split_once('#').map_or((target, None), |(p, a)| (p, Some(a)));
        let file = if path.is_empty() { page.to_path_buf() } else { page.parent().unwrap().join(path) };
        let Ok(file) = file.canonicalize() else {
            bad.push(format!("{line}: the link {target} names a file that does not exist"));
            continue;
        };
        if let Some(anchor) = anchor {
            match anchors.get(&file) {
                Some(set) if set.contains(anchor) => {}
                Some(_) => bad.push(format!("{line}: the link {target}: no heading or anchor #{anchor} there")),
                None => bad.push(format!("{line}: the link {target}: an anchor into a file that is not a page")),
            }
        }
    }
    bad
}

#[test]
fn every_example_command_key_and_link_of_the_docs_checks() {
    let keys = known_keys();
    let anchors: HashMap<PathBuf, BTreeSet<String>> =
        anchors().into_iter().map(|(p, a)| (p.canonicalize().unwrap(), a)).collect();
    let mut problems = Vec::new();
    for page in pages() {
        problems.extend(check_page(&page, &keys, &anchors));
    }
    assert!(problems.is_empty(), "{} problems in the docs:\n{}", problems.len(), problems.join("\n"));
}

#[test]
fn the_configuration_reference_is_what_runner_schema_markdown_prints() {
    let o = runner().args(["schema", "--markdown"]).output().unwrap();
    assert!(o.status.success(), "{:?}", text(&o));
    let generated = text(&o).0;
    let committed = std::fs::read_to_string(root().join("docs/reference/configuration.md")).unwrap();
    assert!(
        generated.trim_end() == committed.trim_end(),
        "docs/reference/configuration.md is not current: run\n  cargo run -- schema --markdown > docs/reference/configuration.md"
    );
}

/// The checks above can fail: a snippet that does not validate, an unknown key in prose, a
/// command that does not parse, a missing file and a broken link are each found.
#[test]
fn the_checks_find_each_kind_of_rot() {
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("page.md");
    std::fs::write(
        &page,
        "# Page\n\nSee `train.lrr` and [there](missing.md) and [here](#nowhere), and `runner run --bogus x`.\n\n\
         ```toml\n[train]\nlr = \"fast\"\n```\n\n```\nrunner validate nowhere.toml\n```\n",
    )
    .unwrap();
    let anchors: HashMap<PathBuf, BTreeSet<String>> =
        HashMap::from([(page.canonicalize().unwrap(), BTreeSet::from(["page".to_owned()]))]);
    let problems = check_page(&page, &known_keys(), &anchors).join("\n");
    for expected in [
        "`train.lrr` is not a key",
        "missing.md names a file that does not exist",
        "no heading or anchor #nowhere",
        "--bogus",
        "this TOML block does not check",
        "names nowhere.toml, which neither exists",
    ] {
        assert!(problems.contains(expected), "not found: {expected}\nin:\n{problems}");
    }
}
