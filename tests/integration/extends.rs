//! `extends = "base.toml"` in pipeline and experiment files, through the real binary: chains,
//! overrides, the provenance lines of config.toml, the run id, and the errors (cycles, missing
//! bases, bases of the other kind, a bad key in a base) with their messages pinned.
use crate::common;

use std::path::Path;

use common::*;

const ROOT: &str = r#"# the data
[run]
name = "root"
world_size = 1

[load]
rows = 200
features = 4
classes = 2
validation_rows = 40

[wrap.model]
hidden = [8, 8]
"#;

const MID: &str = r#"extends = "root.toml"
[wrap.model]
hidden = [4]

[train]
epochs = 1
lr = 0.02
"#;

const CHILD: &str = r#"extends = "../bases/mid.toml"

[train]
lr = 0.01
"#;

fn chain(dir: &Path) {
    std::fs::create_dir_all(dir.join("bases")).unwrap();
    std::fs::create_dir_all(dir.join("exp")).unwrap();
    write(&dir.join("bases"), "root.toml", ROOT);
    write(&dir.join("bases"), "mid.toml", MID);
    write(&dir.join("exp"), "child.toml", CHILD);
}

fn config_line(run_dir: &Path, section: &str, key: &str) -> String {
    let text = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    let mut current = "";
    for line in text.lines() {
        if let Some(s) = line.strip_prefix('[') {
            current = s.trim_end_matches(']');
        } else if current == section && line.starts_with(&format!("{key} = ")) {
            return line.to_owned();
        }
    }
    panic!("no {section}.{key} in config.toml:\n{text}")
}

#[test]
fn a_chain_merges_tables_replaces_arrays_and_says_where_each_value_came_from() {
    let dir = tempfile::tempdir().unwrap();
    chain(dir.path());
    let o = run(&["validate", "exp/child.toml"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.starts_with("extends: exp/child.toml → bases/mid.toml → bases/root.toml\n"), "{}", text(&o).0);

    let o = run(&["run", "exp/child.toml", "--out", "r", "--set", "train.epochs=2"], dir.path());
    assert_ok(&o);
    let r = dir.path().join("r");
    assert_eq!(config_line(&r, "run", "name"), "name = \"root\"  # file bases/root.toml:3");
    assert_eq!(config_line(&r, "load", "rows"), "rows = 200  # file bases/root.toml:7");
    assert_eq!(config_line(&r, "wrap.model", "hidden"), "hidden = [4]  # file bases/mid.toml:3");
    assert_eq!(config_line(&r, "train", "lr"), "lr = 0.01  # file exp/child.toml:4");
    assert_eq!(config_line(&r, "train", "epochs"), "epochs = 2  # --set train.epochs=2");
    assert_eq!(config_line(&r, "train", "batch_size"), "batch_size = 32  # default");

    // The run id covers the resolved values: a base edited later gives another id.
    let id = |o: &std::process::Output| text(o).0.split(['(', ')']).nth(1).unwrap().to_owned();
    let before = id(&run(&["validate", "exp/child.toml"], dir.path()));
    write(&dir.path().join("bases"), "root.toml", &ROOT.replace("rows = 200", "rows = 240"));
    let after = id(&run(&["validate", "exp/child.toml"], dir.path()));
    assert_ne!(before, after);
    // ... and one file holding the same values has the same id as the chain.
    write(
        dir.path(),
        "flat.toml",
        &ROOT
            .replace("rows = 200", "rows = 240")
            .replace("[8, 8]", "[4]")
            .replace("[wrap.model]", "[train]\nepochs = 1\nlr = 0.01\n\n[wrap.model]"),
    );
    assert_eq!(id(&run(&["validate", "flat.toml"], dir.path())), after);
}

#[test]
fn cycles_missing_bases_and_bases_of_the_other_kind_are_refused_naming_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "a.toml", "extends = \"b.toml\"\n[train]\nlr = 0.1\n");
    write(d, "b.toml", "extends = \"a.toml\"\n");
    write(d, "self.toml", "extends = \"self.toml\"\n");
    write(d, "lost.toml", "# a pipeline\nextends = \"gone/base.toml\"\n");
    write(d, "exp.toml", "pipeline = \"a.toml\"\n[sweep]\n\"run.seed\" = [0]\n");
    write(d, "wrong.toml", "extends = \"exp.toml\"\n");
    write(d, "wrong_exp.toml", "extends = \"root.toml\"\n[sweep]\n\"run.seed\" = [0, 1]\n");
    write(d, "root.toml", ROOT);
    write(d, "typo_base.toml", "[train]\nlr = 0.1\nepoks = 3\n");
    write(d, "typo.toml", "extends = \"typo_base.toml\"\n[train]\nlr = 0.2\n");
    write(d, "number.toml", "extends = 3\n");
    for (args, expected) in [
        (&["validate", "a.toml"][..], "error: extends cycle: a.toml → b.toml → a.toml"),
        (&["validate", "self.toml"][..], "error: extends cycle: self.toml → self.toml"),
        (
            &["validate", "lost.toml"][..],
            "error: lost.toml:2: extends gone/base.toml, which is not a file (the path is relative to the file that \
             names it); extends chain: lost.toml → gone/base.toml",
        ),
        (
            &["validate", "wrong.toml"][..],
            "error: exp.toml is an experiment file, but wrong.toml is a pipeline: pipelines extend only pipelines; \
             extends chain: wrong.toml → exp.toml",
        ),
        (
            &["sweep", "wrong_exp.toml", "--out", "never"][..],
            "error: root.toml is a pipeline, but wrong_exp.toml is an experiment file: experiment files extend only \
             experiment files; extends chain: wrong_exp.toml → root.toml",
        ),
        (
            &["validate", "typo.toml"][..],
            "error: typo_base.toml:3: unknown key `train.epoks`; did you mean `train.epochs`?",
        ),
        (
            &["validate", "number.toml"][..],
            "error: number.toml:1: `extends` must name a file of the same kind, e.g. extends = \"base.toml\"",
        ),
    ] {
        let o = run(args, d);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o).1);
        let err = text(&o).1;
        assert!(err.starts_with(expected), "{args:?}:\n{err}\nexpected:\n{expected}");
    }
    assert!(!d.join("never").exists());
}

