//! `runner sweep` of an experiment with a `[search]` table, end to end: TPE under ASHA on a tiny
//! pipeline (each trial real rank processes), its reproducibility whatever the parallelism, a
//! promoted trial against an uninterrupted run, a search killed mid-rung and resumed, the report
//! rebuilt from the traces, the refusals, and the committed example checked bit for bit.
use crate::common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{assert_ok, copy_tree, run, runner, text, trace, write};
use runner::sweep::check::compare;

/// One rank of one thread, 1800 optimizer steps at most, a cosine schedule with warmup (which
/// ASHA pins to the full budget), a checkpoint every 100 steps (a promoted trial is then killed
/// between two of them).
const PIPELINE: &str = r#"
[run]
name = "tiny"
seed = 3
world_size = 1
threads_per_rank = 1
timeout_s = 60

[load]
rows = 600
features = 5
classes = 3
validation_rows = 100

[wrap.model]
hidden = [16]

[train]
steps = 1800
batch_size = 16

[train.schedule]
kind = "cosine"
warmup_steps = 50

[checkpoint]
every_steps = 100
"#;

/// TPE (random for its first 3, each trial proposed from the results of the trials before it
/// but two) over 6 trials; ASHA at 600 and 1800 steps: two trials are promoted.
fn experiment(parallel: usize) -> String {
    format!(
        r#"
pipeline = "p.toml"

[search]
method = "tpe"
startup_trials = 3
lag = 2
trials = 6
metric = "val_loss"
seed = 7
parallel = {parallel}
scheduler = "asha"
min_steps = 600
reduction_factor = 3

[search.space]
"train.lr" = {{ log_uniform = [0.01, 1.0] }}
"wrap.model.hidden" = {{ choice = [[8], [16, 16]] }}
"#
    )
}

fn setup(parallel: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", PIPELINE);
    write(dir.path(), "e.toml", &experiment(parallel));
    dir
}

/// Each trial's row of summary.parquet (table.csv's frame): its name, its value at each rung
/// (600 and 1800 steps), its status.
fn rows(sweep: &Path) -> Vec<(String, Option<f64>, Option<f64>, String)> {
    use polars::prelude::{ParquetReader, SerReader};
    let file = std::fs::File::open(sweep.join("summary.parquet")).expect("summary.parquet");
    let frame = ParquetReader::new(file).finish().unwrap();
    let text = |name: &str| frame.column(name).unwrap().str().unwrap().clone();
    let value = |name: &str| frame.column(name).unwrap().f64().unwrap().clone();
    let (trial, status) = (text("trial"), text("status"));
    let (at600, at1800) = (value("val_loss_at_600"), value("val_loss_at_1800"));
    (0..frame.height())
        .map(|i| (trial.get(i).unwrap().to_owned(), at600.get(i), at1800.get(i), status.get(i).unwrap().to_owned()))
        .collect()
}

/// The search run once, one trial at a time, for the tests that compare with it.
fn reference() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = setup(1);
        let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
        assert_ok(&o);
        dir
    })
    .path()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn trials(sweep: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(sweep)
        .into_iter()
        .flatten()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("trial-"))
        .collect();
    out.sort();
    out
}

/// Every non-timing trace value of two runs is the same, but the run id (with `same_id`).
fn assert_same_trace(a: &Path, b: &Path, same_id: bool) {
    let (mut x, mut y) = (trace(a), trace(b));
    if !same_id {
        x = x.drop("run_id").unwrap();
        y = y.drop("run_id").unwrap();
    }
    let (differences, _) = compare(&x, &y, None);
    assert!(differences.is_empty(), "{} and {} differ:\n{}", a.display(), b.display(), differences.join("\n"));
}

#[test]
fn the_same_seed_gives_the_same_trials_promotions_and_table_with_one_or_three_at_a_time() {
    let one = reference().join("s");
    let dir = setup(3);
    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&o);
    let three = dir.path().join("s");
    for file in ["table.md", "table.csv", "sweep.json", "best.toml"] {
        assert_eq!(read(&one.join(file)), read(&three.join(file)), "{file}");
    }
    let table = read(&one.join("table.md"));
    assert!(table.contains("6 of 6 trials run: 2 complete, 4 stopped early, 0 failed"), "{table}");
    assert_eq!(table.matches("stopped at rung 0").count(), 4, "{table}");
    assert_eq!(trials(&one).len(), 6);
    for (a, b) in trials(&one).iter().zip(trials(&three)) {
        assert_same_trace(a, &b, true);
    }
    // Three at a time: some trial started while others ran.
    let (out, _) = text(&o);
    let started = out.lines().position(|l| l.contains("trial-002 → rung 0 (600 steps): starts")).unwrap();
    let first_done = out.lines().position(|l| l.contains("(600 steps): val_loss")).unwrap();
    assert!(started < first_done, "{out}");
}

