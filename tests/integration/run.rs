//! `runner run` end to end: real rank processes, real c10d, traces read back with polars.
use crate::common;

use std::path::Path;

use common::{assert_ok, run, text, write, OutputLater, TINY};
use polars::prelude::*;

fn trace(dir: &Path) -> DataFrame {
    let file = std::fs::File::open(dir.join("trace.parquet")).expect("trace.parquet exists");
    ParquetReader::new(file).finish().unwrap()
}

/// The pinned schema of trace.parquet.
const SCHEMA: &[(&str, DataType)] = &[
    ("run_id", DataType::String),
    ("epoch", DataType::UInt32),
    ("step", DataType::UInt64),
    ("rank", DataType::UInt32),
    ("world_size", DataType::UInt32),
    ("train_loss", DataType::Float64),
    ("train_acc", DataType::Float64),
    ("global_train_loss", DataType::Float64),
    ("global_train_acc", DataType::Float64),
    ("val_loss", DataType::Float64),
    ("val_acc", DataType::Float64),
    ("samples", DataType::UInt64),
    ("steps", DataType::UInt64),
    ("epoch_s", DataType::Float64),
    ("samples_per_s", DataType::Float64),
    ("comm_s", DataType::Float64),
    ("compute_s", DataType::Float64),
    ("bubble", DataType::Float64),
    ("val_f1", DataType::Float64),
    ("val_rmse", DataType::Float64),
    ("val_mae", DataType::Float64),
    ("val_r2", DataType::Float64),
    ("perplexity", DataType::Float64),
    ("val_perplexity", DataType::Float64),
    ("tokens_per_s", DataType::Float64),
    ("mfu", DataType::Float64),
    ("lr", DataType::Float64),
    ("grad_norm_mean", DataType::Float64),
    ("grad_norm_max", DataType::Float64),
    ("param_bytes", DataType::UInt64),
    ("grad_bytes", DataType::UInt64),
    ("optim_bytes", DataType::UInt64),
    ("peak_rss_bytes", DataType::UInt64),
    ("sent_data_bytes", DataType::Float64),
    ("sent_tensor_bytes", DataType::Float64),
    ("sent_pipeline_bytes", DataType::Float64),
];

fn f64s(df: &DataFrame, col: &str) -> Vec<Option<f64>> {
    df.column(col).unwrap().f64().unwrap().iter().collect()
}

#[test]
fn runs_at_world_sizes_1_2_and_3_with_a_pinned_trace_schema() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    for world in [1usize, 2, 3] {
        let out_dir = format!("out-{world}");
        let o = run(&["run", "p.toml", "--set", &format!("run.world_size={world}"), "--out", &out_dir], dir.path());
        assert_ok(&o);
        let run_dir = dir.path().join(&out_dir);
        let df = trace(&run_dir);
        let schema: Vec<(String, DataType)> = df.schema().iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
        let pinned: Vec<(String, DataType)> = SCHEMA.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
        assert_eq!(schema, pinned);
        assert_eq!(df.height(), world * 2, "one row per rank per epoch");
        // Every training row is counted once per epoch, whatever the split (600 = 3 × 200,
        // 2 × 300; at world size 3 nothing pads, so check the sum).
        let samples: u64 = df.column("samples").unwrap().u64().unwrap().into_no_null_iter().sum();
        assert_eq!(samples, 600 * 2);
        // Validation on rank 0 only.
        let val: Vec<Option<f64>> = f64s(&df, "val_loss");
        let ranks: Vec<u32> = df.column("rank").unwrap().u32().unwrap().into_no_null_iter().collect();
        for (v, r) in val.iter().zip(&ranks) {
            assert_eq!(v.is_some(), *r == 0, "val_loss on rank {r}: {v:?}");
        }
        let manifest = std::fs::read_to_string(run_dir.join("manifest.json")).unwrap();
        assert!(manifest.contains("\"status\": \"complete\""), "{manifest}");
        let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
        assert!(config.contains(&format!("world_size = {world}  # --set run.world_size={world}")), "{config}");
        assert!(config.contains("epochs = 2  # file"), "{config}");
        assert!(config.contains("bucket_cap_mb = 25.0  # default"), "{config}");
        let steps = ParquetReader::new(std::fs::File::open(run_dir.join("steps.parquet")).unwrap()).finish().unwrap();
        assert!(steps.height() > 0, "steps.parquet has sampled steps");
    }
}

