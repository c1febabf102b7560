//! One resolved plan: the launcher resolves the configuration once and saves it (plan.json);
//! ranks and `--resume` run from it. A resumed run keeps its id and refuses any change but the
//! keys that extend it; the run id covers the content of every file the run reads.
use crate::common;

use std::path::Path;

use common::{assert_ok, run, text, write};
use polars::prelude::*;

/// 2 ranks, checkpoints every epoch, small enough for a few seconds a run.
const SMALL: &str = r#"
[run]
name = "small"
seed = 4
world_size = 2
timeout_s = 20

[load]
rows = 400
features = 4
classes = 3
validation_rows = 50

[wrap.model]
hidden = [8]

[train]
epochs = 2
batch_size = 16
optimizer = "adam"
lr = 0.01

[checkpoint]
every = 1
"#;

fn run_ids(dir: &Path) -> Vec<String> {
    let df = ParquetReader::new(std::fs::File::open(dir.join("trace.parquet")).unwrap()).finish().unwrap();
    let ids = df.column("run_id").unwrap().str().unwrap();
    let mut v: Vec<String> = ids.iter().map(|s| s.unwrap().to_owned()).collect();
    v.dedup();
    v
}

fn stderr_of(args: &[&str], dir: &Path) -> (Option<i32>, String) {
    let o = run(args, dir);
    (o.status.code(), text(&o).1)
}

#[test]
fn ranks_run_the_saved_plan_and_a_resumed_run_keeps_its_id() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", SMALL);
    assert_ok(&run(&["run", "p.toml", "--out", "r"], dir.path()));
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("r/plan.json")).unwrap()).unwrap();
    let id = plan["run_id"].as_str().unwrap().to_owned();
    assert_eq!(run_ids(&dir.path().join("r")), vec![id.clone()]);

    // Extending the run: the only change allowed, recorded with its provenance.
    assert_ok(&run(&["run", "--resume", "r", "--set", "train.epochs=3"], dir.path()));
    assert_eq!(run_ids(&dir.path().join("r")), vec![id.clone()], "a resumed run keeps its id");
    let config = std::fs::read_to_string(dir.path().join("r/config.toml")).unwrap();
    assert!(config.contains("epochs = 3  # --set train.epochs=3 (on resume)"), "{config}");
    assert!(config.contains(&format!("run {id}")), "{config}");

    // Nothing left to run: refused, not reported complete.
    let (code, err) = stderr_of(&["run", "--resume", "r", "--set", "train.epochs=2"], dir.path());
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "`train.epochs` (--set train.epochs=2 (on resume)) is 2 but the newest checkpoint of r is at epoch 3: \
             nothing is left to run; pass --set train.epochs=N with N > 3 to train further"
        ),
        "{err}"
    );
}

#[test]
fn resuming_with_another_configuration_is_refused_naming_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", SMALL);
    assert_ok(&run(&["run", "p.toml", "--out", "r"], dir.path()));
    for (args, expected) in [
        (&["--set", "run.seed=5"][..], "`run.seed`: 4 in the run, 5 now (--set run.seed=5)"),
        (&["--set", "train.optimizer=\"sgd\""][..], "`train.optimizer`: \"adam\" in the run, \"sgd\" now"),
        (
            &["--set", "wrap.model.activation=\"tanh\"", "--set", "train.epochs=4"][..],
            "`wrap.model.activation`: \"relu\" in the run, \"tanh\" now",
        ),
    ] {
        let (code, err) = stderr_of(&[&["run", "--resume", "r"][..], args].concat(), dir.path());
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("cannot resume with another configuration") && err.contains(expected), "{err}");
        assert!(
            err.contains(
                "Only train.epochs, train.steps (to train longer) and run.world_size, run.threads_per_rank, \
                          wrap.strategy,"
            ) && err.contains("(keeping the global batch) may change when resuming"),
            "{err}"
        );
    }
    // The strategy may change, but not to one whose ranks train alone.
    let (code, err) = stderr_of(&["run", "--resume", "r", "--set", "wrap.strategy=\"none\""], dir.path());
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "cannot resume at world size 2, none from world size 2, ddp: wrap.strategy = \"none\" trains each rank's \
             replica alone, so its checkpoint (rank 0's replica) stands for no other layout"
        ),
        "{err}"
    );
    // Editing the run's config.toml is a change too.
    let config = dir.path().join("r/config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("lr = 0.01", "lr = 0.02")).unwrap();
    let (code, err) = stderr_of(&["run", "--resume", "r", "--set", "train.epochs=3"], dir.path());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("`train.lr`: 0.01 in the run, 0.02 now (file r/config.toml"), "{err}");
}

