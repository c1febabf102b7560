//! Real public datasets (tests/data/, from scikit-learn's bundled files; see its README) with
//! default settings at world sizes 1 and 2, `runner predict` against the trace, and every case of
//! issue 12's "what goes wrong today" with its message pinned.
use crate::common;

use std::path::{Path, PathBuf};

use common::{assert_ok, run, runner, text, trace, write};
use polars::prelude::*;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// Rank 0's values of `col`, epoch by epoch.
fn rank0(df: &DataFrame, col: &str) -> Vec<Option<f64>> {
    let ranks: Vec<u32> = df.column("rank").unwrap().u32().unwrap().into_no_null_iter().collect();
    let v: Vec<Option<f64>> = df.column(col).unwrap().f64().unwrap().iter().collect();
    v.into_iter().zip(ranks).filter(|(_, r)| *r == 0).map(|(v, _)| v).collect()
}

/// A pipeline over a file of tests/data with nothing but the data set: every other value default.
fn pipeline(file: &str, target: &str, extra: &str) -> String {
    format!(
        "[run]\nname = \"real\"\n[load]\nsource = \"csv\"\npath = \"{}\"\ntarget = \"{target}\"\n{extra}",
        data(file).display()
    )
}

/// Each data set with default settings (every key but the file and its target at its default:
/// SGD lr 0.1, 5 epochs, batch 32 per rank, MLP 64-64, min-max over the training rows, a 0.2
/// stratified split) at world sizes 1 and 2.
///
/// Two checks per run. The runner's final validation accuracy is pinned (it is deterministic: the
/// same seed gives the same numbers) within 0.02, a couple of validation rows: another CPU's
/// kernels may round differently and flip a row or two. And it must reach what the same model
/// reaches in plain PyTorch on the same split (benches/reference/tabular_torch.py: the same rows,
/// columns, scaling, initial distribution, optimizer and global batch; 10 seeds) less two of
/// PyTorch's standard deviations across seeds: with 30 to 360 validation rows one seed's accuracy
/// is that noisy.
#[test]
fn real_datasets_train_with_default_settings_at_world_sizes_1_and_2() {
    let dir = tempfile::tempdir().unwrap();
    // (file, target, world size, the runner's val acc, PyTorch's mean and standard deviation)
    let cases = [
        ("iris.csv", "species", 1, 0.7000, 0.7500, 0.0864),
        ("iris.csv", "species", 2, 0.9000, 0.7133, 0.0834),
        ("wine.csv", "cultivar", 1, 0.9444, 0.9111, 0.0315),
        ("wine.csv", "cultivar", 2, 0.8889, 0.8833, 0.0504),
        ("breast_cancer.csv", "diagnosis", 1, 0.9561, 0.9579, 0.0197),
        ("breast_cancer.csv", "diagnosis", 2, 0.9386, 0.9456, 0.0202),
        ("digits.csv", "digit", 1, 0.9499, 0.9440, 0.0088),
        ("digits.csv", "digit", 2, 0.8886, 0.9084, 0.0140),
    ];
    for (file, target, world, pinned, torch_mean, torch_sd) in cases {
        write(dir.path(), "p.toml", &pipeline(file, target, ""));
        let out = format!("{file}-{world}");
        let o = run(&["run", "p.toml", "--set", &format!("run.world_size={world}"), "--out", &out], dir.path());
        assert_ok(&o);
        let df = trace(&dir.path().join(&out));
        for col in ["train_loss", "val_loss"] {
            let worst = df.column(col).unwrap().f64().unwrap().iter().flatten().fold(0.0, f64::max);
            assert!(worst < 3.0, "{file} at {world}: no blow-up, {col} up to {worst}");
        }
        let acc = rank0(&df, "val_acc").last().unwrap().unwrap();
        let f1 = rank0(&df, "val_f1").last().unwrap().unwrap();
        assert!((acc - pinned).abs() <= 0.02, "{file} at {world}: val acc {acc}, pinned {pinned}");
        let floor = torch_mean - 2.0 * torch_sd;
        assert!(acc >= floor, "{file} at {world}: val acc {acc} below PyTorch's {torch_mean} - 2 × {torch_sd}");
        assert!(f1 > 0.5 && f1 <= 1.0, "{file} at {world}: macro-F1 {f1}");
    }
}

