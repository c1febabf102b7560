//! The hostile corpus of issue 21: TorchScript modules that break a model's contract, weights
//! files whose headers lie, batch norm over one value per channel, edited `plan.json` files and a
//! training step that never ends. The modules and files are made by
//! tests/fixtures/make_hostile.py (torch and numpy of the tests' Python). Each case pins its
//! message and checks the exit code, that nothing panicked, printed libtorch's "Exception raised
//! from" or died of a signal, and that no manifest says `complete`.
use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use common::{reference_python, runner, text, write, TINY};

/// The corpus, made once per test in its own directory.
fn corpus() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/make_hostile.py");
    let o = std::process::Command::new(reference_python()).arg(script).arg(dir.path()).output().unwrap();
    assert!(o.status.success(), "make_hostile.py failed: {}", String::from_utf8_lossy(&o.stderr));
    dir
}

/// TINY training the module `module` (a file of the corpus).
fn with_module(module: &str) -> String {
    TINY.replace("[wrap.model]\nhidden = [16]", &format!("[wrap.model]\nkind = \"torchscript\"\npath = \"{module}\""))
}

/// What every refusal must be: `code`, `want` in stderr, no panic, no C++ text, no signal, and
/// no manifest under `dir` that says complete.
fn assert_refused(o: &Output, code: i32, want: &str, case: &str, dir: &Path) {
    let (out, err) = text(o);
    assert_eq!(o.status.code(), Some(code), "{case}: exit {:?}\n{out}\n{err}", o.status);
    assert!(err.contains(want), "{case}: {want:?} not in:\n{err}");
    for never in ["panicked", "Exception raised from", "stack backtrace", "__w/pytorch"] {
        assert!(!err.contains(never) && !out.contains(never), "{case}: {never:?} in:\n{err}");
    }
    assert!(!manifests(dir).iter().any(|m| m.contains("\"complete\"")), "{case}: a manifest says complete");
}

fn manifests(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p: PathBuf = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.file_name().is_some_and(|n| n == "manifest.json") {
                found.push(std::fs::read_to_string(p).unwrap_or_default());
            }
        }
    }
    found
}

fn runner_in(dir: &Path, args: &[&str]) -> Output {
    runner().args(args).current_dir(dir).output().unwrap()
}

#[test]
fn modules_that_break_the_contract_are_refused_on_the_plan() {
    let dir = corpus();
    let d = dir.path();
    let cases = [
        ("frozen.pt", "frozen.pt has no trainable parameter (2 frozen, requires_grad = False)"),
        ("detached.pt", "in training mode: its output has no gradient (detached, or computed without its parameters)"),
        ("int64.pt", "in training mode, returns Int64 values, not floats"),
        ("nan_out.pt", "in training mode, returns 48 NaN or infinite values"),
        ("nan_param.pt", "nan_param.pt: parameter `fc.weight` holds 1 NaN or infinite values"),
        ("two_rows.pt", "returns shape [2, 3] where the task needs [16, 3]"),
        (
            "raises_on_big_batches.pt",
            "fails on a batch of 16 rows of the data (shape [16, 5]) in training mode: RuntimeError: batches over 2 \
             rows are not supported",
        ),
    ];
    for (module, want) in cases {
        write(d, "p.toml", &with_module(module));
        let o = runner_in(d, &["validate", "p.toml"]);
        assert_refused(&o, 2, &format!("`wrap.model.path` (file p.toml:16): {module}"), module, d);
        assert_refused(&o, 2, want, module, d);
        let o = runner_in(d, &["run", "p.toml", "--out", "out"]);
        assert_refused(&o, 2, want, module, d);
    }
}

#[test]
fn a_module_that_never_returns_is_refused_within_run_timeout_s() {
    let dir = corpus();
    let d = dir.path();
    write(d, "p.toml", &with_module("hangs.pt").replace("timeout_s = 30", "timeout_s = 2"));
    let start = Instant::now();
    let o = runner_in(d, &["validate", "p.toml"]);
    let want = "hangs.pt did not return within run.timeout_s (2 s) in training mode on a batch of 16 rows";
    assert_refused(&o, 2, want, "hangs.pt", d);
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
}

#[test]
fn a_module_that_raises_in_a_rank_ends_the_run_with_one_line() {
    let dir = corpus();
    let d = dir.path();
    write(d, "p.toml", &with_module("raises_later.pt"));
    let o = runner_in(d, &["run", "p.toml", "--out", "out"]);
    let want = "failed on a batch of shape [16, 5] in training mode: RuntimeError: the module gave up";
    assert_refused(&o, 1, want, "raises_later.pt", d);
    assert!(text(&o).1.contains("during train, epoch 1, step 7"), "{}", text(&o).1);
    assert!(manifests(d).iter().any(|m| m.contains("\"failed\"")));
}

/// Both ranks stuck in a forward pass that never ends (no collective to time out): the launcher
/// names the step within the default step timeout (run.timeout_s here) plus abort_after_s.
#[test]
fn a_rank_stuck_in_a_training_step_is_named_and_the_run_fails() {
    let dir = corpus();
    let d = dir.path();
    write(d, "p.toml", &with_module("hangs_later.pt").replace("timeout_s = 30", "timeout_s = 3\nabort_after_s = 1"));
    let start = Instant::now();
    let o = runner_in(d, &["run", "p.toml", "--out", "out"]);
    let took = start.elapsed();
    // The default: 10 × the slowest step so far (which a loaded machine makes longer), at least 3 s.
    assert_refused(&o, 1, "rank 0 did not finish step 7 of epoch 1 in ", "hangs_later.pt", d);
    assert_refused(&o, 1, "(the default of run.step_timeout_s: 10 × the slowest step so far (", "default", d);
    assert!(took < Duration::from_secs(40), "took {took:?}");
    assert!(manifests(d).iter().any(|m| m.contains("\"failed\"")));

    // Set explicitly, the limit is run.step_timeout_s.
    let o = runner_in(d, &["run", "p.toml", "--out", "out2", "--set", "run.step_timeout_s=2"]);
    assert_refused(&o, 1, "did not finish step 7 of epoch 1 in 2 s (run.step_timeout_s)", "step_timeout_s", d);
}