#[test]
fn an_experiment_file_extends_another() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", ROOT);
    std::fs::create_dir_all(d.join("exps")).unwrap();
    write(
        d,
        "base_exp.toml",
        "pipeline = \"p.toml\"\n[set]\n\"train.epochs\" = 1\n\"load.rows\" = 100\n[sweep]\n\"run.seed\" = [0, 1, 2]\n",
    );
    // The child keeps the base's pipeline (relative to the base) and [set], and replaces the axis.
    write(&d.join("exps"), "seeds.toml", "extends = \"../base_exp.toml\"\n[sweep]\n\"run.seed\" = [7, 8]\n");
    let o = run(&["sweep", "exps/seeds.toml", "--out", "sw"], d);
    assert_ok(&o);
    let mut points: Vec<String> = std::fs::read_dir(d.join("sw"))
        .unwrap()
        .filter_map(|e| e.ok().filter(|e| e.path().is_dir()).map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    points.sort();
    assert_eq!(points.len(), 2, "{points:?}");
    let r = d.join("sw").join(&points[0]);
    assert_eq!(config_line(&r, "train", "epochs"), "epochs = 1  # experiment [set] train.epochs=1");
    assert!(config_line(&r, "run", "seed").starts_with("seed = 7  # sweep axis"), "{}", config_line(&r, "run", "seed"));
}

/// A pipeline with file paths, in its own folder beside its data.
const WITH_FILES: &str = r#"[run]
name = "files"

[load]
source = "text"
path = "data/book.txt"
validation_path = "data/val.txt"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 256
d_model = 8
heads = 2
layers = 1
seq_len = 8

[train]
steps = 2
batch_size = 2
"#;

#[test]
fn a_path_resolves_against_the_file_that_set_it_through_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("p/data")).unwrap();
    std::fs::create_dir_all(d.join("res/shf")).unwrap();
    write(&d.join("p"), "hf.toml", WITH_FILES);
    write(&d.join("p/data"), "book.txt", &"to be, or not to be. ".repeat(20));
    write(&d.join("p/data"), "val.txt", &"that is the question. ".repeat(10));
    // What a search writes in its folder: best.toml extends the pipeline, with the trial's values.
    write(&d.join("res/shf"), "best.toml", "extends = \"../../p/hf.toml\"\n\n[train]\nlr = 0.01\n");
    let o = run(&["run", "res/shf/best.toml", "--out", "r"], d);
    assert_ok(&o);
    let line = config_line(&d.join("r"), "load", "path");
    assert!(line.ends_with("/p/data/book.txt\"  # file p/hf.toml:6"), "{line}");
    // A path the extending file sets is its own; the base's others still resolve against the base.
    write(&d.join("res"), "val.txt", &"whether 'tis nobler. ".repeat(10));
    write(&d.join("res/shf"), "own.toml", "extends = \"best.toml\"\n\n[load]\nvalidation_path = \"../val.txt\"\n");
    let o = run(&["validate", "res/shf/own.toml"], d);
    assert_ok(&o);
    // res/val.txt: 210 bytes, 26 windows of 8 + 1 (p/data/val.txt would make 27).
    assert!(text(&o).0.contains("52 training + 26 validation windows"), "{}", text(&o).0);
}

#[test]
fn the_best_toml_of_a_search_over_a_pipeline_with_file_paths_runs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("p/data")).unwrap();
    std::fs::create_dir_all(d.join("e")).unwrap();
    write(&d.join("p"), "hf.toml", WITH_FILES);
    write(&d.join("p/data"), "book.txt", &"to be, or not to be. ".repeat(20));
    write(&d.join("p/data"), "other.txt", &"the rest is silence. ".repeat(20));
    write(&d.join("p/data"), "val.txt", &"that is the question. ".repeat(10));
    // The space holds a path too: a trial's `--set load.path=...` is relative to the pipeline.
    let experiment =
        "pipeline = \"../p/hf.toml\"\n\n[search]\nmethod = \"random\"\ntrials = 2\nmetric = \"val_loss\"\n\
                      seed = 1\n\n[search.space]\n\"train.lr\" = { choice = [0.01, 0.1] }\n\
                      \"load.path\" = { choice = [\"data/book.txt\", \"data/other.txt\"] }\n";
    write(&d.join("e"), "s.toml", experiment);
    assert_ok(&run(&["sweep", "e/s.toml", "--out", "res/shf"], d));
    let best = std::fs::read_to_string(d.join("res/shf/best.toml")).unwrap();
    assert!(best.contains("path = \"../../p/data/"), "{best}");
    assert_ok(&run(&["run", "res/shf/best.toml", "--out", "again"], d));
}