/// The numbers `runner predict` prints, by name.
fn printed(stdout: &str) -> Vec<(String, f64)> {
    let line = stdout.lines().find(|l| l.starts_with("loss ")).unwrap_or_else(|| panic!("no metrics in {stdout}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    words.chunks(2).map(|w| (w[0].to_owned(), w[1].parse().unwrap())).collect()
}

/// Writes the rows of `file` (0-based data rows) to `to`, with the header.
fn rows_of(file: &Path, rows: &[usize], to: &Path) {
    let text = std::fs::read_to_string(file).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::from(lines[0]) + "\n";
    for &r in rows {
        out += lines[r + 1];
        out += "\n";
    }
    std::fs::write(to, out).unwrap();
}

fn validation_rows(run_dir: &Path) -> Vec<usize> {
    let split: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("split.json")).unwrap()).unwrap();
    split["validation"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect()
}

#[test]
fn predict_reproduces_the_final_validation_metrics_to_the_last_digit() {
    let dir = tempfile::tempdir().unwrap();
    for (file, target, extra, metrics) in [
        ("digits.csv", "digit", "", &[("loss", "val_loss"), ("acc", "val_acc"), ("f1", "val_f1")][..]),
        (
            "diabetes.csv",
            "progression",
            "[train]\ntask = \"regression\"\noptimizer = \"adam\"\nlr = 0.01\nepochs = 20\n",
            &[("loss", "val_loss"), ("rmse", "val_rmse"), ("mae", "val_mae"), ("r2", "val_r2")][..],
        ),
    ] {
        write(dir.path(), "p.toml", &pipeline(file, target, extra));
        let out = dir.path().join(file);
        assert_ok(&run(&["run", "p.toml", "--set", "run.world_size=2", "--out", out.to_str().unwrap()], dir.path()));
        let val = dir.path().join(format!("val-{file}"));
        rows_of(&data(file), &validation_rows(&out), &val);
        let o = run(&["predict", out.to_str().unwrap(), val.to_str().unwrap()], dir.path());
        assert_ok(&o);
        let got = printed(&text(&o).0);
        let df = trace(&out);
        for (name, col) in metrics {
            let want = rank0(&df, col).last().unwrap().unwrap();
            let v = got.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{file}: no {name} in {got:?}")).1;
            assert_eq!(v.to_bits(), want.to_bits(), "{file}: predict's {name} {v} vs the trace's {col} {want}");
        }
        let preds = ParquetReader::new(std::fs::File::open(out.join("predictions.parquet")).unwrap()).finish().unwrap();
        assert_eq!(preds.height(), validation_rows(&out).len());
        if file == "diabetes.csv" {
            // Un-normalised: in the target's units (it ranges 25..346).
            let mean = preds.column("prediction").unwrap().f64().unwrap().mean().unwrap();
            assert!((100.0..200.0).contains(&mean), "mean prediction {mean}");
            let r2 = got.iter().find(|(n, _)| n == "r2").unwrap().1;
            assert!(r2 > 0.2, "diabetes R² {r2}");
        } else {
            let names: Vec<String> = preds.get_column_names().iter().map(|s| s.to_string()).collect();
            assert_eq!(names[..3], ["row", "prediction", "p_0"], "{names:?}");
            assert_eq!(names.len(), 2 + 10);
        }
    }
}

#[test]
fn the_preprocessing_is_saved_with_the_model() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &pipeline("iris.csv", "species", "[normalize]\nscope = \"rank\"\n"));
    assert_ok(&run(&["run", "p.toml", "--set", "run.world_size=2", "--out", "r"], dir.path()));
    let pre: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("r/preprocessing.json")).unwrap()).unwrap();
    assert_eq!(pre["inputs"], serde_json::json!(["sepal_length", "sepal_width", "petal_length", "petal_width"]));
    assert_eq!(pre["columns"]["labels"]["names"], serde_json::json!(["setosa", "versicolor", "virginica"]));
    assert_eq!(pre["ranks"].as_array().unwrap().len(), 2, "per-rank statistics, one set per rank");
    assert_eq!(pre["validation_rank"], 0);
    assert_eq!(pre["data_file"]["key"], "load.path");
    // model.safetensors carries the same JSON in its header's metadata.
    let bytes = std::fs::read(dir.path().join("r/model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(header["__metadata__"]["runner.preprocessing"].as_str().unwrap()).unwrap();
    assert_eq!(meta, pre);
    // ... and libtorch still reads it.
    let t = tch::Tensor::read_safetensors(dir.path().join("r/model.safetensors")).unwrap();
    assert_eq!(t.len(), 6, "3 layers, weight and bias each");
}

/// issue 12: a column constant in a rank's shard (digits' corner pixels) gave a range of 2e-16
/// and losses of 1e12 at world size 2 with per-rank min-max.
#[test]
fn constant_columns_get_scale_1_and_are_listed() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &pipeline("digits.csv", "digit", "[normalize]\nscope = \"rank\"\n"));
    let o = run(&["validate", "p.toml"], dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(stdout.contains("constant over the training rows (normalised with scale 1): p0, p32, p39"), "{stdout}");
    for method in ["minmax", "standard"] {
        let out = format!("r-{method}");
        let o = run(
            &[
                "run",
                "p.toml",
                "--set",
                "run.world_size=2",
                "--set",
                &format!("normalize.method=\"{method}\""),
                "--out",
                &out,
            ],
            dir.path(),
        );
        assert_ok(&o);
        let df = trace(&dir.path().join(&out));
        for col in ["train_loss", "val_loss"] {
            let worst = df.column(col).unwrap().f64().unwrap().iter().flatten().fold(0.0, f64::max);
            assert!(worst < 3.0, "{method}: {col} up to {worst}");
        }
    }
}

