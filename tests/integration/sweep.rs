//! `runner sweep`, `runner report` and `--check` end to end: real sweeps of the tiny pipeline
//! (each point real rank processes), tables read back with polars, bad experiment files.
use crate::common;

use std::path::Path;
use std::time::SystemTime;

use common::{assert_ok, copy_tree, run, text, write, TINY};
use polars::prelude::*;

/// Two world sizes × two seeds of the tiny pipeline, two epochs each.
const EXPERIMENT: &str = r#"
pipeline = "p.toml"

[set]
"train.epochs" = 2

[sweep]
"run.world_size" = [1, 2]
"run.seed" = [0, 1]
"#;

const POINTS: [&str; 4] = ["world_size=1,seed=0", "world_size=1,seed=1", "world_size=2,seed=0", "world_size=2,seed=1"];

fn setup(experiment: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    write(dir.path(), "e.toml", experiment);
    dir
}

fn parquet(path: &Path) -> DataFrame {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ParquetReader::new(file).finish().unwrap()
}

fn f64s(df: &DataFrame, col: &str) -> Vec<f64> {
    df.column(col).unwrap().f64().unwrap().into_no_null_iter().collect()
}

fn status(run_dir: &Path) -> String {
    let m = std::fs::read_to_string(run_dir.join("manifest.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&m).unwrap();
    v["status"].as_str().unwrap().to_owned()
}

fn modified(path: &Path) -> SystemTime {
    std::fs::metadata(path).unwrap().modified().unwrap()
}

/// Rank 0's global train loss in the last epoch of a point's trace.
fn final_loss(run_dir: &Path) -> f64 {
    let df = parquet(&run_dir.join("trace.parquet"));
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    *f64s(&df.filter(&mask).unwrap(), "global_train_loss").last().unwrap()
}

#[test]
fn a_sweep_writes_its_table_from_the_traces_and_its_check_catches_one_altered_value() {
    let dir = setup(EXPERIMENT);
    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&o);
    let s = dir.path().join("s");
    for p in POINTS {
        assert_eq!(status(&s.join(p)), "complete", "{p}");
    }
    let config = std::fs::read_to_string(s.join("world_size=2,seed=1/config.toml")).unwrap();
    assert!(
        config.contains("world_size = 2  # sweep axis run.world_size=2")
            && config.contains("seed = 1  # sweep axis run.seed=1")
            && config.contains("epochs = 2  # experiment [set] train.epochs=2"),
        "{config}"
    );

    // One row per world size; the mean and std are those of the traces' final losses.
    let summary = parquet(&s.join("summary.parquet"));
    let worlds: Vec<u32> = summary.column("world_size").unwrap().u32().unwrap().into_no_null_iter().collect();
    assert_eq!(worlds, [1, 2]);
    let (a, b) = (final_loss(&s.join(POINTS[2])), final_loss(&s.join(POINTS[3])));
    let (mean, std) = ((a + b) / 2.0, (a - b).abs() / 2f64.sqrt());
    assert!((f64s(&summary, "train_loss_mean")[1] - mean).abs() < 1e-12);
    assert!((f64s(&summary, "train_loss_std")[1] - std).abs() < 1e-12);
    assert_eq!(f64s(&summary, "speedup")[0], 1.0);
    let csv = std::fs::read_to_string(s.join("table.csv")).unwrap();
    assert!(csv.starts_with("world_size,seeds,final_epoch,train_loss_mean"), "{csv}");
    assert!(
        csv.lines().next().unwrap().contains(",val_acc_std,val_f1_mean,val_f1_std,"),
        "macro-F1 next to accuracy: {csv}"
    );
    assert_eq!(csv.lines().count(), 3, "{csv}");
    let table = std::fs::read_to_string(s.join("table.md")).unwrap();
    assert!(table.contains(&format!("| 2 | 2 | {mean:.4} ± {std:.4} |")), "{table}");
    for png in ["loss.png", "val_accuracy.png", "throughput.png"] {
        let bytes = std::fs::read(s.join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{png} is a PNG");
    }

    // `report` rebuilds the same table and every plot from the traces alone.
    for f in ["table.md", "table.csv", "summary.parquet", "loss.png", "throughput.png"] {
        std::fs::remove_file(s.join(f)).unwrap();
    }
    assert_ok(&run(&["report", "s"], dir.path()));
    assert_eq!(std::fs::read_to_string(s.join("table.md")).unwrap(), table);
    assert_eq!(std::fs::read_to_string(s.join("table.csv")).unwrap(), csv);
    assert!(s.join("loss.png").is_file() && s.join("throughput.png").is_file());

    // --check reruns every point and finds every non-timing value identical.
    let o = run(&["sweep", "e.toml", "--out", "s", "--check"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("4 points reproduce s"), "{}", text(&o).0);

    // Alter one stored value: the check names it, and only it.
    let trace_path = s.join(POINTS[3]).join("trace.parquet");
    let mut df = parquet(&trace_path);
    let mut loss = f64s(&df, "global_train_loss");
    let original = loss[1];
    loss[1] += 1e-9;
    df.with_column(Column::new("global_train_loss".into(), loss)).unwrap();
    ParquetWriter::new(std::fs::File::create(&trace_path).unwrap()).finish(&mut df).unwrap();
    let o = run(&["sweep", "e.toml", "--out", "s", "--check"], dir.path());
    let (_, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    let (epoch, rank) = (df.column("epoch").unwrap().get(1).unwrap(), df.column("rank").unwrap().get(1).unwrap());
    let stored = original + 1e-9;
    let relative = (stored - original).abs() / stored.abs().max(original.abs());
    assert_eq!(
        stderr.trim(),
        format!(
            "error: 1 difference between s and a rerun:\n  world_size=2,seed=1: row 1 (epoch {epoch}, rank {rank}): \
             `global_train_loss` stored {stored:?} but the rerun gives {original:?} (relative difference {relative:.1e})\n\
             stored on {here}, rerun on {here}; where the CPUs differ, --tolerance REL accepts values within a \
             relative difference REL",
            here = stored_numerics(&s),
        )
    );
    // Within a tolerance the altered value is accepted, and counted.
    let o = run(&["sweep", "e.toml", "--out", "s", "--check", "--tolerance", "1e-6"], dir.path());
    let (stdout, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    assert!(stdout.contains("1 float values differ by at most"), "{stdout}");
}

#[test]
fn an_interrupted_sweep_resumes_and_a_changed_configuration_reruns() {
    let experiment = EXPERIMENT.replace("[1, 2]", "[1]");
    let dir = setup(&experiment);
    assert_ok(&run(&["sweep", "e.toml", "--out", "s"], dir.path()));
    let s = dir.path().join("s");
    let kept = s.join(POINTS[0]).join("trace.parquet");
    let before = modified(&kept);

    // As if the sweep had been killed during the second point.
    let manifest = s.join(POINTS[1]).join("manifest.json");
    let text_before = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text_before.replace("\"complete\"", "\"running\"")).unwrap();
    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(
        stdout.contains(&format!("[1/2] {}: already complete (same configuration), skipped", POINTS[0]))
            && stdout.contains(&format!("[2/2] {}: complete in", POINTS[1]))
            && stdout.contains("2 of 2 points complete (1 run now, 1 already complete)"),
        "{stdout}"
    );
    assert_eq!(modified(&kept), before, "the complete point was not rerun");
    assert_eq!(status(&s.join(POINTS[1])), "complete");

    // Another epoch count is another configuration: nothing is skipped.
    write(dir.path(), "e.toml", &experiment.replace("\"train.epochs\" = 2", "\"train.epochs\" = 3"));
    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("(2 run now, 0 already complete)"), "{}", text(&o).0);
    // --force reruns complete points too.
    let o = run(&["sweep", "e.toml", "--out", "s", "--force"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("(2 run now, 0 already complete)"));
}

#[test]
fn a_failed_point_is_recorded_and_the_sweep_goes_on_unless_fail_fast() {
    let experiment = EXPERIMENT.replace("[1, 2]", "[1]").replace("[0, 1]", "[0, 1, 2]");
    let dir = setup(&experiment);
    std::fs::create_dir(dir.path().join("s")).unwrap();
    // A file where the second point's run directory goes.
    write(&dir.path().join("s"), "world_size=1,seed=1", "");

    let o = run(&["sweep", "e.toml", "--out", "s", "--fail-fast"], dir.path());
    let (stdout, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("error: point world_size=1,seed=1 failed: cannot create")
            && stderr.contains("--fail-fast stopped the sweep; 1 of 3 points did not run"),
        "{stderr}"
    );
    assert!(!dir.path().join("s/world_size=1,seed=2").exists());

    let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    let (stdout, stderr) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("2 of 3 points complete (1 run now, 1 already complete)"), "{stdout}");
    assert_eq!(status(&dir.path().join("s/world_size=1,seed=2")), "complete");
    let table = std::fs::read_to_string(dir.path().join("s/table.md")).unwrap();
    assert!(table.contains("| 1 | 2 |") && table.contains("- `world_size=1,seed=1`: no manifest.json"), "{table}");
}

struct Bad {
    name: &'static str,
    experiment: &'static str,
    expected: &'static str,
}

const BAD: &[Bad] = &[
    Bad {
        name: "unknown key in the experiment file",
        experiment: "pipeline = \"p.toml\"\n[sweeps]\n\"run.seed\" = [0]\n",
        expected: "error: e.toml:2:2: unknown key `sweeps`; did you mean `sweep`? \
                   (valid keys in the file: pipeline, set, sweep, scaling, slurm, search, points)\n  2 | [sweeps]",
    },
    Bad {
        name: "axes naming no key, an empty axis, a value of the wrong type",
        experiment: "pipeline = \"p.toml\"\n[sweep]\n\"run.wrld_size\" = [1, 2]\n\"run.seed\" = []\n\
                     \"train.epochs\" = [1, \"two\"]\n",
        expected: "error: e.toml:3: sweep axis run.wrld_size=1: unknown key `run.wrld_size`; did you mean \
                   `run.world_size`? (valid keys in [run]: run.name, run.seed, run.world_size, run.backend, \
                   run.device, run.threads_per_rank, run.timeout_s, run.abort_after_s, run.step_timeout_s, run.memory_per_rank_mb, run.peak_tflops, run.cuda_graphs, run.preempt_signal, run.max_restarts, run.rejoin_timeout_s, run.numerics)\n\
                   e.toml:4: the axis `run.seed` is empty; give it at least one value\n\
                   e.toml:5: sweep axis train.epochs=\"two\": `train.epochs`: invalid type: found string \"two\", \
                   expected usize",
    },
    Bad {
        name: "points that fail validation",
        experiment: "pipeline = \"p.toml\"\n[sweep]\n\"run.world_size\" = [1, 2]\n\"train.batch_size\" = [16, 700]\n",
        expected: "error: e.toml: 2 of 4 points are invalid; nothing was run:\n  \
                   point world_size=1,batch_size=700:\n    p.toml: invalid configuration:\n      \
                   `train.batch_size` (sweep axis train.batch_size=700): 700 per rank is larger than a rank's \
                   shard of 600 rows (600 rows / 1 ranks); use at most 600\n  \
                   point world_size=2,batch_size=700:\n    p.toml: invalid configuration:\n      \
                   `train.batch_size` (sweep axis train.batch_size=700): 700 per rank is larger than a rank's \
                   shard of 300 rows (600 rows / 2 ranks); use at most 300",
    },
    Bad {
        name: "a global batch that does not split",
        experiment: "pipeline = \"p.toml\"\n[scaling]\nbatch = \"global\"\n[sweep]\n\"run.world_size\" = [1, 3]\n",
        expected: "error: e.toml: 1 of 2 points are invalid; nothing was run:\n  point world_size=3:\n    \
                   [scaling] batch = \"global\": the global batch train.batch_size = 16 does not split evenly \
                   over 3 ranks; use a multiple of 3",
    },
    Bad {
        name: "a missing pipeline",
        experiment: "pipeline = \"../pipelines/nope.toml\"\n",
        expected: "error: e.toml:1: `pipeline` names ../pipelines/nope.toml, which is not a file \
                   (the path is relative to the experiment file)",
    },
];

#[test]
fn bad_experiments_are_refused_with_every_problem_before_anything_runs() {
    for case in BAD {
        let dir = setup(case.experiment);
        let o = run(&["sweep", "e.toml"], dir.path());
        let (stdout, stderr) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{}: {stdout}\n{stderr}", case.name);
        assert_eq!(stderr.trim_end(), case.expected, "{}", case.name);
        assert!(!dir.path().join("results").exists(), "{}: nothing may be written", case.name);
    }
}

#[test]
fn report_and_check_refuse_a_directory_that_holds_no_sweep() {
    let dir = setup(EXPERIMENT);
    let o = run(&["report", "nowhere"], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim_end(),
        "error: cannot read nowhere/sweep.json: No such file or directory (os error 2); \
         is nowhere a sweep directory (written by `runner sweep`)?"
    );
    let o = run(&["sweep", "e.toml", "--out", "nowhere", "--check"], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        text(&o).1.trim_end(),
        "error: nowhere holds no sweep to check (no sweep.json): run the sweep without --check first"
    );
    assert!(!dir.path().join("nowhere").exists());
}

#[test]
fn stopping_a_sweep_stops_its_running_point_which_a_rerun_resumes() {
    use common::{alive, children, runner};
    use nix::sys::signal::{kill, Signal};
    use std::time::{Duration, Instant};
    let dir = setup(
        "pipeline = \"p.toml\"\n[set]\n\"train.epochs\" = 40\n\"checkpoint.every\" = 1\n[sweep]\n\"run.seed\" = [0]\n",
    );
    let mut sweep = runner()
        .args(["sweep", "e.toml", "--out", "s"])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (point, processes) = loop {
        let launchers = children(sweep.id());
        let ranks: Vec<u32> = launchers.iter().flat_map(|&l| children(l)).collect();
        let point = std::fs::read_dir(dir.path().join("s"))
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| p.join("checkpoints").is_dir());
        if let (Some(point), 1, 2) = (&point, launchers.len(), ranks.len()) {
            // A checkpoint is complete once its index is written, after its tensors.
            let complete = common::has_checkpoint(point);
            if complete {
                break (point.clone(), [launchers, ranks].concat());
            }
        }
        assert!(Instant::now() < deadline, "the point did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    kill(nix::unistd::Pid::from_raw(sweep.id() as i32), Signal::SIGINT).unwrap();
    let stopped = Instant::now();
    let exit = loop {
        if let Some(s) = sweep.try_wait().unwrap() {
            break s;
        }
        assert!(stopped.elapsed() < Duration::from_secs(15), "the sweep did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(sweep.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(exit.code(), Some(130), "{err}");
    assert!(err.contains("was stopped and marked interrupted; run the sweep again to resume it"), "{err}");
    for pid in processes {
        assert!(!alive(pid), "process {pid} of the point outlived the sweep");
    }
    assert_eq!(status(&point), "interrupted");
    let again = run(&["sweep", "e.toml", "--out", "s"], dir.path());
    assert_ok(&again);
    assert_eq!(status(&point), "complete");
    let log = std::fs::read_to_string(point.join("run.log")).unwrap();
    assert!(log.contains("resuming run") && log.contains("(interrupted)"), "{log}");
}

/// DDP against FSDP at world sizes 1 and 2, on an MLP deep enough (nine layers, 7683 parameters)
/// for sharding to hold clearly less than a whole replica, gathered layers and buffers included.
const STRATEGIES: &str = r#"
pipeline = "p.toml"

[set]
"train.epochs" = 1
"train.optimizer" = "adam"
"wrap.model.hidden" = [32, 32, 32, 32, 32, 32, 32, 32]

[sweep]
"run.world_size" = [1, 2]
"wrap.strategy" = ["ddp", "fsdp"]
"#;

/// 5 → 32 → (32 → 32) × 7 → 3, weights and biases.
const PARAMETERS: f64 = (5 * 32 + 32 + 7 * (32 * 32 + 32) + 32 * 3 + 3) as f64;

/// The largest per-rank sum of `columns` in the final epoch of a point's trace.
fn most_on_a_rank(run_dir: &Path, columns: &[&str]) -> f64 {
    let df = parquet(&run_dir.join("trace.parquet"));
    let epochs = df.column("epoch").unwrap().u32().unwrap();
    let last = df.filter(&epochs.equal(epochs.max().unwrap())).unwrap();
    let sum = |i: usize| -> f64 {
        let value = |c: &&str| last.column(c).unwrap().cast(&DataType::Float64).unwrap().f64().unwrap().get(i).unwrap();
        columns.iter().map(value).sum()
    };
    (0..last.height()).map(sum).fold(0.0, f64::max)
}

/// Rewrites a point's trace as a runner from before the memory columns (and the bytes sent, which
/// came after them) wrote it.
fn drop_memory_columns(run_dir: &Path) {
    let path = run_dir.join("trace.parquet");
    let mut df = parquet(&path).drop_many([
        "param_bytes",
        "grad_bytes",
        "optim_bytes",
        "peak_rss_bytes",
        "sent_data_bytes",
        "sent_tensor_bytes",
        "sent_pipeline_bytes",
    ]);
    ParquetWriter::new(std::fs::File::create(&path).unwrap()).finish(&mut df).unwrap();
}

#[test]
fn a_strategy_axis_puts_each_ranks_memory_beside_throughput_and_older_traces_report_without_it() {
    const POINTS: [&str; 4] = [
        "world_size=1,strategy=ddp",
        "world_size=1,strategy=fsdp",
        "world_size=2,strategy=ddp",
        "world_size=2,strategy=fsdp",
    ];
    let dir = setup(STRATEGIES);
    assert_ok(&run(&["sweep", "e.toml", "--out", "s"], dir.path()));
    let s = dir.path().join("s");
    for p in POINTS {
        assert_eq!(status(&s.join(p)), "complete", "{p}");
    }
    let config = std::fs::read_to_string(s.join(POINTS[3]).join("config.toml")).unwrap();
    assert!(config.contains("strategy = \"fsdp\"  # sweep axis wrap.strategy=\"fsdp\""), "{config}");

    // A row per strategy and world size; the memory columns are the traces' (the final epoch's
    // rank holding the most), and DDP's is a whole replica: 4 bytes of parameter, 4 of gradient
    // and 8 of Adam's two moments per parameter, at every world size.
    let summary = parquet(&s.join("summary.parquet"));
    let column = summary.column("wrap.strategy").unwrap();
    let strategies: Vec<String> =
        (0..column.len()).map(|i| column.get(i).unwrap().get_str().unwrap().to_owned()).collect();
    assert_eq!(strategies, ["\"ddp\"", "\"ddp\"", "\"fsdp\"", "\"fsdp\""]);
    let worlds: Vec<u32> = summary.column("world_size").unwrap().u32().unwrap().into_no_null_iter().collect();
    assert_eq!(worlds, [1, 2, 1, 2]);
    let state = f64s(&summary, "state_bytes_mean");
    let peak = f64s(&summary, "peak_rss_bytes_mean");
    let estimate = f64s(&summary, "estimate_bytes_mean");
    let sent = f64s(&summary, "sent_data_bytes_mean");
    for (row, point) in [POINTS[0], POINTS[2], POINTS[1], POINTS[3]].iter().enumerate() {
        let run_dir = s.join(point);
        assert_eq!(state[row], most_on_a_rank(&run_dir, &["param_bytes", "grad_bytes", "optim_bytes"]), "{point}");
        assert_eq!(peak[row], most_on_a_rank(&run_dir, &["peak_rss_bytes"]), "{point}");
        assert_eq!(sent[row], most_on_a_rank(&run_dir, &["sent_data_bytes"]), "{point}");
        // The plan's whole-process estimate beside it (a debug build adds about 28 MiB of code).
        assert!(
            (estimate[row] - peak[row]).abs() < 0.3 * peak[row],
            "{point}: {} against {}",
            estimate[row],
            peak[row]
        );
        // A process that has loaded libtorch.
        assert!(peak[row] > 50.0 * 1048576.0 && peak[row] < 4096.0 * 1048576.0, "{point}: {}", peak[row]);
    }
    assert_eq!((state[0], state[1]), (16.0 * PARAMETERS, 16.0 * PARAMETERS));
    // One rank sends nothing; DDP at 2 ranks hands every gradient to one all-reduce a step (and
    // rank 0 its Reducer's rebuilt bucket order once, a few hundred bytes over the epoch's steps).
    assert_eq!((sent[0], sent[2]), (0.0, 0.0));
    assert!(sent[1] >= 4.0 * PARAMETERS && sent[1] < 4.0 * PARAMETERS + 64.0, "{}", sent[1]);
    let (fsdp1, fsdp2) = (state[2], state[3]);
    assert!(fsdp2 < state[1], "FSDP at 2 ranks holds {fsdp2} bytes a rank, DDP {}", state[1]);
    assert!(fsdp2 < fsdp1, "FSDP's state falls with the world size: {fsdp1} at 1 rank, {fsdp2} at 2");

    let csv = std::fs::read_to_string(s.join("table.csv")).unwrap();
    let header = csv.lines().next().unwrap();
    assert!(
        header.starts_with("wrap.strategy,world_size,")
            && header.contains(
                ",samples_per_s_std,sent_data_bytes_mean,sent_data_bytes_std,state_bytes_mean,state_bytes_std,\
                 peak_rss_bytes_mean,peak_rss_bytes_std,estimate_bytes_mean,estimate_bytes_std,speedup,"
            ),
        "{header}"
    );
    let table = std::fs::read_to_string(s.join("table.md")).unwrap();
    assert!(
        table.contains("| world size | wrap.strategy | seeds |")
            && table
                .contains("| speedup | efficiency | data sent MiB/step | state MiB | peak RSS MiB | estimate MiB |\n")
            && table.contains("State MiB: the training state (parameters, gradients and optimizer state)"),
        "{table}"
    );
    // FSDP at 2 ranks: its state in MiB to three significant digits, then its peak resident memory
    // and the plan's estimate.
    let row = table.lines().find(|l| l.starts_with("| 2 | \"fsdp\" |")).unwrap();
    let mib = fsdp2 / 1048576.0;
    let digits = (2 - mib.log10().floor() as i64) as usize;
    let (peak_mib, estimate_mib) = (peak[3] / 1048576.0, estimate[3] / 1048576.0);
    assert!(row.ends_with(&format!(" | {mib:.digits$} | {peak_mib:.0} | {estimate_mib:.0} |")), "{row}");
    assert!(std::fs::read(s.join("memory.png")).unwrap().starts_with(b"\x89PNG"));

    // `report` rebuilds all of it from the traces alone.
    for f in ["table.md", "table.csv", "summary.parquet", "memory.png"] {
        std::fs::remove_file(s.join(f)).unwrap();
    }
    assert_ok(&run(&["report", "s"], dir.path()));
    assert_eq!(std::fs::read_to_string(s.join("table.md")).unwrap(), table);
    assert_eq!(std::fs::read_to_string(s.join("table.csv")).unwrap(), csv);
    assert!(s.join("memory.png").is_file());

    // A trace from before the memory columns: its row's memory is absent, not zero.
    drop_memory_columns(&s.join(POINTS[3]));
    assert_ok(&run(&["report", "s"], dir.path()));
    let table = std::fs::read_to_string(s.join("table.md")).unwrap();
    let row = table.lines().find(|l| l.starts_with("| 2 | \"fsdp\" |")).unwrap();
    assert!(row.ends_with(&format!(" | — | — | {estimate_mib:.0} |")), "{row}");
    let summary = parquet(&s.join("summary.parquet"));
    assert_eq!(summary.column("state_bytes_mean").unwrap().f64().unwrap().get(3), None);
    assert_eq!(summary.column("peak_rss_bytes_mean").unwrap().f64().unwrap().get(0), Some(peak[0]));

    // A sweep made wholly before them reports without the memory columns, and --check
    // reproduces it (a rerun's memory columns are new, not differences).
    for p in &POINTS[..3] {
        drop_memory_columns(&s.join(p));
    }
    std::fs::remove_file(s.join("memory.png")).unwrap();
    assert_ok(&run(&["report", "s"], dir.path()));
    let table = std::fs::read_to_string(s.join("table.md")).unwrap();
    assert!(!table.contains("MiB") && table.contains("| speedup | efficiency |\n"), "{table}");
    let csv = std::fs::read_to_string(s.join("table.csv")).unwrap();
    assert!(!csv.contains("bytes") && csv.contains(",samples_per_s_std,speedup,"), "{csv}");
    assert!(!s.join("memory.png").exists(), "no memory plot without memory");
    let o = run(&["sweep", "e.toml", "--out", "s", "--check"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("4 points reproduce s"), "{}", text(&o).0);
}

/// The committed world-size sweep: `report` rebuilds its tables as committed, byte for byte, and
/// its memory plot from the traces' memory columns.
#[test]
fn the_committed_world_size_sweep_reports_as_committed() {
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/world_size");
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("world_size");
    copy_tree(&committed, &copy);
    for f in ["table.md", "table.csv", "memory.png"] {
        let _ = std::fs::remove_file(copy.join(f));
    }
    assert_ok(&run(&["report", "world_size"], dir.path()));
    for f in ["table.md", "table.csv"] {
        let (now, then) = (std::fs::read_to_string(copy.join(f)).unwrap(), std::fs::read_to_string(committed.join(f)));
        assert_eq!(now, then.unwrap(), "{f}");
    }
    assert!(copy.join("memory.png").is_file());
}

/// What a sweep's points computed under, as `--check` names it ("AMD EPYC (MKL_CBWR=unset, ATen
/// AVX2, oneDNN on, 2 threads per rank)"): the kernels depend on the machine.
fn stored_numerics(sweep: &Path) -> String {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sweep.join("sweep.json")).unwrap()).unwrap();
    serde_json::from_value::<runner::numerics::Numerics>(index["numerics"].clone()).unwrap().to_string()
}

/// The committed sharding sweep reproduces in this build, debug or release: its two points at
/// world size 2 and seed 0, DDP and FSDP (`runner sweep experiments/sharding.toml --check`
/// reruns all 18, in about 1.5 min with a release build, 2.5 min with a debug one).
#[test]
fn the_committed_sharding_sweep_reproduces() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let sharding = root.join("experiments/sharding.toml");
    let subset = format!("extends = {:?}\n[sweep]\n\"run.world_size\" = [2]\n\"run.seed\" = [0]\n", sharding);
    write(dir.path(), "e.toml", &subset);
    let stored = root.join("results/sharding");
    let o = run(&["sweep", "e.toml", "--out", stored.to_str().unwrap(), "--check"], dir.path());
    assert_ok(&o);
    let (stdout, _) = text(&o);
    assert!(
        stdout.contains("world_size=2,strategy=fsdp,seed=0: reproduced") && stdout.contains("2 points reproduce"),
        "{stdout}"
    );
}

/// Every file of a sweep directory but the run locks, by path, with its bytes.
fn files_of(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.file_name().unwrap() != ".runner.lock" {
                let name = path.strip_prefix(dir).unwrap().display().to_string();
                out.insert(name, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

/// A sweep (a grid, then a search) made on another machine and committed: `runner sweep` here,
/// with every point already complete, runs nothing and leaves every file byte for byte as it
/// was: sweep.json still names the CPU its runs ran on.
#[test]
fn a_sweep_that_runs_nothing_leaves_its_committed_results_unchanged() {
    let grid = "pipeline = \"p.toml\"\n[set]\n\"run.world_size\" = 1\n\"train.epochs\" = 1\n";
    let search = format!(
        "{grid}\n[search]\nmethod = \"random\"\ntrials = 2\nmetric = \"val_loss\"\n\n[search.space]\n\
         \"train.lr\" = {{ log_uniform = [0.01, 0.1] }}\n"
    );
    for experiment in [grid.to_owned(), search] {
        let dir = setup(&experiment);
        assert_ok(&run(&["sweep", "e.toml", "--out", "s"], dir.path()));
        let index = dir.path().join("s/sweep.json");
        let here = std::fs::read_to_string(&index).unwrap();
        let cpu = serde_json::from_str::<serde_json::Value>(&here).unwrap()["numerics"]["cpu"].clone();
        let elsewhere = here.replace(&cpu.to_string(), "\"Another CPU, where the sweep was committed\"");
        assert_ne!(here, elsewhere, "the index names this machine's CPU");
        std::fs::write(&index, elsewhere).unwrap();
        let committed = files_of(&dir.path().join("s"));
        let o = run(&["sweep", "e.toml", "--out", "s"], dir.path());
        assert_ok(&o);
        let now = files_of(&dir.path().join("s"));
        let changed: Vec<&String> = now.keys().filter(|f| committed.get(*f) != now.get(*f)).collect();
        assert!(changed.is_empty() && now.len() == committed.len(), "{experiment}\nchanged: {changed:?}");
    }
}