#[test]
fn a_run_with_relative_initial_weights_resumes() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", SMALL);
    // The runner's own model.safetensors is a valid initial-weights file.
    assert_ok(&run(&["run", "p.toml", "--out", "first", "--set", "train.epochs=1"], dir.path()));
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::copy(dir.path().join("first/model.safetensors"), dir.path().join("sub/init.safetensors")).unwrap();
    write(dir.path(), "sub/p.toml", &format!("{SMALL}\n[wrap]\ninit = \"init.safetensors\"\n"));
    assert_ok(&run(&["run", "sub/p.toml", "--out", "r"], dir.path()));
    let config = std::fs::read_to_string(dir.path().join("r/config.toml")).unwrap();
    assert!(config.contains("init = \"/"), "config.toml names the file absolutely: {config}");
    assert_ok(&run(&["run", "--resume", "r", "--set", "train.epochs=3"], dir.path()));

    // Another file under the same name is another input: refused.
    std::fs::copy(dir.path().join("r/model.safetensors"), dir.path().join("sub/init.safetensors")).unwrap();
    let (code, err) = stderr_of(&["run", "--resume", "r", "--set", "train.epochs=4"], dir.path());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("`wrap.init`: ") && err.contains("changed since the run started"), "{err}");
}

#[test]
fn a_batch_split_run_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let split = SMALL.replace("batch_size = 16", "global_batch_size = 32") + "\n[shard]\nstrategy = \"batch\"\n";
    write(dir.path(), "p.toml", &split);
    assert_ok(&run(&["run", "p.toml", "--out", "r"], dir.path()));
    assert_ok(&run(&["run", "--resume", "r", "--set", "train.epochs=3"], dir.path()));
}

#[test]
fn a_csv_run_resumes_under_its_id_and_the_id_follows_the_file_content() {
    let dir = tempfile::tempdir().unwrap();
    let mut csv = String::from("a,b,c,label\n");
    for i in 0..300 {
        let (a, b, c) = ((i * 7 % 13) as f64 / 3.0, (i * 5 % 11) as f64, (i % 7) as f64 - 3.0);
        csv += &format!("{a},{b},{c},{}\n", (i * 7 % 13) % 3);
    }
    write(dir.path(), "data.csv", &csv);
    let pipeline = SMALL.replace(
        "rows = 400\nfeatures = 4\nclasses = 3\nvalidation_rows = 50\n",
        "source = \"csv\"\npath = \"data.csv\"\ntarget = \"label\"\n",
    );
    write(dir.path(), "p.toml", &pipeline);
    let o = run(&["run", "p.toml"], dir.path());
    assert_ok(&o);
    let (out, _) = text(&o);
    let first = out.lines().find_map(|l| l.trim().strip_prefix("run directory: ")).unwrap().to_owned();
    let ids = run_ids(&dir.path().join(&first));
    assert_ok(&run(&["run", "--resume", &first, "--set", "train.epochs=3"], dir.path()));
    assert_eq!(run_ids(&dir.path().join(&first)), ids, "resuming a csv run relabels nothing");

    // The same configuration over an edited file is another run, in another directory.
    write(dir.path(), "data.csv", &csv.replace("\n0,0,-3,0\n", "\n1,0,-3,0\n"));
    let o = run(&["run", "p.toml"], dir.path());
    assert_ok(&o);
    let (out, _) = text(&o);
    let second = out.lines().find_map(|l| l.trim().strip_prefix("run directory: ")).unwrap().to_owned();
    assert_ne!(first, second, "an edited data file must change the run id");
    // ... and the first run refuses to resume over it.
    let (code, err) = stderr_of(&["run", "--resume", &first, "--set", "train.epochs=4"], dir.path());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("`load.path`: ") && err.contains("changed since the run started"), "{err}");
}

#[test]
fn ddp_checkpoints_record_the_bucket_layout_the_reducer_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", SMALL);
    assert_ok(&run(&["run", "p.toml", "--out", "r", "--set", "wrap.bucket_cap_mb=0.0001"], dir.path()));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("r/checkpoints/epoch-0002/index.json")).unwrap())
            .unwrap();
    // 4 parameters (two linear layers); buckets rebuilt in the order gradients became ready:
    // the last layer's first, with a cap this small each parameter alone.
    let buckets: Vec<Vec<u64>> = serde_json::from_value(meta["record"]["buckets"].clone()).unwrap();
    let mut all: Vec<u64> = buckets.iter().flatten().copied().collect();
    assert_eq!(buckets.first().and_then(|b| b.first()), Some(&3), "{buckets:?}");
    all.sort();
    assert_eq!(all, [0, 1, 2, 3], "{buckets:?}");
}