/// `scheduler = "sha"`: nothing is promoted until the whole first rung is in, then the best
/// third of all six trials (ASHA compares each with the trials that entered before it), three at
/// a time. (`--check` of a search: `the_committed_search_reproduces`.)
#[test]
fn successive_halving_promotes_the_best_of_the_whole_rung_once_it_is_in() {
    let dir = setup(3);
    let file = experiment(3).replace("scheduler = \"asha\"", "scheduler = \"sha\"");
    write(dir.path(), "e.toml", &file);
    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(out.contains("successive halving at 600, 1800 steps (reduction factor 3), 3 at a time"), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    let last_rung0 = lines.iter().rposition(|l| l.contains("(600 steps): val_loss")).unwrap();
    let first_rung1 = lines.iter().position(|l| l.contains("→ rung 1 (1800 steps): continues")).unwrap();
    assert!(last_rung0 < first_rung1, "a promotion before the rung was whole:\n{out}");
    let sweep = dir.path().join("s");
    let rows = rows(&sweep);
    let mut by_loss: Vec<&(String, Option<f64>, Option<f64>, String)> = rows.iter().collect();
    by_loss.sort_by(|a, b| a.1.unwrap().total_cmp(&b.1.unwrap()));
    for (i, (name, _, at1800, status)) in by_loss.iter().enumerate() {
        assert_eq!(at1800.is_some(), i < 2, "{name} ({status}): the best two of six go on\n{rows:?}");
        assert_eq!(status.contains("stopped at rung 0"), i >= 2, "{name}: {status}");
    }
    let table = read(&sweep.join("table.md"));
    assert!(table.contains("successive halving with rungs at 600, 1800 steps"), "{table}");
    let config = read(&sweep.join(&by_loss[0].0).join("config.toml"));
    assert!(config.contains("decay_end = 1799  # search [sha]"), "{config}");
}

/// The first trial that reached the full budget was run to 600 steps, then resumed to 1800 from
/// its checkpoint: its trace and its model are those of one run of 1800 steps.
#[test]
fn a_promoted_trial_equals_an_uninterrupted_run_of_its_budget() {
    let sweep = reference().join("s");
    let csv = read(&sweep.join("table.csv"));
    let promoted = csv.lines().find(|l| l.contains(",1800,") && l.contains("complete")).expect("a complete trial");
    let name = promoted.split(',').next().unwrap();
    let trial = sweep.join(name);
    let log = read(&trial.join("run.log"));
    assert!(log.contains("resuming run"), "{log}");
    let config = read(&trial.join("config.toml"));
    assert!(config.contains("decay_end = 1799  # search [asha]"), "{config}");
    // The trial's own configuration, to its full budget, as one run.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", PIPELINE);
    let mut args = vec!["run".to_owned(), "p.toml".into(), "--out".into(), "u".into()];
    for line in config.lines().filter(|l| l.contains("# search [")) {
        let (assignment, _) = line.split_once("  # ").unwrap();
        let (key, value) = assignment.split_once(" = ").unwrap();
        let section = config[..config.find(line).unwrap()].rsplit("\n[").next().unwrap().split(']').next().unwrap();
        args.extend(["--set".to_owned(), format!("{section}.{key}={value}")]);
    }
    assert!(args.contains(&"train.steps=1800".to_owned()), "{args:?}");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_ok(&run(&args, dir.path()));
    let whole = dir.path().join("u");
    assert_same_trace(&trial, &whole, false);
    let tensors = |p: &Path| -> Vec<(String, Vec<u8>)> {
        let bytes = std::fs::read(p.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut all: Vec<(String, Vec<u8>)> = st.tensors().into_iter().map(|(n, v)| (n, v.data().to_vec())).collect();
        all.sort();
        all
    };
    let (a, b) = (tensors(&trial), tensors(&whole));
    assert!(!a.is_empty());
    assert_eq!(a, b, "every tensor of model.safetensors");
    // best.toml is a pipeline that trains the best trial again.
    let best = read(&sweep.join("best.toml"));
    assert!(best.contains("extends = \"../p.toml\"") && best.contains("steps = 1800"), "{best}");
    assert_ok(&run(&["validate", "s/best.toml"], reference()));
}

#[test]
fn a_search_killed_mid_rung_resumes_and_ends_with_the_uninterrupted_table() {
    use nix::sys::signal::{kill, Signal};
    let dir = setup(1);
    let s = dir.path().join("s");
    let mut sweep = runner()
        .args(["sweep", "e.toml", "--out", "s"])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Killed once a promoted trial has a checkpoint past its first rung, before its last.
    let deadline = Instant::now() + Duration::from_secs(120);
    let victim = loop {
        let mid = trials(&s).into_iter().find(|t| {
            let names: Vec<String> = std::fs::read_dir(t.join("checkpoints"))
                .into_iter()
                .flatten()
                .filter_map(|e| e.ok())
                .filter(|e| e.path().join("index.json").is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.iter().any(|n| n.as_str() > "step-00000600") && !names.iter().any(|n| n == "step-00001800")
        });
        if let Some(t) = mid {
            break t;
        }
        assert!(Instant::now() < deadline && sweep.try_wait().unwrap().is_none(), "no trial was promoted in time");
        std::thread::sleep(Duration::from_millis(10));
    };
    kill(nix::unistd::Pid::from_raw(sweep.id() as i32), Signal::SIGKILL).unwrap();
    sweep.wait().unwrap();
    // The trial's launcher dies with the sweep (PR_SET_PDEATHSIG) and marks the run interrupted.
    let stopped = Instant::now();
    while runner::rundir::lock::holder(&victim).is_some() {
        assert!(stopped.elapsed() < Duration::from_secs(20), "{} stays locked", victim.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let manifest = read(&victim.join("manifest.json"));
    assert!(manifest.contains("\"status\": \"interrupted\""), "{manifest}");
    let finished: Vec<String> = trials(&s)
        .iter()
        .filter(|t| read(&t.join("manifest.json")).contains("\"status\": \"complete\""))
        .map(|t| t.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(!finished.is_empty());

    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&o);
    let (out, _) = text(&o);
    let name = victim.file_name().unwrap().to_string_lossy();
    assert!(out.contains(&format!("{name} → rung 1 (1800 steps): continues")), "{out}");
    for t in &finished {
        assert!(!out.contains(&format!("{t} → rung 0 (600 steps): starts")), "{t} ran again:\n{out}");
    }
    let reference = reference().join("s");
    for file in ["table.md", "table.csv", "sweep.json"] {
        assert_eq!(read(&reference.join(file)), read(&s.join(file)), "{file}");
    }
    for (a, b) in trials(&reference).iter().zip(trials(&s)) {
        assert_same_trace(a, &b, true);
    }
}

/// Killed after a promoted trial's last trace row, before its final checkpoint and model: the
/// rung is not done (its model is the first rung's), and the rerun finishes it.
#[test]
fn a_search_killed_before_a_promoted_trial_s_final_checkpoint_finishes_that_trial() {
    use nix::sys::signal::{kill, Signal};
    let dir = setup(1);
    let (s, stalled) = (dir.path().join("s"), dir.path().join("stalled"));
    // The first trial to reach the checkpoint of step 1800 stops for good in it, once.
    let mut sweep = runner()
        .args(["sweep", "e.toml", "--out", "s"])
        .env("RUNNER_TEST_STALL_CHECKPOINT", format!("0:1800@{}", stalled.display()))
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    while !stalled.exists() {
        assert!(Instant::now() < deadline && sweep.try_wait().unwrap().is_none(), "no trial reached step 1800");
        std::thread::sleep(Duration::from_millis(10));
    }
    let victim = trials(&s)
        .into_iter()
        .find(|t| {
            std::fs::read_dir(t.join("checkpoints"))
                .unwrap()
                .any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".step-00001800"))
        })
        .expect("the trial writing its checkpoint of step 1800");
    kill(nix::unistd::Pid::from_raw(sweep.id() as i32), Signal::SIGKILL).unwrap();
    sweep.wait().unwrap();
    let stopped = Instant::now();
    while runner::rundir::lock::holder(&victim).is_some() {
        assert!(stopped.elapsed() < Duration::from_secs(20), "{} stays locked", victim.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let steps = trace(&victim).column("step").unwrap().cast(&polars::prelude::DataType::UInt64).unwrap();
    let last = (0..steps.len()).filter_map(|i| steps.u64().unwrap().get(i)).max();
    assert_eq!(last, Some(1800), "the trace's last row is written");

    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&o);
    let (out, _) = text(&o);
    let name = victim.file_name().unwrap().to_string_lossy();
    assert!(out.contains(&format!("{name} → rung 1 (1800 steps): continues")), "{out}");
    assert!(read(&victim.join("manifest.json")).contains("\"status\": \"complete\""));
    let reference = reference().join("s");
    for file in ["table.md", "table.csv"] {
        assert_eq!(read(&reference.join(file)), read(&s.join(file)), "{file}");
    }
}

/// `--check` compares each trial's model too: one whose trace is the rerun's but whose weights
/// are not is a difference.
#[test]
fn check_of_a_search_finds_a_model_that_differs_where_the_traces_agree() {
    let dir = tempfile::tempdir().unwrap();
    common::copy_tree(reference(), dir.path());
    let s = dir.path().join("s");
    let model = trials(&s).into_iter().map(|t| t.join("model.safetensors")).find(|m| m.is_file()).unwrap();
    let mut bytes = std::fs::read(&model).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&model, bytes).unwrap();
    let o = run(&["sweep", "e.toml", "--out", "s", "--check"], dir.path());
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    assert!(format!("{out}{err}").contains("model.safetensors: `"), "{out}{err}");
    assert!(format!("{out}{err}").contains("differs between the stored model and the rerun's"), "{out}{err}");
}

#[test]
fn report_rebuilds_the_search_from_its_traces() {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("s");
    copy_tree(&reference().join("s"), &copy);
    let written =
        ["table.md", "table.csv", "summary.parquet", "best.toml", "search_progress.png", "search_parameters.png"];
    for f in written {
        std::fs::remove_file(copy.join(f)).unwrap();
    }
    let o = run(&["report", "s"], dir.path());
    assert_ok(&o);
    for f in ["table.md", "table.csv", "best.toml"] {
        assert_eq!(read(&copy.join(f)), read(&reference().join("s").join(f)), "{f}");
    }
    for f in written {
        assert!(copy.join(f).is_file(), "{f}");
    }
}

/// Each refusal: its message, exit code 2, and nothing run.
#[test]
fn bad_searches_are_refused_naming_the_key_and_the_line() {
    let lr = "\"train.lr\" = { log_uniform = [0.001, 0.1] }";
    let cases: [(&str, &str, &str); 8] = [
        (
            "trials = 5\nmetric = \"val_loss\"",
            "\"train.lr\" = { uniform = [0.1, 0.01] }",
            "e.toml:8: [search.space] `train.lr`: uniform = [0.1, 0.01]: low (0.1) must be below high (0.01)",
        ),
        (
            "trials = 5\nmetric = \"val_loss\"",
            "\"train.lr\" = { log_uniform = [0.0, 0.1] }",
            "e.toml:8: [search.space] `train.lr`: log_uniform = [0.0, 0.1]: a log scale needs bounds above 0, got 0.0",
        ),
        (
            "trials = 5\nmetric = \"val_los\"",
            lr,
            "e.toml:5: metric = \"val_los\" is not a column of the trace: did you mean `val_loss`? (the metrics: ",
        ),
        (
            "trials = 5\nmetric = \"val_loss\"\nscheduler = \"asha\"",
            lr,
            "e.toml:6: scheduler = \"asha\" needs a budget: min_steps (optimizer steps) or min_epochs, the first \
             rung's, and max_steps or max_epochs, the full one (default: the pipeline's train.steps or train.epochs)",
        ),
        (
            "trials = 5\nmetric = \"val_loss\"\nscheduler = \"sha\"\nmax_steps = 90",
            lr,
            "e.toml:6: scheduler = \"sha\" needs a budget: min_steps (optimizer steps) or min_epochs",
        ),
        (
            "trials = 5\nmetric = \"val_loss\"\nscheduler = \"asha\"\nmin_steps = 10\nreduction_factor = 1",
            lr,
            "e.toml:8: reduction_factor = 1: must be at least 2 (each rung promotes 1/reduction_factor of its trials)",
        ),
        (
            "method = \"random\"\ntrials = 5\nmetric = \"val_loss\"",
            "\"wrap.model.hidden\" = { choice = [[8], [16]] }\n\"train.optimizer\" = { choice = [\"sgd\", \"adam\"] }",
            "e.toml:5: trials = 5, but the space holds 4 points (integers and choices only) and random search draws \
             each at most once: give trials ≤ 4, or run every point as a grid with [sweep]",
        ),
        (
            "trials = 100000000000\nmetric = \"val_loss\"",
            lr,
            "e.toml:4: trials = 100000000000: at most 10000 at each point (each is a run directory of its own): give \
             fewer, or run several searches with other seeds",
        ),
    ];
    for (keys, space, message) in cases {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "p.toml", PIPELINE);
        let file = format!("pipeline = \"p.toml\"\n\n[search]\n{keys}\n\n[search.space]\n{space}\n");
        write(dir.path(), "e.toml", &file);
        let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{file}\n{err}");
        assert!(err.contains(message), "expected\n  {message}\nin\n{err}\nfor\n{file}");
        assert!(!dir.path().join("s").exists(), "nothing runs");
    }
}

/// results/search, committed with portable numerics: a rerun of the whole search reproduces it.
#[test]
fn the_committed_search_reproduces() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = runner().args(["sweep", "experiments/search.toml", "--check"]).current_dir(root).output().unwrap();
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(
        out.contains("trials reproduce results/search: every non-timing value of every trace is identical."),
        "{out}"
    );
}

/// A value the pipeline's plan refuses (a world size of 0, a learning rate below 0) is refused
/// before the first trial, each with its whole reason: a trial does not fail on it later.
#[test]
fn every_choice_and_range_end_is_planned_before_the_first_trial() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", PIPELINE);
    let space = "\"run.world_size\" = { choice = [0, 1] }\n\"train.lr\" = { uniform = [-0.5, 0.1] }\n";
    let file = format!("pipeline = \"p.toml\"\n\n[search]\nmethod = \"random\"\ntrials = 2\nmetric = \"val_loss\"\n\n[search.space]\n{space}");
    write(dir.path(), "e.toml", &file);
    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for line in [
        "e.toml: [search.space] gives 2 values that cannot run; nothing was run.",
        "  `run.world_size` = 0 (one of its choices) cannot run:\n    p.toml: invalid configuration:\n      \
         `run.world_size` (search [search.space] run.world_size=0): must be at least 1",
        "  `train.lr` = -0.5 (its low end) cannot run:",
    ] {
        assert!(err.contains(line), "expected\n{line}\nin\n{err}");
    }
    assert!(!dir.path().join("s").exists(), "nothing runs");
}