#[test]
fn weights_files_whose_headers_lie_are_refused() {
    let dir = corpus();
    let d = dir.path();
    let cases = [
        (
            "init_truncated.npz",
            "init_truncated.npz: member `layer0.weight`: the header says shape [16, 5] (320 bytes), the data holds \
             312: it is truncated or its header lies",
        ),
        (
            "init_lying.npz",
            "init_lying.npz: member `layer1.bias`: shape [100000000] is 400000000 bytes, larger than any weight of \
             the model",
        ),
        (
            "init_lying.safetensors",
            "init_lying.safetensors: `layer0.weight` claims bytes 0..320 for shape [16000000, 5] of F32 (320000000 \
             bytes), the data holds 588 bytes: it is truncated or its header lies",
        ),
    ];
    for (file, want) in cases {
        write(d, "p.toml", &TINY.replace("[wrap.model]", &format!("[wrap]\ninit = \"{file}\"\n\n[wrap.model]")));
        let o = runner_in(d, &["validate", "p.toml"]);
        assert_refused(&o, 2, "`wrap.init` (file p.toml:", file, d);
        assert_refused(&o, 2, want, file, d);
    }
}

#[test]
fn batch_norm_over_one_value_per_channel_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = r#"
[run]
name = "bn"
world_size = 1
[load]
image = [1, 1, 1]
classes = 3
rows = 64
validation_rows = 16
[wrap.model]
kind = "cnn"
conv = [ { channels = 4, kernel = 1, padding = 0, batch_norm = true } ]
[train]
epochs = 1
batch_size = 1
"#;
    write(d, "p.toml", p);
    let want =
        "`train.batch_size` (file p.toml:15): a training batch holds 1 row and CNN 1×1×1 → 4×1×1 → 64-3 has batch \
                norm over 1 × 1 maps: one value per channel, from which batch norm cannot compute a variance \
                (PyTorch: \"Expected more than 1 value per channel when training\")";
    assert_refused(&runner_in(d, &["validate", "p.toml"]), 2, want, "batch 1", d);
    // An epoch's last batch of one row too (64 rows in batches of 3).
    let o = runner_in(d, &["run", "p.toml", "--out", "o", "--set", "train.batch_size=3"]);
    assert_refused(
        &o,
        2,
        "the last training batch of each epoch holds 1 row (a rank's 64 rows in batches of 3)",
        "last",
        d,
    );
    assert!(runner_in(d, &["validate", "p.toml", "--set", "train.batch_size=4"]).status.success());
}

#[test]
fn an_edited_plan_json_is_refused_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &format!("{TINY}\n[checkpoint]\nevery = 1\n"));
    common::assert_ok(&runner_in(d, &["run", "p.toml", "--out", "r"]));
    // Extending a run keeps its id: the plan records the first value of train.epochs.
    common::assert_ok(&runner_in(d, &["run", "--resume", "r", "--set", "train.epochs=3"]));
    let plan = d.join("r/plan.json");
    let saved = std::fs::read_to_string(&plan).unwrap();
    let manifest = std::fs::read_to_string(d.join("r/manifest.json")).unwrap();
    let id = saved.split("\"run_id\": \"").nth(1).unwrap()[..12].to_owned();
    let cases = [
        (
            "\n  \"batch_per_rank\": 16",
            "\n  \"batch_per_rank\": 0",
            "`batch_per_rank` is 0 but its configuration gives 16",
        ),
        ("\n  \"threads_per_rank\": ", "\n  \"threads_per_rank\": 9999", "`threads_per_rank` is 9999"),
        (&format!("\"run_id\": \"{id}"), "\"run_id\": \"000000000000", "its run id 000000000000 does not match"),
        ("\"seed\": 3", "\"seed\": 4", &format!("its run id {id} does not match the digest")),
        ("\"stages\": [", "\"stages\": [{\"start\": 0, \"end\": 9}, ", "`stages` is"),
    ];
    for (from, to, want) in cases {
        let edited = if from.ends_with(": ") {
            // Replace the number after the key.
            let at = saved.find(from).unwrap() + from.len();
            let end = at + saved[at..].find(|c: char| !c.is_ascii_digit()).unwrap();
            format!("{}{}{}", &saved[..at - from.len()], to, &saved[end..])
        } else {
            saved.replacen(from, to, 1)
        };
        assert_ne!(edited, saved, "{from}");
        std::fs::write(&plan, edited).unwrap();
        let o = runner_in(d, &["run", "--resume", "r", "--set", "train.epochs=4"]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{from}: {err}");
        assert!(err.contains("r/plan.json: ") && err.contains(want), "{want:?} not in {err}");
        assert!(err.contains("the plan was edited or damaged"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        // Refused before anything ran: the manifest of the last run is as it was.
        assert_eq!(std::fs::read_to_string(d.join("r/manifest.json")).unwrap(), manifest);
    }
    std::fs::write(&plan, &saved).unwrap();
    common::assert_ok(&runner_in(d, &["run", "--resume", "r", "--set", "train.epochs=4"]));
}