#[test]
fn the_schema_describes_every_shipped_pipeline_and_refuses_unknown_keys() {
    let dir = tempfile::tempdir().unwrap();
    let o = run(&["schema"], dir.path());
    assert_ok(&o);
    let schema: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // Byte for byte: `runner schema > pipelines/schema.json` leaves the committed file as it is,
    // whichever build runs it (this test's binary keeps serde_json's insertion order).
    let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/pipelines/schema.json")).unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).trim_end() == committed.trim_end(),
        "pipelines/schema.json is stale or reordered: runner schema > pipelines/schema.json"
    );
    let validator = jsonschema::validator_for(&schema).unwrap();
    let pipelines = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/pipelines")).unwrap();
    let mut checked = 0;
    for entry in pipelines {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(text.starts_with("#:schema ./schema.json"), "{} lacks its #:schema line", path.display());
            let value: serde_json::Value = toml::from_str(&text).unwrap();
            let errors: Vec<String> = validator.iter_errors(&value).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "{}: {errors:?}", path.display());
            checked += 1;
        }
    }
    assert!(checked >= 3);
    for bad in ["[train]\nlr = \"fast\"\n", "[train]\nlrr = 0.1\n", "[wrap.model]\nkind = \"mlp\"\nhiden = [4]\n"] {
        let value: serde_json::Value = toml::from_str(bad).unwrap();
        assert!(!validator.is_valid(&value), "the schema lets through {bad:?}");
    }
}

/// `runner validate` shows the memory estimate it checks. A transformer's counts what its blocks
/// keep for the backward pass: with dropout, libtorch's attention keeps its weights too, so the
/// estimate grows (it would not if the layers' insides were ignored).
#[test]
fn validate_shows_the_memory_estimate_counting_what_layers_keep_for_backward() {
    let pipeline = concat!(env!("CARGO_MANIFEST_DIR"), "/pipelines/transformer_ddp.toml");
    let dir = tempfile::tempdir().unwrap();
    let activations_mib = |dropout: &str| -> f64 {
        let o = run(&["validate", pipeline, "--set", &format!("wrap.model.dropout={dropout}")], dir.path());
        assert_ok(&o);
        let out = text(&o).0;
        let line =
            out.lines().find(|l| l.contains("memory: about")).unwrap_or_else(|| panic!("no memory line:\n{out}"));
        let after = line.split("activations ").nth(1).unwrap();
        let (number, unit) = after.split_once(' ').unwrap();
        let n: f64 = number.parse().unwrap();
        if unit.starts_with("GiB") {
            n * 1024.0
        } else {
            n
        }
    };
    let (plain, dropout) = (activations_mib("0.0"), activations_mib("0.1"));
    assert!(dropout > plain, "with dropout {dropout} MiB, without {plain} MiB");
}

/// The plan says when checkpoints are written, how, and what a failed rank does; its table fits
/// `COLUMNS` (cells wrapped at spaces), and without a terminal or `COLUMNS` each row is one line.
#[test]
fn the_plan_shows_checkpoints_and_restarts_and_fits_columns() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", SMALL);
    let args = ["validate", "p.toml", "--set", "checkpoint.async=true", "--set", "run.max_restarts=3"];
    let o = run(&args, dir.path());
    assert_ok(&o);
    let (out, _) = text(&o);
    let row = out.lines().find(|l| l.trim_start().starts_with("checkpoint ")).expect("a checkpoint row");
    assert!(
        row.contains(
            "model, optimizer, data position  every 1 epoch(s) and after the last, written in the background while \
             training goes on (checkpoint.async), the 2 newest kept; a failed rank: every rank starts again from the \
             newest checkpoint, up to 3 time(s) (run.max_restarts)  RUN_DIR/checkpoints/"
        ),
        "{out}"
    );
    let table =
        |out: &str| -> Vec<String> { out.lines().skip(2).take_while(|l| !l.is_empty()).map(str::to_owned).collect() };
    assert!(table(&out).iter().any(|l| l.chars().count() > 150), "unfitted without a terminal:\n{out}");
    let o = common::runner().args(args).env("COLUMNS", "90").current_dir(dir.path()).output().unwrap();
    assert_ok(&o);
    let (fitted, _) = text(&o);
    let lines = table(&fitted);
    assert!(lines.iter().all(|l| l.chars().count() <= 90), "{fitted}");
    let words = |t: &[String]| t.join(" ").split_whitespace().filter(|w| !w.starts_with('─')).count();
    assert_eq!(words(&lines), words(&table(&out)), "every word kept:\n{fitted}");
}