#[test]
fn an_uneven_split_pads_without_counting_a_sample_twice() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    // 601 training rows over 3 ranks: 201 each, 2 of them padding.
    let o = run(&["run", "p.toml", "--set", "run.world_size=3", "--set", "load.rows=601", "--out", "o"], dir.path());
    assert_ok(&o);
    let df = trace(&dir.path().join("o"));
    let samples: Vec<u64> = df.column("samples").unwrap().u64().unwrap().into_no_null_iter().collect();
    assert_eq!(samples.iter().sum::<u64>(), 601 * 2, "{samples:?}");
    let (stdout, _) = text(&o);
    assert!(stdout.contains("2 padding rows (not counted in metrics)"), "{stdout}");
}

#[test]
fn a_rerun_reproduces_every_value_but_the_timings() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    assert_ok(&run(&["run", "p.toml", "--out", "a"], dir.path()));
    assert_ok(&run(&["run", "p.toml", "--out", "b"], dir.path()));
    let (a, b) = (trace(&dir.path().join("a")), trace(&dir.path().join("b")));
    for name in a.get_column_names() {
        if common::measured(name) {
            continue;
        }
        assert_eq!(a.column(name).unwrap(), b.column(name).unwrap(), "column {name} differs between reruns");
    }
}

#[test]
fn ddp_two_ranks_equal_one_rank_with_twice_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let common = ["--set", "normalize.scope=\"global\"", "--set", "train.epochs=3", "--set", "load.rows=640"];
    let two =
        [&["run", "p.toml", "--out", "two", "--set", "run.world_size=2", "--set", "train.batch_size=16"][..], &common]
            .concat();
    let one =
        [&["run", "p.toml", "--out", "one", "--set", "run.world_size=1", "--set", "train.batch_size=32"][..], &common]
            .concat();
    assert_ok(&run(&two, dir.path()));
    assert_ok(&run(&one, dir.path()));
    let rank0 = |d: &str| {
        let df = trace(&dir.path().join(d));
        let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
        f64s(&df.filter(&mask).unwrap(), "global_train_loss").into_iter().map(Option::unwrap).collect::<Vec<_>>()
    };
    let (l2, l1) = (rank0("two"), rank0("one"));
    assert_eq!(l2.len(), 3);
    for (e, (a, b)) in l2.iter().zip(&l1).enumerate() {
        assert!(((a - b) / b).abs() < 1e-5, "epoch {}: 2 ranks × 16 gave {a}, 1 rank × 32 gave {b}", e + 1);
    }
}

#[test]
fn the_seed_pipeline_learns() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let pipeline = root.join("pipelines/ddp.toml");
    let o = run(&["run", pipeline.to_str().unwrap(), "--set", "train.epochs=3", "--out", "o"], dir.path());
    assert_ok(&o);
    let df = trace(&dir.path().join("o"));
    let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
    let r0 = df.filter(&mask).unwrap();
    let loss: Vec<f64> = f64s(&r0, "global_train_loss").into_iter().map(Option::unwrap).collect();
    let acc: Vec<f64> = f64s(&r0, "val_acc").into_iter().map(Option::unwrap).collect();
    assert!(loss.windows(2).all(|w| w[1] < w[0]), "loss must fall epoch over epoch: {loss:?}");
    assert!(acc[2] > acc[0] && acc[2] > 0.7, "validation accuracy must rise: {acc:?}");
    let (stdout, _) = text(&o);
    assert!(stdout.contains("DistributedSampler over 4 ranks") && stdout.contains("val accuracy"), "{stdout}");
}

#[test]
fn under_torchrun_variables_each_process_is_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // What torchrun (without its agent store), Slurm or a hand-written script would do.
    let ranks: Vec<_> = (0..2).map(|r| torchrun_rank(dir.path(), port, r, &[])).collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "rank {r}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // Rank 0 wrote everything; nobody spawned more processes.
    let run_dir = dir.path().join("o");
    assert_eq!(trace(&run_dir).height(), 2 * 2);
    assert!(std::fs::read_to_string(run_dir.join("manifest.json")).unwrap().contains("\"status\": \"complete\""));
    assert!(run_dir.join("config.toml").exists());
}

