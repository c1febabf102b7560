//! Named points (`[[points]]`) end to end: a sweep of points a grid cannot spell (one rank, DDP
//! and tensor parallelism over 2 ranks, each at every seed of an axis), their names in the run
//! directories, config.toml, sweep.json and the table, the global batch split over the copies of
//! the model, `--check`; the refusals by name and line; and the committed
//! `results/parallelism` table, which must report as committed, agree in its losses and reproduce
//! bit for bit.
use crate::common;

use std::path::Path;

use common::committed::{assert_reports_as_committed, assert_reproduces, read, table_lines};
use common::{assert_ok, run, text, write, TINY};
use polars::prelude::*;

/// One rank, DDP over 2 and tensor parallelism over 2, each at one seed of an axis, with the
/// global batch of 16 rows split over the copies of the model.
const NAMED: &str = r#"
pipeline = "p.toml"

[set]
"train.epochs" = 2

[sweep]
"run.seed" = [4]

[scaling]
batch = "global"

[[points]]
name = "one"
"run.world_size" = 1

[[points]]
name = "ddp"
"run.world_size" = 2

[[points]]
name = "tp2"
"run.world_size" = 2
"wrap.mesh.tensor" = 2
"#;

const DIRS: [&str; 3] = ["one,seed=4", "ddp,seed=4", "tp2,seed=4"];

fn parquet(path: &Path) -> DataFrame {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ParquetReader::new(file).finish().unwrap()
}

fn f64s(df: &DataFrame, col: &str) -> Vec<f64> {
    df.column(col).unwrap().f64().unwrap().into_no_null_iter().collect()
}

fn strings(df: &DataFrame, col: &str) -> Vec<String> {
    let c = df.column(col).unwrap();
    (0..c.len()).map(|i| c.get(i).unwrap().get_str().unwrap().to_owned()).collect()
}

/// Rank 0's global train loss at each epoch of a point's trace.
fn losses(run_dir: &Path) -> Vec<f64> {
    let df = parquet(&run_dir.join("trace.parquet"));
    let rank0 = df.filter(&df.column("rank").unwrap().u32().unwrap().equal(0)).unwrap();
    f64s(&rank0, "global_train_loss")
}

#[test]
fn named_points_run_under_their_names_and_a_global_batch_splits_over_the_copies() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    write(dir.path(), "e.toml", NAMED);
    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("3 points of p.toml over 3 named points × run.seed (1)"), "{}", text(&o).0);
    let s = dir.path().join("s");
    let config = read(&s.join(DIRS[2]).join("config.toml"));
    assert!(
        config.contains("tensor = 2  # experiment [[points]] tp2 wrap.mesh.tensor=2")
            && config.contains("seed = 4  # sweep axis run.seed=4")
            && config.contains("batch_size = 16  # sweep [scaling] train.batch_size=16"),
        "tensor 2 is one copy of the model: the whole global batch on each rank\n{config}"
    );
    assert!(read(&s.join(DIRS[1]).join("config.toml")).contains("batch_size = 8  # sweep [scaling]"));
    let index: serde_json::Value = serde_json::from_str(&read(&s.join("sweep.json"))).unwrap();
    let names: Vec<&str> = index["points"].as_array().unwrap().iter().map(|p| p["point"].as_str().unwrap()).collect();
    assert_eq!(names, ["one", "ddp", "tp2"]);

    // The same global batch of the same rows from the same seed: the same losses.
    let one = losses(&s.join(DIRS[0]));
    for d in &DIRS[1..] {
        for (a, b) in one.iter().zip(losses(&s.join(d))) {
            assert!((a - b).abs() < 1e-5, "{d}: {a} against one rank's {b}");
        }
    }

    // A row per named point, in the file's order; tensor 2's two ranks pass one batch, so its
    // samples/s is their sum over 2.
    let summary = parquet(&s.join("summary.parquet"));
    assert_eq!(strings(&summary, "point"), ["one", "ddp", "tp2"]);
    let trace = parquet(&s.join(DIRS[2]).join("trace.parquet"));
    let last = trace.filter(&trace.column("epoch").unwrap().u32().unwrap().equal(2)).unwrap();
    let sum: f64 = f64s(&last, "samples_per_s").iter().sum();
    assert_eq!(f64s(&summary, "samples_per_s_mean")[2], sum / 2.0);
    let table = read(&s.join("table.md"));
    assert!(table.contains("| world size | point | seeds | train loss |"), "{table}");
    assert!(table.contains("\n| 2 | tp2 | 1 | "), "{table}");
    assert!(read(&s.join("table.csv")).starts_with("point,world_size,seeds,"));

    let o = run(&["sweep", "e.toml", "--out", "s", "--check"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("3 points reproduce s"), "{}", text(&o).0);
}