/// A file sorted by label (iris) used to put whole classes in validation.
#[test]
fn the_split_is_stratified_and_seeded() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &pipeline("iris.csv", "species", ""));
    assert_ok(&run(&["run", "p.toml", "--out", "r"], dir.path()));
    let val = validation_rows(&dir.path().join("r"));
    assert_eq!(val.len(), 30);
    for class in 0..3 {
        assert_eq!(val.iter().filter(|&&r| r / 50 == class).count(), 10, "class {class}: {val:?}");
    }
    let acc = rank0(&trace(&dir.path().join("r")), "val_acc").last().unwrap().unwrap();
    assert!(acc > 0.6, "val acc {acc}");
}

/// Each case: a pipeline's extra lines and a data file; `runner validate`'s exact message.
struct Case {
    name: &'static str,
    csv: &'static str,
    extra: &'static str,
    /// The whole stderr (exit code 2), or a line of stdout (exit code 0) when it starts with "out: ".
    expected: &'static str,
}

const CASES: &[Case] = &[
    Case {
        name: "an ID column is left out with load.exclude",
        csv: "id,a,label\n1,0.5,x\n2,0.1,y\n3,0.7,x\n4,0.2,y\n5,0.9,x\n",
        extra: "exclude = [\"id\"]\n",
        expected: "out: 4 training + 1 validation rows, 2 classes | 4 × 1",
    },
    Case {
        name: "features chosen by name",
        csv: "id,a,b,label\n1,0.5,3,x\n2,0.1,4,y\n3,0.7,5,x\n4,0.2,6,y\n5,0.9,7,x\n",
        extra: "features = [\"b\", \"a\"]\n",
        expected: "out: 4 training + 1 validation rows, 2 classes | 4 × 2",
    },
    Case {
        name: "a feature that is not a column",
        csv: "a,label\n1,x\n2,y\n",
        extra: "features = [\"aa\"]\n",
        expected: "error: p.toml: invalid configuration:\n  `load.path` (file p.toml:5): load.features names `aa`, which d.csv \
                   does not have; did you mean `a`? (columns: a, label)",
    },
    Case {
        name: "labels 1..K are K classes, not K+1",
        csv: "a,label\n1,1\n2,2\n3,3\n4,1\n5,2\n6,3\n7,1\n8,2\n9,3\n10,1\n",
        extra: "",
        expected: "out: 8 training + 2 validation rows, 3 classes | 8 × 1",
    },
    Case {
        name: "yes/no and boolean targets",
        csv: "a,label\n1,yes\n2,no\n3,yes\n4,no\n5,yes\n",
        extra: "",
        expected: "out: 4 training + 1 validation rows, 2 classes | 4 × 1",
    },
    Case {
        name: "a boolean target",
        csv: "a,label\n1,true\n2,false\n3,true\n4,false\n5,true\n",
        extra: "",
        expected: "out: 4 training + 1 validation rows, 2 classes | 4 × 1",
    },
    Case {
        name: "a class under 1% of a side warns",
        csv: "a,label\n1,x\n2,y\n3,x\n4,y\n5,x\n",
        extra: "",
        expected: "out: warning: classes under 1% of the validation rows: y (0 of 1)",
    },
    Case {
        name: "a string feature is one-hot encoded",
        csv: "colour,a,label\nred,1,x\nblue,2,y\nred,3,x\ngreen,4,y\nblue,5,x\n",
        extra: "",
        expected: "out: 4 training + 1 validation rows, 2 classes | 4 × 4",
    },
    Case {
        name: "NA cells are missing, not 'not numeric'",
        csv: "a,b,label\n1,NA,0\n2,3,1\n,4,0\n5,6,1\n",
        extra: "",
        expected: "error: p.toml: invalid configuration:\n  `load.path` (file p.toml:5): d.csv has missing values (empty, NA, N/A \
                   or null cells) in columns `a` 1, `b` 1: set load.missing = \"drop\", \"mean\", \"median\" or \"zero\"",
    },
    Case {
        name: "missing cells filled with the training rows' mean",
        csv: "a,b,label\n1,NA,0\n2,3,1\n3,4,0\n5,6,1\n",
        extra: "missing = \"mean\"\n[validate]\nrows = 1\n",
        expected: "out: column `b`: 1 missing cells filled with 4.5",
    },
    Case {
        name: "rows with missing cells dropped",
        csv: "a,b,label\n1,NA,0\n2,3,1\n3,4,0\n5,6,1\n7,8,0\n",
        extra: "missing = \"drop\"\n",
        expected: "out: 1 of 5 rows dropped for missing values (load.missing = \"drop\"; rows without a target are always dropped)",
    },
    Case {
        name: "a semicolon file without load.delimiter",
        csv: "a;b;label\n1;2;0\n3;4;1\n",
        extra: "",
        expected: "error: p.toml: invalid configuration:\n  `load.path` (file p.toml:5): d.csv has no column `label` (columns: a;b;label)",
    },
    Case {
        name: "a semicolon file with load.delimiter",
        csv: "a;b;label\n1;2;0\n3;4;1\n5;6;0\n7;8;1\n9;9;0\n",
        extra: "delimiter = \";\"\n",
        expected: "out: 4 training + 1 validation rows, 2 classes | 4 × 2",
    },
    Case {
        name: "inf in a feature is refused like NaN",
        csv: "a,b,label\n1,2,0\n3,inf,1\n5,6,0\n",
        extra: "",
        expected: "error: p.toml: invalid configuration:\n  `load.path` (file p.toml:5): column `b` of d.csv holds inf (row 2): \
                   values must be finite numbers within float32's range; remove them or leave the cells empty and set load.missing",
    },
    Case {
        name: "1e308 overflows float32 and is refused",
        csv: "a,b,label\n1,2,0\n3,1e308,1\n5,-1e308,0\n",
        extra: "",
        expected: "error: p.toml: invalid configuration:\n  `load.path` (file p.toml:5): column `b` of d.csv holds 1e308 (row 2, and \
                   1 more): values must be finite numbers within float32's range; remove them or leave the cells empty and set load.missing",
    },
    Case {
        name: "a label of 10^12 is a class name, not 10^12 classes",
        csv: "a,label\n1,1000000000000\n2,7\n3,1000000000000\n4,7\n5,7\n",
        extra: "",
        expected: "out: 4 training + 1 validation rows, 2 classes | 4 × 1",
    },
    Case {
        name: "a training set lacking a class",
        csv: "a,label\n1,x\n2,x\n3,y\n",
        extra: "[validate]\nrows = 2\n",
        expected: "error: p.toml: invalid configuration:\n  `load.path` (file p.toml:5): the training rows hold no row of class y: \
                   the model could never learn it (a separate validation file with classes the training file lacks, or too few rows?)",
    },
    Case {
        name: "validation_rows is for synthetic data",
        csv: "a,label\n1,x\n2,y\n3,x\n4,y\n5,x\n",
        extra: "validation_rows = 2\n",
        expected: "error: p.toml: invalid configuration:\n  `load.validation_rows` (file p.toml:7): is only read by source = \
                   \"synthetic\"; a file's validation rows are validate.fraction (default 0.2), validate.rows or load.validation_path",
    },
    Case {
        name: "a fractional label is not a class",
        csv: "a,label\n1,0.5\n2,1\n",
        extra: "",
        expected: "error: p.toml: invalid configuration:\n  `load.path` (file p.toml:5): target `label` of d.csv holds 0.5: class \
                   labels are integers, strings or booleans; to predict numbers set train.task = \"regression\"",
    },
];