/// Under torchrun, rank 0 says what the launcher says (the plan with its run id, the run
/// directory); a complete run's directory is never replaced by a fresh run, whichever launcher
/// starts it, unless `--force`.
#[test]
fn a_torchrun_run_names_its_directory_and_a_complete_run_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let both = |port: u16| -> Vec<std::process::Output> {
        let ranks: Vec<_> = (0..2).map(|r| torchrun_rank(dir.path(), port, r, &[])).collect();
        ranks.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
    };
    let first = both(port());
    assert!(first.iter().all(|o| o.status.success()), "{}", String::from_utf8_lossy(&first[1].stderr));
    let validate = run(&["validate", "p.toml"], dir.path());
    let (plan, _) = text(&validate);
    let header = plan.lines().find(|l| l.starts_with("run ")).expect("validate prints the run id").to_owned();
    let (rank0, _) = text(&first[0]);
    let (rank1, _) = text(&first[1]);
    assert!(rank0.contains(&header) && rank0.contains("  run directory: o"), "{rank0}");
    assert!(!rank1.contains(&header) && !rank1.contains("run directory"), "only rank 0 speaks: {rank1}");
    let model = std::fs::read(dir.path().join("o/model.safetensors")).unwrap();
    let trace_bytes = std::fs::read(dir.path().join("o/trace.parquet")).unwrap();
    // The same configuration again, under torchrun and under runner's own launcher: refused.
    let again = both(port());
    for (r, o) in again.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "rank {r}: {err}");
        assert!(err.contains("o holds this configuration's complete run") && err.contains("--force"), "{err}");
    }
    let own = run(&["run", "p.toml", "--out", "o"], dir.path());
    let (_, err) = text(&own);
    assert_eq!(own.status.code(), Some(2), "{err}");
    assert!(err.contains("complete run") && err.contains("--resume o"), "{err}");
    assert_eq!(std::fs::read(dir.path().join("o/model.safetensors")).unwrap(), model, "the model is kept");
    assert_eq!(std::fs::read(dir.path().join("o/trace.parquet")).unwrap(), trace_bytes, "the trace is kept");
    assert!(std::fs::read_to_string(dir.path().join("o/manifest.json")).unwrap().contains("\"status\": \"complete\""));
    // --force replaces it, as asked.
    assert_ok(&run(&["run", "p.toml", "--out", "o", "--force"], dir.path()));
}

#[test]
fn under_torchrun_variables_a_rank_whose_configuration_differs_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // Rank 1 was given another learning rate and seed: both ranks refuse, naming both keys.
    let ranks: Vec<_> = [["train.lr=0.05", "run.seed=3"], ["train.lr=0.07", "run.seed=4"]]
        .iter()
        .enumerate()
        .map(|(r, sets)| torchrun_rank(dir.path(), port, r, &["--set", sets[0], "--set", sets[1]]))
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "rank {r}: {err}");
        assert!(err.contains(&format!("error: rank {r}: the ranks do not run the same configuration")), "{err}");
        assert!(err.contains("train.lr: rank 0: 0.05, rank 1: 0.07"), "{err}");
        assert!(err.contains("run.seed: rank 0: 3, rank 1: 4"), "{err}");
    }
    assert!(!dir.path().join("o/manifest.json").exists(), "a refused run claims no directory");
}

