//! `run.numerics`: "native" (the default: this CPU's own kernels) or "portable" (every kernel
//! family pinned in every rank: MKL_CBWR=COMPATIBLE, ATen's AVX2 kernels, oneDNN and NNPACK off, one
//! thread), chosen by the pipeline before libtorch computes, recorded in the manifest; an MKL_CBWR
//! in the environment wins when MKL knows it, ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA do not. Sweeps: the committed
//! portable table checks bit for bit, and a native table checked on another CPU model says why its
//! values may differ and passes within --tolerance.
use crate::common;

use common::*;
use polars::prelude::*;
use std::path::Path;

fn manifest(run_dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run_dir.join("manifest.json")).unwrap()).unwrap()
}

fn mkl_cbwr(run_dir: &Path) -> String {
    manifest(run_dir)["numerics"]["mkl_cbwr"].as_str().expect("the manifest records MKL_CBWR").to_owned()
}

#[test]
fn runs_are_native_by_default_portable_on_request_and_the_environment_wins() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let run_with = |out: &str, extra: &[&str], env: Option<&str>| {
        let mut cmd = runner();
        cmd.args(["run", "p.toml", "--out", out]).args(extra).current_dir(dir.path());
        match env {
            Some(v) => cmd.env("MKL_CBWR", v),
            None => cmd.env_remove("MKL_CBWR"),
        };
        cmd.output().unwrap()
    };
    let recorded = |out: &str, extra: &[&str], env: Option<&str>| {
        let o = run_with(out, extra, env);
        assert_ok(&o);
        mkl_cbwr(&dir.path().join(out))
    };
    let portable = ["--set", "run.numerics=\"portable\"", "--set", "checkpoint.every=1"];
    let native = ["--set", "run.numerics=\"native\""];

    // Two ranks: the launcher's setting reaches both. No key: MKL's kernels for this CPU.
    assert_eq!(recorded("default", &[], None), "");
    let config = std::fs::read_to_string(dir.path().join("default/config.toml")).unwrap();
    assert!(config.contains("numerics = \"native\"  # default"), "{config}");
    assert_eq!(recorded("native", &native, None), "");
    assert_same_trace(&dir.path().join("default"), &dir.path().join("native"));
    assert_eq!(recorded("portable", &portable, None), "COMPATIBLE");
    // The environment's MKL_CBWR wins over the key, and is what the manifest records.
    assert_eq!(recorded("env", &native, Some("COMPATIBLE")), "COMPATIBLE");
    assert_same_trace(&dir.path().join("portable"), &dir.path().join("env"));

    // A run resumes under the numerics it started with, read from its own config.toml.
    let o = runner()
        .args(["run", "--resume", "portable", "--set", "train.epochs=3"])
        .current_dir(dir.path())
        .env_remove("MKL_CBWR")
        .output()
        .unwrap();
    assert_ok(&o);
    assert_eq!(mkl_cbwr(&dir.path().join("portable")), "COMPATIBLE");
    assert_eq!(trace(&dir.path().join("portable")).height(), 3 * 2, "3 epochs of 2 ranks");

    // A value MKL does not know would be ignored by MKL while the manifest recorded it: refused.
    let o = run_with("garbage", &[], Some("garbage"));
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("error: MKL_CBWR=\"garbage\" in the environment is not a value MKL knows")
            && err.contains("Unset MKL_CBWR to let run.numerics choose"),
        "{err}"
    );
    assert!(!dir.path().join("garbage").exists(), "nothing ran");

    // The plan says which path a run takes; a value that is not one of the two is refused by name.
    let o = run(&["validate", "p.toml"], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("this CPU's own kernels (run.numerics = \"native\")"), "{}", text(&o).0);
    let o = run(&["validate", "p.toml", "--set", "run.numerics=\"portable\""], dir.path());
    assert!(
        text(&o).0.contains("the same bits on any x86-64 CPU with AVX2 (run.numerics = \"portable\": MKL's COMPATIBLE"),
        "{}",
        text(&o).0
    );
    let o = run(&["validate", "p.toml", "--set", "run.numerics=\"fast\""], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("run.numerics") && err.contains("portable") && err.contains("native"), "{err}");
}