/// `direction` against the metric's own is accepted (the file may mean it), and the sweep's
/// first lines say so.
#[test]
fn a_direction_against_the_metric_is_said_before_the_search() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", PIPELINE);
    let file = "pipeline = \"p.toml\"\n\n[search]\ntrials = 3\nmetric = \"val_loss\"\ndirection = \"maximize\"\n\n\
                [search.space]\n\"train.lr\" = { log_uniform = [0.01, 0.1] }\n";
    write(dir.path(), "e.toml", file);
    // --check of a sweep never run: the plan is said, then nothing runs.
    let o = run(&["sweep", "e.toml", "--out", "s", "--check"], dir.path());
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}\n{err}");
    assert!(
        out.contains(
            "optimising val_loss (higher is better)\nnote: direction = \"maximize\" on val_loss, which is minimized by \
             default: the search keeps the trials with the highest val_loss\n"
        ),
        "{out}"
    );
}

/// table.md says which trial is best and why it is not the lowest value in the table; best.toml
/// names both commands that write it (`runner sweep` does, after the search, as `runner report`).
#[test]
fn the_report_explains_its_best_trial() {
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/search");
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&committed, &dir.path().join("search"));
    assert_ok(&run(&["report", "search"], dir.path()));
    let table = read(&dir.path().join("search/table.md"));
    assert!(
        table.contains(
            "The best is the lowest val_loss among the trials at the highest rung reached (9 epochs), not across the \
             table: a trial stopped at a lower rung shows its value after a shorter run.\n"
        ),
        "{table}"
    );
    let best = read(&dir.path().join("search/best.toml"));
    assert!(
        best.contains("as a pipeline file that `runner sweep` and `runner report` write\n# from the trials' traces:"),
        "{best}"
    );
    assert!(!best.contains("written by `runner report`"), "{best}");
}