#[test]
fn csv_and_parquet_files_train_like_the_synthetic_source() {
    let dir = tempfile::tempdir().unwrap();
    // 400 rows: label = which of x0, x1 is larger; a constant third feature.
    let (mut x0, mut x1, mut c, mut label) = (vec![], vec![], vec![], vec![]);
    for i in 0..400u32 {
        let (a, b) = (((i * 37) % 101) as f64, ((i * 53) % 97) as f64);
        x0.push(a);
        x1.push(b);
        c.push(1.0);
        label.push(i64::from(a > b));
    }
    let mut df = df!("x0" => x0, "x1" => x1, "c" => c, "label" => label).unwrap();
    CsvWriter::new(std::fs::File::create(dir.path().join("data.csv")).unwrap()).finish(&mut df).unwrap();
    ParquetWriter::new(std::fs::File::create(dir.path().join("data.parquet")).unwrap()).finish(&mut df).unwrap();
    for source in ["csv", "parquet"] {
        let pipeline = format!(
            "[run]\nname = \"f\"\nworld_size = 2\n[load]\nsource = \"{source}\"\npath = \"data.{source}\"\n\
             target = \"label\"\n[validate]\nrows = 80\n[train]\nepochs = 3\nbatch_size = 8\noptimizer = \"adam\"\nlr = 0.01\n"
        );
        write(dir.path(), "f.toml", &pipeline);
        let o = run(&["run", "f.toml", "--out", source], dir.path());
        assert_ok(&o);
        let df = trace(&dir.path().join(source));
        let samples: u64 = df.column("samples").unwrap().u64().unwrap().into_no_null_iter().sum();
        assert_eq!(samples, 320 * 3, "{source}: 400 rows - 80 for validation, 3 epochs");
        let acc = f64s(&df, "val_acc").into_iter().flatten().last().unwrap();
        assert!(acc > 0.8, "{source}: a separable task should be learnt, val_acc {acc}");
        let (stdout, _) = text(&o);
        assert!(
            stdout.contains(&format!("data.{source}"))
                && stdout.contains("320 training + 80 validation rows, 2 classes"),
            "{stdout}"
        );
    }
}

#[test]
fn batch_split_over_two_ranks_equals_one_process_on_the_whole_batch() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let pipeline = root.join("pipelines/multi_gpu.toml");
    let dir = tempfile::tempdir().unwrap();
    let losses = |world: &str, out: &str| {
        let args = ["run", pipeline.to_str().unwrap(), "--set", &format!("run.world_size={world}")];
        let o = run(
            &[&args[..], &["--set", "train.epochs=2", "--set", "load.rows=3001", "--out", out]].concat(),
            dir.path(),
        );
        assert_ok(&o);
        let df = trace(&dir.path().join(out));
        let mask = df.column("rank").unwrap().u32().unwrap().equal(0);
        f64s(&df.filter(&mask).unwrap(), "global_train_loss").into_iter().map(Option::unwrap).collect::<Vec<_>>()
    };
    let (two, one) = (losses("2", "two"), losses("1", "one"));
    for (e, (a, b)) in two.iter().zip(&one).enumerate() {
        assert!(((a - b) / b).abs() < 1e-5, "epoch {}: 2 × 50 gave {a}, 1 × 100 gave {b}", e + 1);
    }
    let o = run(&["validate", pipeline.to_str().unwrap(), "--set", "train.global_batch_size=101"], dir.path());
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("101 does not split evenly over 2 ranks; use a multiple of 2"), "{}", text(&o).1);
}

#[test]
fn initial_weights_from_a_file_are_where_training_starts() {
    use tch::{Kind, Tensor};
    let dir = tempfile::tempdir().unwrap();
    // The TINY model is 5-16-3; weights far from any seeded initialisation.
    let init: Vec<(String, Tensor)> = [
        ("layer0.weight", vec![16, 5]),
        ("layer0.bias", vec![16]),
        ("layer1.weight", vec![3, 16]),
        ("layer1.bias", vec![3]),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, shape))| {
        (name.to_string(), Tensor::full(shape.as_slice(), 0.25 + i as f64, (Kind::Float, tch::Device::Cpu)))
    })
    .collect();
    Tensor::write_npz(&init, dir.path().join("init.npz")).unwrap();
    // A vanishing learning rate: the checkpoint after an epoch still holds the initial weights.
    let pipeline = format!("{TINY}\n[checkpoint]\nevery = 1\n");
    write(dir.path(), "p.toml", &pipeline);
    let args = [
        "run",
        "p.toml",
        "--set",
        "wrap.init=\"init.npz\"",
        "--set",
        "train.optimizer=\"sgd\"",
        "--set",
        "train.lr=1e-12",
        "--set",
        "train.epochs=1",
        "--out",
        "r",
    ];
    assert_ok(&run(&args, dir.path()));
    let saved: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.path().join("r/checkpoints/epoch-0001/rank-0.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    for (name, t) in &init {
        let diff = (&saved[name] - t).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{name} moved by {diff} from the file's values");
    }
    // The resolved configuration records where the weights came from, as an absolute path so that
    // it stays valid from the run directory (`--resume` reads it).
    let config = std::fs::read_to_string(dir.path().join("r/config.toml")).unwrap();
    let absolute = std::fs::canonicalize(dir.path().join("init.npz")).unwrap();
    let line = format!("init = \"{}\"  # --set wrap.init=\"init.npz\"", absolute.display());
    assert!(config.contains(&line), "{config}");
}