#[test]
fn what_went_wrong_with_real_files_is_explained() {
    for case in CASES {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "d.csv", case.csv);
        let p = format!(
            "[run]\nname = \"c\"\n[load]\nsource = \"csv\"\npath = \"d.csv\"\ntarget = \"label\"\n{}{}",
            case.extra,
            if case.extra.contains("[train]") { "" } else { "[train]\nbatch_size = 1\n" }
        );
        write(dir.path(), "p.toml", &p);
        let out = runner().current_dir(dir.path()).args(["validate", "p.toml"]).output().unwrap();
        let (stdout, stderr) = text(&out);
        match case.expected.strip_prefix("out: ") {
            Some(line) => {
                assert!(out.status.success(), "{}: {stderr}", case.name);
                for part in line.split(" | ") {
                    assert!(stdout.contains(part), "{}: no {part:?} in\n{stdout}", case.name);
                }
            }
            None => {
                assert_eq!(out.status.code(), Some(2), "{}: {stdout}{stderr}", case.name);
                assert_eq!(stderr.trim_end(), case.expected, "{}: the message changed", case.name);
            }
        }
    }
}

#[test]
fn unseen_categories_at_predict_time_encode_as_no_category() {
    let dir = tempfile::tempdir().unwrap();
    let mut csv = String::from("colour,a,label\n");
    for i in 0..200 {
        let colour = ["red", "blue", "green"][i % 3];
        csv += &format!("{colour},{},{}\n", i % 7, if colour == "red" { "yes" } else { "no" });
    }
    write(dir.path(), "d.csv", &csv);
    write(
        dir.path(),
        "p.toml",
        "[run]\nname = \"c\"\n[load]\nsource = \"csv\"\npath = \"d.csv\"\ntarget = \"label\"\n",
    );
    assert_ok(&run(&["run", "p.toml", "--out", "r"], dir.path()));
    write(dir.path(), "new.csv", "colour,a\npurple,3\nred,2\n");
    let o = run(&["predict", "r", "new.csv", "--out", "p.parquet"], dir.path());
    assert_ok(&o);
    let (stdout, stderr) = text(&o);
    assert!(stdout.contains("2 predictions written to p.parquet"), "{stdout}");
    assert!(
        stderr.contains(
            "note: 1 cells of one-hot columns hold values the training rows did not; they encode as no category"
        ),
        "{stderr}"
    );
    let preds = ParquetReader::new(std::fs::File::open(dir.path().join("p.parquet")).unwrap()).finish().unwrap();
    let names: Vec<String> = preds.get_column_names().iter().map(|s| s.to_string()).collect();
    assert_eq!(names, ["row", "prediction", "p_no", "p_yes"]);
}