/// A process that computes under its own plan (here one rank started as torchrun starts it) is put
/// on MKL's COMPATIBLE branch in place, without running itself again: every matrix product MKL
/// reports is on that branch, and the run equals one whose environment set MKL_CBWR.
#[test]
fn a_rank_that_resolves_its_own_plan_computes_portably_in_place() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let rank = |out: &str, env: Option<&str>| {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut cmd = runner();
        cmd.args(["run", "p.toml", "--out", out, "--set", "run.world_size=1", "--set", "run.numerics=\"portable\""])
            .current_dir(dir.path())
            .envs([("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MKL_VERBOSE", "1")])
            .env("MASTER_PORT", port.to_string());
        match env {
            Some(v) => cmd.env("MKL_CBWR", v),
            None => cmd.env_remove("MKL_CBWR"),
        };
        let o = cmd.output().unwrap();
        assert_ok(&o);
        let (out, err) = text(&o);
        out + &err
    };
    let out = rank("in-place", None);
    let products: Vec<&str> = out.lines().filter(|l| l.starts_with("MKL_VERBOSE SGEMM")).collect();
    assert!(!products.is_empty(), "{out}");
    assert!(products.iter().all(|l| l.contains("CNR:COMPATIBLE")), "{products:?}");
    rank("env", Some("COMPATIBLE"));
    assert_same_trace(&dir.path().join("in-place"), &dir.path().join("env"));
    // The rank pinned ATen's and oneDNN's kernels in its own process too.
    let kernels = &manifest(&dir.path().join("in-place"))["numerics"]["kernels"];
    assert_eq!((kernels["aten"].as_str(), kernels["onednn"].as_bool()), (Some("AVX2"), Some(false)), "{kernels}");
}

/// results/world_size, committed with portable numerics: every non-timing value of its 9 points
/// reproduces bit for bit here, whatever CPU made it.
#[test]
fn the_committed_portable_table_checks_bit_for_bit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let experiment = std::fs::read_to_string(root.join("experiments/world_size.toml")).unwrap();
    assert!(experiment.contains("\"run.numerics\" = \"portable\""), "{experiment}");
    let o = runner()
        .args(["sweep", "experiments/world_size.toml", "--check"])
        .current_dir(root)
        .env_remove("MKL_CBWR")
        .output()
        .unwrap();
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(out.contains("(MKL_CBWR=COMPATIBLE, ATen AVX2, oneDNN off, 1 thread per rank); rerunning on"), "{out}");
    assert!(
        out.contains("9 points reproduce results/world_size: every non-timing value of every trace is identical."),
        "{out}"
    );
}

