//! What a newcomer looked for on the first day (issue 43): `runner predict` from the best model
//! and from arrays, `runner data`'s preview of the stages, and a key removed through `extends`
//! and from the command line.
use crate::common;

use std::path::{Path, PathBuf};

use common::{assert_ok, run, text, trace, write};
use polars::prelude::*;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// `loss X  acc Y  f1 Z` as printed by predict.
fn printed(out: &str) -> Vec<(String, f64)> {
    let line = out.lines().find(|l| l.starts_with("loss ")).unwrap_or_else(|| panic!("no metrics in {out}"));
    let w: Vec<&str> = line.split_whitespace().collect();
    w.chunks(2).map(|p| (p[0].to_owned(), p[1].parse().unwrap())).collect()
}

/// Rank 0's column, epoch by epoch.
fn rank0(dir: &Path, col: &str) -> Vec<f64> {
    let df = trace(dir);
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    df.filter(&mask).unwrap().column(col).unwrap().f64().unwrap().into_no_null_iter().collect()
}

/// `--model best` applies the early-stopping best model: on the run's validation rows it gives
/// the trace's validation loss of the best epoch, to the bit. The same rows as an `.npz` of the
/// model's inputs and class ids give the csv's metrics, to the bit.
#[test]
fn predict_from_the_best_model_and_from_npz_arrays() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = format!(
        "[run]\nname = \"wine\"\nworld_size = 1\n[load]\nsource = \"csv\"\npath = \"{}\"\ntarget = \"cultivar\"\n\
         [train]\nepochs = 8\nlr = 0.5\n[train.early_stop]\npatience = 8\n",
        data("wine.csv").display()
    );
    write(dir.path(), "p.toml", &pipeline);
    assert_ok(&run(&["run", "p.toml", "--out", "r"], dir.path()));
    let r = dir.path().join("r");
    // The validation rows, as a csv of the file's columns and as arrays of the model's inputs.
    let split: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(r.join("split.json")).unwrap()).unwrap();
    let rows: Vec<usize> =
        split["validation"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let text_of = std::fs::read_to_string(data("wine.csv")).unwrap();
    let lines: Vec<&str> = text_of.lines().collect();
    let csv: String =
        std::iter::once(lines[0]).chain(rows.iter().map(|&i| lines[i + 1])).collect::<Vec<_>>().join("\n");
    write(dir.path(), "val.csv", &(csv + "\n"));
    let pre: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(r.join("preprocessing.json")).unwrap()).unwrap();
    let header: Vec<&str> = lines[0].split(',').collect();
    let inputs: Vec<&str> = pre["inputs"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let names: Vec<&str> =
        pre["columns"]["labels"]["names"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for &i in &rows {
        let cells: Vec<&str> = lines[i + 1].split(',').collect();
        for name in &inputs {
            let at = header.iter().position(|h| h == name).unwrap();
            x.push(cells[at].parse::<f64>().unwrap() as f32);
        }
        let label = cells[header.iter().position(|h| *h == "cultivar").unwrap()];
        y.push(names.iter().position(|n| *n == label).unwrap() as i64);
    }
    let xt = tch::Tensor::from_slice(&x).view([rows.len() as i64, inputs.len() as i64]);
    let yt = tch::Tensor::from_slice(&y);
    tch::Tensor::write_npz(&[("x", &xt), ("y", &yt)], dir.path().join("val.npz")).unwrap();
    xt.write_npy(dir.path().join("val.npy")).unwrap();

    // The best epoch: the first with the lowest validation loss.
    let val_loss = rank0(&r, "val_loss");
    let best = val_loss.iter().cloned().fold(f64::INFINITY, f64::min);
    let o = run(&["predict", "r", "val.csv", "--model", "best", "--out", "best.parquet"], dir.path());
    assert_ok(&o);
    let got = printed(&text(&o).0);
    assert_eq!(got[0].1.to_bits(), best.to_bits(), "--model best: loss {} against the best epoch's {best}", got[0].1);
    // A weights file named by its path is the same model.
    let o = run(&["predict", "r", "val.csv", "--model", "r/model.best.safetensors", "--out", "f.parquet"], dir.path());
    assert_ok(&o);
    assert_eq!(printed(&text(&o).0)[0].1.to_bits(), best.to_bits());
    // The final model, from the csv and from the arrays.
    let final_loss = *val_loss.last().unwrap();
    let o = run(&["predict", "r", "val.csv", "--out", "csv.parquet"], dir.path());
    assert_ok(&o);
    let from_csv = printed(&text(&o).0);
    assert_eq!(from_csv[0].1.to_bits(), final_loss.to_bits());
    let o = run(&["predict", "r", "val.npz", "--out", "npz.parquet"], dir.path());
    assert_ok(&o);
    let from_npz = printed(&text(&o).0);
    assert_eq!(from_npz, from_csv, "the .npz of the same rows gives the csv's metrics");
    let o = run(&["predict", "r", "val.npy", "--out", "npy.parquet"], dir.path());
    assert_ok(&o);
    let read = |f: &str| ParquetReader::new(std::fs::File::open(dir.path().join(f)).unwrap()).finish().unwrap();
    assert_eq!(read("npy.parquet").column("prediction").unwrap(), read("csv.parquet").column("prediction").unwrap());
    // Refusals: a weights file of another shape, arrays of another width, and --set of a key
    // that is the run's.
    for (args, expected) in [
        (&["predict", "r", "val.npz", "--model", "best"][..], ""),
        (
            &["predict", "r", "val.csv", "--set", "normalize.method=\"none\""][..],
            "it takes only load.missing and load.delimiter",
        ),
        (
            &["predict", "r", "val.csv", "--set", "load.missing=\"mean\""][..],
            "the run fitted no mean of its training rows",
        ),
    ] {
        let o = run(args, dir.path());
        if expected.is_empty() {
            assert_ok(&o);
            continue;
        }
        assert_eq!(o.status.code(), Some(2), "{args:?}: {:?}", text(&o));
        assert!(text(&o).1.contains(expected), "{args:?}: {}", text(&o).1);
    }
    let wide = tch::Tensor::zeros([3, inputs.len() as i64 + 1], (tch::Kind::Float, tch::Device::Cpu));
    tch::Tensor::write_npz(&[("x", &wide)], dir.path().join("wide.npz")).unwrap();
    let o = run(&["predict", "r", "wide.npz"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    assert!(text(&o).1.contains("but the model takes rows of [13]"), "{}", text(&o).1);
}

/// `runner data`: the load stage's rows and statistics, each rank's shard (together every
/// training row once), and the shard normalised by its own statistics (min-max per rank: each
/// column from 0 to 1).
#[test]
fn the_data_preview_shows_each_stage_per_rank_with_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let pipeline = format!(
        "[run]\nname = \"iris\"\nworld_size = 2\n[load]\nsource = \"csv\"\npath = \"{}\"\ntarget = \"species\"\n\
         [normalize]\nscope = \"rank\"\n",
        data("iris.csv").display()
    );
    write(dir.path(), "p.toml", &pipeline);
    let o = run(&["data", "p.toml", "--rows", "3"], dir.path());
    assert_ok(&o);
    let out = text(&o).0;
    assert!(out.contains("1 load: 120 training rows (statistics over all 120 rows)"), "{out}");
    assert!(out.contains("rank 0\n2 shard: 60 rows of epoch 1, 0 of them padding"), "{out}");
    assert!(out.contains("rank 1\n2 shard: 60 rows of epoch 1, 0 of them padding"), "{out}");
    assert_eq!(out.matches("3 normalize: minmax, statistics of this rank's shard").count(), 2, "{out}");
    // Per section: a header, 3 rows, min, mean, std, max.
    let sections: Vec<&str> = out.split("\n1 load").chain(out.split("2 shard").skip(1)).collect();
    assert!(sections.len() >= 3, "{out}");
    // After normalisation every column spans [0, 1] on its rank.
    for block in out.split("3 normalize").skip(1) {
        let min = block.lines().find(|l| l.trim_start().starts_with("min ")).unwrap();
        let max = block.lines().find(|l| l.trim_start().starts_with("max ")).unwrap();
        assert!(min.split_whitespace().skip(1).all(|v| v == "0"), "{min}");
        assert!(max.split_whitespace().skip(1).all(|v| v == "1"), "{max}");
    }
    // The shards' rows cover the training rows once.
    let mut seen: Vec<usize> = Vec::new();
    for block in out.split("2 shard").skip(1) {
        let body = block.split("3 normalize").next().unwrap();
        assert_eq!(
            body.lines().filter(|l| l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit())).count(),
            3
        );
        seen.extend(
            body.lines().skip(2).take(3).map(|l| l.split_whitespace().next().unwrap().parse::<usize>().unwrap()),
        );
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 6, "the ranks' first rows are distinct: {out}");
    let o = run(&["data", "p.toml", "--rank", "2"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    assert!(text(&o).1.contains("--rank 2: the run has ranks 0 to 1"), "{}", text(&o).1);
}

/// `pipelines/ddp.toml` sets train.epochs: `--set '~train.epochs'` takes it away so that
/// `train.steps` can set the run's length (200 steps), and a file that extends it with
/// `unset = ["train.epochs"]` is the same run (the same id). Removing a key no layer sets, or
/// `unset` in a file that extends nothing, is refused.
#[test]
fn a_key_is_removed_through_extends_and_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let ddp = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/ddp.toml");
    let o = run(&["validate", ddp.to_str().unwrap(), "--set", "train.steps=200"], dir.path());
    assert_eq!(o.status.code(), Some(2), "without the removal the two lengths are refused");
    assert!(text(&o).1.contains("both set the run's length: keep one"), "{}", text(&o).1);
    let steps = ["--set", "~train.epochs", "--set", "train.steps=200", "--set", "validate.every_steps=100"];
    let o = run(&[&["run", ddp.to_str().unwrap(), "--out", "r"][..], &steps].concat(), dir.path());
    assert_ok(&o);
    let out = text(&o).0;
    assert!(out.contains("200 steps of 32 per rank (128 global)"), "{out}");
    let step: Vec<u64> = {
        let df = trace(&dir.path().join("r"));
        df.column("step").unwrap().cast(&DataType::UInt64).unwrap().u64().unwrap().into_no_null_iter().collect()
    };
    assert_eq!(step.iter().max(), Some(&200), "{step:?}");
    let config = std::fs::read_to_string(dir.path().join("r/config.toml")).unwrap();
    assert!(config.contains("steps = 200  # --set train.steps=200"), "{config}");
    let id =
        |out: &str| out.lines().find(|l| l.starts_with("run ")).unwrap().split(['(', ')']).nth(1).unwrap().to_owned();
    let child = format!(
        "extends = \"{}\"\nunset = [\"train.epochs\"]\n\n[train]\nsteps = 200\n\n[validate]\nevery_steps = 100\n",
        ddp.display()
    );
    write(dir.path(), "child.toml", &child);
    let o = run(&["validate", "child.toml"], dir.path());
    assert_ok(&o);
    assert_eq!(id(&text(&o).0), id(&out), "the chain with unset is the run --set '~train.epochs' made");
    for (file, args, expected) in [
        (ddp.to_str().unwrap(), &["--set", "~train.momentum"][..], "no layer sets `train.momentum`"),
        (ddp.to_str().unwrap(), &["--set", "~train.epochs=5"][..], "`~KEY` removes a key"),
        ("bad.toml", &[][..], "bad.toml:1: unset \"train.epochs\": this file extends no other"),
        ("typo.toml", &[][..], "typo.toml:2: unset \"train.epoch\": no file it extends sets `train.epoch`"),
    ] {
        write(dir.path(), "bad.toml", "unset = [\"train.epochs\"]\n[train]\nsteps = 3\n");
        write(dir.path(), "typo.toml", &format!("extends = \"{}\"\nunset = [\"train.epoch\"]\n", ddp.display()));
        let o = run(&[&["validate", file][..], args].concat(), dir.path());
        assert_eq!(o.status.code(), Some(2), "{file} {args:?}: {:?}", text(&o));
        assert!(text(&o).1.contains(expected), "{file} {args:?}: {}", text(&o).1);
    }
}