#[test]
fn a_target_with_more_distinct_labels_than_classes_can_be_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut csv = String::from("a,label\n");
    for i in 0..1001 {
        csv += &format!("{i},{}\n", i as u64 * 1_000_000_007);
    }
    write(dir.path(), "d.csv", &csv);
    write(
        dir.path(),
        "p.toml",
        "[run]\nname = \"c\"\n[load]\nsource = \"csv\"\npath = \"d.csv\"\ntarget = \"label\"\n",
    );
    let o = run(&["validate", "p.toml"], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim_end(),
        "error: p.toml: invalid configuration:\n  `load.path` (file p.toml:5): target `label` of d.csv has 1001 distinct \
         labels, more than the 1000 classes a classification may have: is it a number to predict (train.task = \
         \"regression\") or an ID?"
    );
}

#[test]
fn a_separate_validation_file_is_encoded_like_the_training_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut csv = String::from("colour,a,label\n");
    for i in 0..120 {
        csv += &format!("{},{},{}\n", ["red", "blue"][i % 2], i % 5, ["no", "yes"][i % 2]);
    }
    write(dir.path(), "train.csv", &csv);
    write(dir.path(), "val.csv", "colour,a,label\nred,1,no\nblue,2,yes\nred,3,no\n");
    let p = "[run]\nname = \"c\"\n[load]\nsource = \"csv\"\npath = \"train.csv\"\ntarget = \"label\"\n\
             validation_path = \"val.csv\"\n";
    write(dir.path(), "p.toml", p);
    let o = run(&["validate", "p.toml"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("120 training + 3 validation rows, 2 classes"), "{}", text(&o).0);
    write(dir.path(), "val.csv", "colour,a,label\nred,1,maybe\n");
    let o = run(&["validate", "p.toml"], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim_end(),
        "error: p.toml: invalid configuration:\n  `load.validation_path` (file p.toml:7): target `label` of val.csv holds \
         `maybe` (row 1), not one of the run's classes (no, yes)"
    );
}