/// Rank `rank` of 2 of `runner run p.toml --out o EXTRA...`, started as torchrun would (RANK,
/// WORLD_SIZE, MASTER_ADDR, MASTER_PORT), its output captured.
fn torchrun_rank(dir: &std::path::Path, port: u16, rank: usize, extra: &[&str]) -> std::process::Child {
    common::runner()
        .args([&["run", "p.toml", "--out", "o"][..], extra].concat())
        .current_dir(dir)
        .envs([("RANK", rank.to_string()), ("WORLD_SIZE", "2".into()), ("MASTER_ADDR", "127.0.0.1".into())])
        .env("MASTER_PORT", port.to_string())
        .output_later()
}

/// The phases of every traced step (`trace.step_every = 1`: each one) add up to the epoch row's
/// `compute_s`, which is the same spans summed ([`runner::device::clock`]: CUDA events on a GPU,
/// the host's clock here), for DDP, FSDP and a pipeline; no phase is negative, and the compute
/// time fits in the epoch's.
#[test]
fn the_traced_steps_phases_add_up_to_each_epoch_s_compute_time() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    for (name, strategy) in [("ddp", "ddp"), ("fsdp", "fsdp"), ("pipeline", "pipeline")] {
        let model = if strategy == "pipeline" { "wrap.model.hidden=[16, 16]" } else { "wrap.model.hidden=[16]" };
        let o = run(
            &["run", "p.toml", "--out", name, "--set", "trace.step_every=1"]
                .into_iter()
                .chain(["--set", &format!("wrap.strategy=\"{strategy}\""), "--set", model])
                .collect::<Vec<_>>(),
            dir.path(),
        );
        assert_ok(&o);
        let epochs = trace(&dir.path().join(name));
        let steps = ParquetReader::new(std::fs::File::open(dir.path().join(name).join("steps.parquet")).unwrap())
            .finish()
            .unwrap();
        let col = |df: &DataFrame, c: &str| -> Vec<f64> {
            df.column(c).unwrap().f64().unwrap().into_no_null_iter().collect()
        };
        let u32s = |df: &DataFrame, c: &str| -> Vec<u32> {
            df.column(c).unwrap().u32().unwrap().into_no_null_iter().collect()
        };
        let (s_epoch, s_rank) = (u32s(&steps, "epoch"), u32s(&steps, "rank"));
        let phases: Vec<f64> = ["forward_s", "loss_s", "backward_s", "update_s"]
            .iter()
            .map(|c| col(&steps, c))
            .fold(vec![0.0; steps.height()], |acc, v| acc.iter().zip(v).map(|(a, b)| a + b).collect());
        assert!(col(&steps, "batch_s").iter().chain(&phases).all(|&s| s >= 0.0), "{name}: {steps}");
        let (e_epoch, e_rank) = (u32s(&epochs, "epoch"), u32s(&epochs, "rank"));
        let (compute, wall) = (col(&epochs, "compute_s"), col(&epochs, "epoch_s"));
        for i in 0..epochs.height() {
            let traced: Vec<f64> = (0..steps.height())
                .filter(|&j| s_epoch[j] == e_epoch[i] && s_rank[j] == e_rank[i])
                .map(|j| phases[j])
                .collect();
            assert!(!traced.is_empty(), "{name}: rank {} traced its steps", e_rank[i]);
            let sum: f64 = traced.iter().sum();
            assert!(
                (sum - compute[i]).abs() < 1e-6,
                "{name} rank {}: phases {sum} s, compute_s {}",
                e_rank[i],
                compute[i]
            );
            assert!(
                compute[i] > 0.0 && compute[i] <= wall[i],
                "{name}: compute_s {} of epoch_s {}",
                compute[i],
                wall[i]
            );
        }
    }
}