#[test]
fn bad_points_are_refused_by_name_and_line_before_anything_runs() {
    let cases: [(&str, &[&str]); 3] = [
        (
            "[sweep]\n\"run.seed\" = [0]\n\n[[points]]\nname = \"a\"\n\"run.seed\" = 1\n\n[[points]]\nname = \"a\"\n\
             \"train.lrr\" = 0.1\n\n[[points]]\n\"train.lr\" = 0.1\n",
            &[
                "error: e.toml:7: point `a` sets `run.seed`, but [sweep] sweeps it: keep the key in one place\n",
                "e.toml:10: two points are named `a` (the 1st and the 2nd [[points]] tables): give each point its own name\n",
                "e.toml:11: experiment [[points]] a train.lrr=0.1: unknown key `train.lrr`; did you mean `train.lr`?",
                "e.toml:13: the 3rd [[points]] table: no `name`: give each point a name, e.g. name = \"fsdp-tp2\"\n",
            ],
        ),
        (
            "[[points]]\nname = \"tp 2\"\n\"wrap.mesh.tensor\" = 2\n",
            &["error: e.toml:3: the 1st [[points]] table: the name \"tp 2\" cannot name a directory: use 1 to 64 letters, \
               digits, `.`, `_`, `+` or `-` (not starting with `.`), e.g. name = \"fsdp-tp2\""],
        ),
        (
            "[[points]]\nname = \"a\"\n\n[search]\nmethod = \"random\"\ntrials = 2\nmetric = \"val_loss\"\n\n\
             [search.space]\n\"train.lr\" = { log_uniform = [0.01, 0.1] }\n",
            &["error: e.toml:5: [search] and [[points]] cannot be combined yet: search over a [sweep] grid, or run the \
               named points without [search]"],
        ),
    ];
    for (body, expected) in cases {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "p.toml", TINY);
        write(dir.path(), "e.toml", &format!("pipeline = \"p.toml\"\n{body}"));
        let o = run(&["sweep", "e.toml"], dir.path());
        let (stdout, stderr) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{stdout}\n{stderr}");
        for line in expected {
            assert!(stderr.contains(line), "expected {line:?} in\n{stderr}");
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!dir.path().join("results").exists(), "nothing may be written");
    }
}

/// `results/parallelism`: `runner report` rebuilds its committed table from the traces alone,
/// every row's loss at every epoch is DDP's within 1e-5 (the same global batch from the same
/// seed, split six ways), docs/parallelism.md shows that table, and every point reproduces bit
/// for bit here, though it was made with the environment asking libtorch for its lowest kernels.
#[test]
fn the_committed_parallelism_table_agrees_reports_as_committed_and_reproduces() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let committed = root.join("results/parallelism");
    assert_reports_as_committed("parallelism");
    let table = read(&committed.join("table.md"));
    let names = ["ddp", "fsdp", "tp4", "fsdp2xtp2", "pp2xtp2", "pp2xdata2"];
    let ddp = losses(&committed.join("ddp"));
    assert_eq!(ddp.len(), 2);
    for name in names {
        for (a, b) in ddp.iter().zip(losses(&committed.join(name))) {
            assert!((a - b).abs() < 1e-5, "{name}: {b} against DDP's {a}");
        }
        assert!(table.contains(&format!("\n| 4 ⚠ | {name} | 1 | ")), "{name}\n{table}");
    }
    let header = table_lines(&table)[0];
    for column in [
        "tokens/s",
        "data sent MiB/step",
        "tensor sent MiB/step",
        "pipeline sent MiB/step",
        "peak RSS MiB | estimate MiB",
    ] {
        assert!(header.contains(column), "{column}: {header}");
    }
    let page = read(&root.join("docs/parallelism.md"));
    assert_eq!(table_lines(&page), table_lines(&table), "docs/parallelism.md shows the committed table");
    let manifest = read(&committed.join("tp4/manifest.json"));
    assert!(manifest.contains("ATEN_CPU_CAPABILITY=default"), "made under the lowest kernels: {manifest}");

    assert_reproduces("parallelism", 6);
}