/// A table made with native numerics: bit for bit on the same CPU model; recorded as made on
/// another one (its sweep.json edited) and differing in a last bit, the check says why and how to
/// check it, and passes within a tolerance.
#[test]
fn a_native_table_checked_on_another_cpu_says_why_and_passes_within_a_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    write(dir.path(), "e.toml", "pipeline = \"p.toml\"\n\n[sweep]\n\"run.world_size\" = [1, 2]\n");
    let sweep = |extra: &[&str]| {
        let mut cmd = runner();
        cmd.args(["sweep", "e.toml", "--out", "s"]).args(extra).current_dir(dir.path()).env_remove("MKL_CBWR");
        let o = cmd.output().unwrap();
        let (out, err) = text(&o);
        (o.status.code(), out, err)
    };
    let (code, _, err) = sweep(&[]);
    assert_eq!(code, Some(0), "{err}");
    let s = dir.path().join("s");
    let index_path = s.join("sweep.json");
    let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    assert_eq!(index["numerics"]["mkl_cbwr"], "", "native by default");
    let here = runner::numerics::cpu_model();

    // The same CPU model: bit for bit, with no word about other CPUs.
    let (code, out, err) = sweep(&["--check"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("2 points reproduce s: every non-timing value of every trace is identical."), "{out}");
    assert!(!out.contains("note:"), "{out}");

    // Recorded as made on another CPU, with a last-bit difference such a CPU's kernels give.
    index["numerics"]["cpu"] = "Imaginary CPU 9000".into();
    std::fs::write(&index_path, serde_json::to_string_pretty(&index).unwrap()).unwrap();
    let trace_path = s.join("world_size=2").join("trace.parquet");
    let mut df = ParquetReader::new(std::fs::File::open(&trace_path).unwrap()).finish().unwrap();
    let mut loss: Vec<f64> = df.column("global_train_loss").unwrap().f64().unwrap().into_no_null_iter().collect();
    loss[1] *= 1.0 + 3e-9;
    df.with_column(Column::new("global_train_loss".into(), loss)).unwrap();
    ParquetWriter::new(std::fs::File::create(&trace_path).unwrap()).finish(&mut df).unwrap();

    let aten = index["numerics"]["kernels"]["aten"].as_str().expect("the index records ATen's kernels").to_owned();
    let why = format!(
        "this table was computed with its CPU's own kernels (run.numerics = \"native\") on Imaginary CPU 9000 (ATen \
         {aten}), and is checked on {here} (ATen {aten}): native kernels differ between CPU models and instruction \
         sets in the last bits of their sums"
    );
    let (code, out, err) = sweep(&["--check"]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.contains(&format!("note: {why}; a bit-for-bit check may fail here")), "{out}");
    assert!(err.contains("error: 1 difference between s and a rerun:\n  world_size=2: row 1"), "{err}");
    assert!(
        err.trim_end().ends_with(&format!(
            "{why}. The largest relative difference is 3.0e-9: --tolerance 1e-8 accepts it. To check such a table \
             elsewhere, give --tolerance REL (values within a relative difference REL count as equal); to make \
             tables that check bit for bit on any x86-64 CPU, set run.numerics = \"portable\" in the experiment \
             and run it again."
        )),
        "{err}"
    );
    let (code, out, err) = sweep(&["--check", "--tolerance", "1e-8"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("1 float values differ by at most"), "{out}");
    assert!(out.contains("2 points reproduce s: every non-timing value of every trace is equal within the tolerance."));
}

/// The environment variables that ask libtorch for other kernels, set to lower levels than this
/// CPU's: ATen's scalar kernels, oneDNN's SSE4.1 code, MKL's SSE4.2 code.
const LOWER: [(&str, &str); 3] =
    [("ATEN_CPU_CAPABILITY", "default"), ("ONEDNN_MAX_CPU_ISA", "SSE41"), ("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")];

/// One pipeline of each model kind, small enough for a few seconds a run: the MLP (softmax, Adam),
/// the CNN (convolutions, batch norm, pooling: oneDNN's family), the transformer (layer norm, GELU,
/// attention's softmax, AdamW) and a TorchScript module (tanh); each with the strategies it takes.
fn kinds(dir: &Path) -> Vec<(&'static str, String, &'static [&'static str])> {
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_mlp.pt"), dir.join("m.pt")).unwrap();
    let mlp = TINY.replace("epochs = 2", "epochs = 1\noptimizer = \"adam\"\nlr = 0.01");
    let cnn = r#"
[run]
name = "cnn"
world_size = 2

[load]
image = [1, 8, 8]
classes = 3
rows = 128
validation_rows = 32

[wrap.model]
kind = "cnn"
conv = [{ channels = 4, kernel = 3, padding = 1, batch_norm = true, pool = "max" }]
hidden = [8]

[train]
epochs = 1
batch_size = 16
optimizer = "adam"
lr = 0.01
"#;
    let lm = r#"
[run]
name = "lm"
world_size = 2

[load]
source = "synthetic"
rows = 96
validation_rows = 16

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 32
d_model = 16
heads = 2
layers = 2
seq_len = 8
tied = false

[train]
epochs = 1
batch_size = 8
optimizer = "adamw"
lr = 0.003
"#;
    let script = TINY.replace("[wrap.model]\nhidden = [16]", "[wrap.model]\nkind = \"torchscript\"\npath = \"m.pt\"");
    vec![
        ("mlp", mlp, &["ddp", "fsdp", "pipeline"]),
        ("cnn", cnn.to_owned(), &["ddp", "fsdp", "pipeline"]),
        ("transformer", lm.to_owned(), &["ddp", "fsdp", "pipeline"]),
        ("torchscript", script, &["ddp", "fsdp"]),
    ]
}

/// Runs `pipeline` in `dir/out` under `numerics` and `strategy`, with `env` set and the other
/// kernel variables unset.
fn run_kernels(dir: &Path, pipeline: &str, out: &str, numerics: &str, strategy: &str, env: &[(&str, &str)]) {
    write(dir, "k.toml", pipeline);
    let mut cmd = runner();
    cmd.args(["run", "k.toml", "--out", out, "--set", &format!("run.numerics=\"{numerics}\"")])
        .args(["--set", &format!("wrap.strategy=\"{strategy}\"")])
        .current_dir(dir)
        .env_remove("MKL_CBWR");
    for (var, _) in LOWER {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    assert_ok(&cmd.output().unwrap());
}

fn model_bytes(run_dir: &Path) -> Vec<u8> {
    std::fs::read(run_dir.join("model.safetensors")).unwrap()
}

/// Under portable numerics, a run's every non-timing value and its final model do not change when
/// the environment asks libtorch for lower kernels (ATen's capability, oneDNN's instruction set,
/// MKL's): for each model kind under DDP, FSDP and the pipeline. The manifest records what was
/// overridden, and the plan says so.
#[test]
fn portable_runs_are_the_same_whatever_kernels_the_environment_asks_for() {
    let dir = tempfile::tempdir().unwrap();
    for (kind, pipeline, strategies) in kinds(dir.path()) {
        for strategy in strategies {
            let (mine, lower) = (format!("{kind}-{strategy}"), format!("{kind}-{strategy}-lower"));
            run_kernels(dir.path(), &pipeline, &mine, "portable", strategy, &[]);
            run_kernels(dir.path(), &pipeline, &lower, "portable", strategy, &LOWER);
            let (a, b) = (dir.path().join(&mine), dir.path().join(&lower));
            assert_same_trace(&a, &b);
            assert!(model_bytes(&a) == model_bytes(&b), "{kind} under {strategy}: the models differ");
            // Each of these small models at 2 ranks: the plan's memory is the process's.
            assert_estimate_holds(&a);
            let kernels = &manifest(&b)["numerics"]["kernels"];
            assert_eq!(kernels["aten"], "AVX2", "{kernels}");
            assert_eq!(kernels["onednn"], false, "{kernels}");
            assert_eq!(kernels["threads"], 1, "{kernels}");
            let overridden = kernels["overridden"].to_string();
            assert!(
                overridden.contains("ATEN_CPU_CAPABILITY=default") && overridden.contains("ONEDNN_MAX_CPU_ISA=SSE41"),
                "{overridden}"
            );
        }
    }
    let o = runner()
        .args(["validate", "k.toml", "--set", "run.numerics=\"portable\""])
        .current_dir(dir.path())
        .envs(LOWER)
        .output()
        .unwrap();
    assert_ok(&o);
    let (out, _) = text(&o);
    assert!(
        out.contains(
            "note: run.numerics = \"portable\" overrides ATEN_CPU_CAPABILITY=default and ONEDNN_MAX_CPU_ISA=SSE41 \
             from the environment: the portable kernels are ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2"
        ),
        "{out}"
    );
    assert!(out.contains("ATen's AVX2 kernels, oneDNN and NNPACK off, 1 thread per rank)"), "{out}");
}

/// The control of the test above: natively, the same requests reach libtorch and change the
/// results (ATen's scalar kernels the transformer's and the MLP's, oneDNN's SSE4.1 code the
/// CNN's), so that test would fail if portable numerics left any family to the environment.
#[test]
fn native_runs_follow_the_kernels_the_environment_asks_for() {
    let dir = tempfile::tempdir().unwrap();
    let cases = kinds(dir.path());
    let find = |k: &str| cases.iter().find(|c| c.0 == k).unwrap().1.clone();
    for (kind, env) in [("transformer", ("ATEN_CPU_CAPABILITY", "default")), ("cnn", ("ONEDNN_MAX_CPU_ISA", "SSE41"))] {
        let pipeline = find(kind);
        run_kernels(dir.path(), &pipeline, kind, "native", "ddp", &[]);
        let other = format!("{kind}-{}", env.0);
        run_kernels(dir.path(), &pipeline, &other, "native", "ddp", &[env]);
        let (a, b) = (dir.path().join(kind), dir.path().join(&other));
        assert!(model_bytes(&a) != model_bytes(&b), "{kind}: {}={} changed nothing", env.0, env.1);
    }
}

/// The two portable tables made with the environment asking for the lowest kernels (their
/// manifests list what portable numerics overrode): the transformer (ATen's family) and the CNN
/// (oneDNN's), each under DDP, FSDP and a pipeline, check bit for bit on this machine, whatever its
/// own capability.
#[test]
fn the_tables_made_under_the_lowest_kernels_check_bit_for_bit_here() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for name in ["portable_lm", "portable_cnn"] {
        let manifest = manifest(&root.join("results").join(name).join("strategy=ddp"));
        let overridden = manifest["numerics"]["kernels"]["overridden"].to_string();
        assert!(overridden.contains("ATEN_CPU_CAPABILITY=default"), "{name}: {overridden}");
        let mut cmd = runner();
        cmd.args(["sweep", &format!("experiments/{name}.toml"), "--check"]).current_dir(root).env_remove("MKL_CBWR");
        for (var, _) in LOWER {
            cmd.env_remove(var);
        }
        let o = cmd.output().unwrap();
        assert_ok(&o);
        let (out, _) = text(&o);
        assert!(
            out.contains(&format!(
                "3 points reproduce results/{name}: every non-timing value of every trace is identical."
            )),
            "{out}"
        );
    }
}
