//! Sharded runs under hostile input (issue 38), on the real binary and real rank processes: the
//! keys a resume may change, set every way (--set, the environment, `auto`), never a panic nor a
//! run directory made unusable; a resume refused before every rank accepted it leaving a complete
//! run complete; shared and 0-dimensional TorchScript parameters under FSDP; the trace's earlier
//! rows after a resume at another world size; a checkpoint's record checked (emptied, lying,
//! against another run's trace, missing optimizer state); random windows resumed from 2 ranks to
//! 4; the plan refusing what the ranks could not run (validation rows under FSDP, `auto` on a tied
//! head); `sweep --check` with changed numerics and `--tolerance`; and the smaller refusals. Each
//! case pins its message and exit code, and checks that nothing panicked, printed C++ text or
//! died of a signal.
use crate::common;

use std::path::Path;
use std::process::Output;

use common::{assert_close_runs, assert_ok, children, reference_python, run, runner, text, trace, write, TINY};

/// `o` ended with `code`, saying every one of `want` on stderr, with nothing of a crash.
fn assert_says(o: &Output, code: i32, want: &[&str], case: &str) {
    let (out, err) = text(o);
    assert_eq!(o.status.code(), Some(code), "{case}: exit {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    for w in want {
        assert!(err.contains(w), "{case}: {w:?} not in:\n{err}");
    }
    for never in ["panicked", "stack backtrace", "Exception raised from", "__w/pytorch", ".cc:"] {
        assert!(!err.contains(never) && !out.contains(never), "{case}: {never:?} in:\n{out}\n{err}");
    }
}

fn manifest_status(run_dir: &Path) -> String {
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(run_dir.join("manifest.json")).unwrap()).unwrap();
    m["status"].as_str().unwrap().to_owned()
}

/// A small language model on synthetic tokens, as pipelines/transformer_fsdp.toml (6 blocks of
/// d_model 64, a tied head) on 32 windows: one epoch of 4 optimizer steps at world size 2.
const LM: &str = r#"
[run]
name = "lm"
seed = 0
world_size = 2
timeout_s = 60
abort_after_s = 2

[load]
source = "synthetic"
rows = 32
validation_rows = 8

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 256
d_model = 64
heads = 4
layers = 6
seq_len = 32
dropout = 0.0
tied = true

[train]
epochs = 1
batch_size = 4
optimizer = "adamw"
lr = 0.003

[checkpoint]
every = 1

# Kept by hand: these tests pick strategies by memory, where the plan
# would turn checkpointing on first.
[wrap.activation_checkpointing]
policy = "none"
"#;

/// Every key on the list of those a resume may change works when changed, however it is set:
/// `wrap.fsdp.reshard_after_forward` after `auto` chose ZeRO-2 (the run directory once made
/// unusable), through the environment, and on a DDP → FSDP resume (once a panic); a key off the
/// list is refused by name.
#[test]
fn the_keys_a_resume_may_change_work_however_they_are_set() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "lm.toml", LM);
    // auto chooses ZeRO-2 under this limit (a rank needs 159 MiB under DDP, 158 under ZeRO-2).
    let auto = ["--set", "wrap.strategy=\"auto\"", "--set", "run.memory_per_rank_mb=158.4"];
    let o = run(&[&["run", "lm.toml", "--out", "z2"][..], &auto].concat(), d);
    assert_ok(&o);
    assert!(text(&o).0.contains("wrap.strategy = \"auto\": chose FSDP (ZeRO-2)"), "{}", text(&o).0);
    let config = std::fs::read_to_string(d.join("z2/config.toml")).unwrap();
    assert!(
        config.contains("strategy = \"fsdp\"  # wrap.strategy = \"auto\" (--set wrap.strategy=\"auto\")"),
        "{config}"
    );
    assert!(config.contains("reshard_after_forward = false  # wrap.strategy = \"auto\"\n"), "{config}");
    // ZeRO-2 resumed as ZeRO-3, then back through the environment.
    let o =
        run(&["run", "--resume", "z2", "--set", "train.epochs=2", "--set", "wrap.fsdp.reshard_after_forward=true"], d);
    assert_ok(&o);
    let config = std::fs::read_to_string(d.join("z2/config.toml")).unwrap();
    assert!(
        config.contains("reshard_after_forward = true  # --set wrap.fsdp.reshard_after_forward=true (on resume)"),
        "{config}"
    );
    let o = runner()
        .args(["run", "--resume", "z2", "--set", "train.epochs=3"])
        .env("RUNNER_WRAP__FSDP__RESHARD_AFTER_FORWARD", "false")
        .current_dir(d)
        .output()
        .unwrap();
    assert_ok(&o);
    assert_eq!(manifest_status(&d.join("z2")), "complete");
    assert_eq!(trace(&d.join("z2")).height(), 6, "3 epochs of 2 ranks");
    // A key off the list is refused by name, the run left as it was.
    let o = run(&["run", "--resume", "z2", "--set", "train.epochs=4", "--set", "train.lr=0.01"], d);
    assert_says(&o, 2, &["`train.lr`: 0.003 in the run, 0.01 now (--set train.lr=0.01)"], "train.lr");
    assert_eq!(manifest_status(&d.join("z2")), "complete");
    // DDP resumed under FSDP with ZeRO-2.
    assert_ok(&run(&["run", "lm.toml", "--out", "ddp", "--set", "wrap.strategy=\"ddp\""], d));
    // Its config.toml read back keeps its provenance: `bucket_cap_mb = 25.0  # default` was set
    // by no one, so it does not count as a DDP key set under FSDP.
    assert_ok(&run(&["validate", "ddp/config.toml", "--set", "wrap.strategy=\"fsdp\""], d));
    let fsdp = ["--set", "wrap.strategy=\"fsdp\"", "--set", "wrap.fsdp.reshard_after_forward=false"];
    let o = run(&[&["run", "--resume", "ddp", "--set", "train.epochs=2"][..], &fsdp].concat(), d);
    assert_ok(&o);
    assert!(text(&o).0.contains("resuming at step 4 with world size 2, fsdp"), "{}", text(&o).0);
}

/// A resume whose rank dies before every rank accepted its plan leaves the run directory as it
/// was: still complete, its plan, configuration and trace the same bytes, resumable. Automatic
/// restarts (run.max_restarts) do not retry it: a restart goes on from a run its ranks accepted.
#[test]
fn a_resume_that_fails_before_its_ranks_accept_it_leaves_a_complete_run_complete() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(
        d,
        "p.toml",
        &format!("{TINY}\n[checkpoint]\nevery = 1\n").replace("timeout_s = 30", "timeout_s = 30\nabort_after_s = 1"),
    );
    assert_ok(&run(&["run", "p.toml", "--out", "r"], d));
    let files = ["plan.json", "config.toml", "manifest.json", "trace.parquet", "model.safetensors"];
    let before: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(d.join("r").join(f)).unwrap()).collect();
    let launcher = runner()
        .args(["run", "--resume", "r", "--set", "train.epochs=3", "--set", "run.max_restarts=2"])
        .current_dir(d)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Rank 1 dies while it still loads (before any rank can have accepted the plan).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let rank1 = loop {
        let found = children(launcher.id()).into_iter().find(|p| {
            let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
            env.split(|b| *b == 0).any(|v| v == b"RANK=1")
        });
        if let Some(p) = found {
            break p;
        }
        assert!(std::time::Instant::now() < deadline, "rank 1 never started");
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(rank1 as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let o = launcher.wait_with_output().unwrap();
    assert_says(
        &o,
        1,
        &[
            "error: the resume failed: rank 1 was killed by SIGKILL",
            "the resume stopped before every rank had accepted its plan: r is as it was (still complete, its plan, \
             configuration, trace and checkpoints untouched)",
        ],
        "killed resume",
    );
    for (f, bytes) in files.iter().zip(&before) {
        assert!(std::fs::read(d.join("r").join(f)).unwrap() == *bytes, "{f} changed");
    }
    let leftovers: Vec<String> = std::fs::read_dir(d.join("r"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with('.') && n != ".runner.lock")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert_ok(&run(&["run", "--resume", "r", "--set", "train.epochs=3"], d));
    assert_eq!(manifest_status(&d.join("r")), "complete");
    assert_eq!(trace(&d.join("r")).height(), 6);
}

/// TINY training the TorchScript module `module` of the corpus in `dir`.
fn with_module(dir: &Path, module: &str) -> String {
    let module = dir.join(module);
    TINY.replace("[wrap.model]\nhidden = [16]", &format!("[wrap.model]\nkind = \"torchscript\"\npath = {module:?}"))
}

/// tests/fixtures/make_hostile.py's modules, made in `dir`.
fn corpus(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/make_hostile.py");
    let o = std::process::Command::new(reference_python()).arg(script).arg(dir).output().unwrap();
    assert!(o.status.success(), "make_hostile.py failed: {}", String::from_utf8_lossy(&o.stderr));
}

/// A module sharing one weight between two layers is one parameter under FSDP (sharded once,
/// read by both) and trains as under DDP at world sizes 1 and 2; a module with a 0-dimensional
/// parameter is refused under FSDP on the plan, naming it, and `auto` does not choose FSDP for it.
#[test]
fn shared_and_scalar_torchscript_parameters_under_fsdp() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    corpus(d);
    write(d, "shared.toml", &with_module(d, "shared.pt"));
    let o = run(&["validate", "shared.toml", "--set", "wrap.strategy=\"fsdp\""], d);
    assert_ok(&o);
    // a (5×5 + 5), b's bias, c (5×3 + 3): b.weight is a.weight.
    assert!(text(&o).0.contains("TorchScript shared.pt (53 parameters)"), "{}", text(&o).0);
    for w in ["1", "2"] {
        let ws = format!("run.world_size={w}");
        let out = format!("fsdp{w}");
        assert_ok(&run(&["run", "shared.toml", "--out", &out, "--set", &ws, "--set", "wrap.strategy=\"fsdp\""], d));
        assert_ok(&run(&["run", "shared.toml", "--out", &format!("ddp{w}"), "--set", &ws], d));
        assert_close_runs(&d.join(&out), &d.join(format!("ddp{w}")), 1e-5);
    }
    write(d, "scalar.toml", &with_module(d, "scalar.pt"));
    let want = "`wrap.strategy` (--set wrap.strategy=\"fsdp\"): \"fsdp\" shards every parameter by its rows (dim 0), \
                but the model's parameter `temperature` is 0-dimensional (a scalar); use wrap.strategy = \"ddp\", or \
                make it a 1-element tensor (nn.Parameter(torch.tensor([value])))";
    for w in ["1", "2"] {
        let ws = format!("run.world_size={w}");
        let o = run(&["validate", "scalar.toml", "--set", "wrap.strategy=\"fsdp\"", "--set", &ws], d);
        assert_says(&o, 2, &[want], "scalar, validate");
    }
    let o = run(&["run", "scalar.toml", "--out", "s", "--set", "wrap.strategy=\"fsdp\""], d);
    assert_says(&o, 2, &[want], "scalar, run");
    assert!(!d.join("s/manifest.json").exists());
    let o =
        run(&["validate", "scalar.toml", "--set", "wrap.strategy=\"auto\"", "--set", "run.memory_per_rank_mb=500"], d);
    assert_ok(&o);
    assert!(text(&o).0.contains("wrap.strategy = \"auto\": chose DDP"), "{}", text(&o).0);
}

/// The docs' example, DDP at 4 ranks resumed under FSDP at 2: the rows trained before keep their
/// world size and memory columns, the rows after have theirs, and the plan printed on resume is
/// the new layout's.
#[test]
fn the_trace_keeps_its_earlier_rows_after_a_resume_at_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &format!("{TINY}\n[checkpoint]\nevery = 1\n"));
    let ddp4 = ["--set", "run.world_size=4", "--set", "train.batch_size=8"];
    assert_ok(&run(&[&["run", "p.toml", "--out", "r"][..], &ddp4].concat(), d));
    let before = trace(&d.join("r"));
    let fsdp2 = ["--set", "run.world_size=2", "--set", "wrap.strategy=\"fsdp\"", "--set", "train.batch_size=16"];
    let o = run(&[&["run", "--resume", "r", "--set", "train.epochs=3"][..], &fsdp2].concat(), d);
    assert_ok(&o);
    let after = trace(&d.join("r"));
    assert_eq!(after.height(), before.height() + 2);
    let old = after.slice(0, before.height());
    for col in ["epoch", "step", "rank", "world_size", "param_bytes", "grad_bytes", "optim_bytes", "global_train_loss"]
    {
        assert_eq!(old.column(col).unwrap(), before.column(col).unwrap(), "{col} of the rows before the resume");
    }
    let worlds: Vec<u32> = after.column("world_size").unwrap().u32().unwrap().into_no_null_iter().collect();
    assert_eq!(worlds, [4, 4, 4, 4, 4, 4, 4, 4, 2, 2]);
    // The plan printed on resume holds FSDP's state at 2 ranks, as `validate` gives it.
    let v = run(&[&["validate", "p.toml"][..], &fsdp2].concat(), d);
    let state = |s: &str| s.lines().find(|l| l.contains("training state under")).map(str::to_owned);
    let want = state(&text(&v).0).expect("validate prints the training state");
    assert!(want.contains("under FSDP (ZeRO-3)"), "{want}");
    assert_eq!(state(&text(&o).0), Some(want));
}

/// Edits `run_dir`'s checkpoint `name`'s index with `edit`; returns the original text.
fn edit_index(run_dir: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let path = run_dir.join("checkpoints").join(name).join("index.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut index: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut index);
    std::fs::write(&path, index.to_string()).unwrap();
    text
}

/// A checkpoint's record is checked before any rank starts: emptied or lying (its checksum), not
/// the trace's rows (another run's trace), without the optimizer's state, a tensor of another
/// shape (both shapes named); every refusal names the earlier whole checkpoint and leaves the
/// complete run complete and resumable.
#[test]
fn a_checkpoint_record_that_does_not_hold_is_refused_before_any_rank_starts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(
        d,
        "p.toml",
        &format!("{TINY}\n[checkpoint]\nevery = 1\n").replace("epochs = 2", "epochs = 2\noptimizer = \"adam\""),
    );
    assert_ok(&run(&["run", "p.toml", "--out", "r"], d));
    let r = d.join("r");
    let resume = ["run", "--resume", "r", "--set", "train.epochs=3"];
    let earlier = "the checkpoint before it (epoch 1) is whole: move r/checkpoints/epoch-0002 out of r/checkpoints to \
                   resume from that one, or start a new run";
    let checksum = "checkpoint epoch 2 (r/checkpoints/epoch-0002) cannot be resumed: its record (where the run stood: \
                    the step, the layout, the trace's rows) fails its checksum";
    type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, String)> = vec![
        ("emptied rows", Box::new(|i| i["record"]["rows"] = serde_json::json!([])), checksum.to_owned()),
        (
            "emptied rows, no checksum",
            Box::new(|i| {
                i["record"]["rows"] = serde_json::json!([]);
                i.as_object_mut().unwrap().remove("record_xxh3");
            }),
            "its record holds 0 trace rows up to step 38, but r/trace.parquet holds 4 (they differ from row 0 on): the \
             checkpoint's record was edited, or it belongs to another run"
                .to_owned(),
        ),
        (
            "layout lie, no checksum",
            Box::new(|i| {
                i["record"]["layout"]["ranks_per_copy"] = serde_json::json!(0);
                i.as_object_mut().unwrap().remove("record_xxh3");
            }),
            "its record's layout (2 rank(s), strategy Ddp, 0 rank(s) per copy of the model; global batch 32, 19 steps \
             per epoch) is not one a run can have: the index was edited or damaged"
                .to_owned(),
        ),
        (
            "layout lie",
            Box::new(|i| {
                i["record"]["layout"] = serde_json::json!({"world_size": 3, "strategy": "fsdp", "ranks_per_copy": 0})
            }),
            checksum.to_owned(),
        ),
        (
            "no step count",
            Box::new(|i| drop(i["tensors"].as_object_mut().unwrap().remove("optim.steps"))),
            "its index lacks the optimizer's step count `optim.steps`: the checkpoint is incomplete".to_owned(),
        ),
        (
            "no moments",
            Box::new(|i| drop(i["tensors"].as_object_mut().unwrap().remove("optim.exp_avg.layer0.weight"))),
            "its index lacks the optimizer's `optim.exp_avg.layer0.weight` (train.optimizer = \"adam\" keeps it): the \
             checkpoint is incomplete"
                .to_owned(),
        ),
        (
            "shape",
            Box::new(|i| i["tensors"]["layer0.weight"]["shape"] = serde_json::json!([17, 5])),
            "its index holds the model's `layer0.weight` as [17, 5], the model's is [16, 5]".to_owned(),
        ),
    ];
    for (case, edit, want) in cases {
        let original = edit_index(&r, "epoch-0002", edit);
        assert_says(&run(&resume, d), 2, &[&want, earlier], case);
        std::fs::write(r.join("checkpoints/epoch-0002/index.json"), original).unwrap();
        assert_eq!(manifest_status(&r), "complete", "{case}");
    }
    // Another run's trace in place of the run's own: the record does not match it.
    assert_ok(&run(&["run", "p.toml", "--out", "other", "--set", "run.seed=4"], d));
    let own = std::fs::read(r.join("trace.parquet")).unwrap();
    std::fs::copy(d.join("other/trace.parquet"), r.join("trace.parquet")).unwrap();
    let want = "its record holds 4 trace rows up to step 38, but r/trace.parquet holds 4 (they differ from row 0 on): \
                the checkpoint's record was edited, or it belongs to another run";
    assert_says(&run(&resume, d), 2, &[want], "another run's trace");
    std::fs::write(r.join("trace.parquet"), own).unwrap();
    // `--resume` given the checkpoint instead of the run.
    let o = run(&["run", "--resume", "r/checkpoints/epoch-0002"], d);
    assert_says(
        &o,
        2,
        &["--resume r/checkpoints/epoch-0002: it is a checkpoint of the run in r: resume that run with --resume r (it \
           goes on from its newest checkpoint; to go on from this one, move the newer ones out of r/checkpoints)"],
        "a checkpoint's directory",
    );
    assert_ok(&run(&resume, d));
    assert_eq!(trace(&r).height(), 6);
}

/// A language model on a play with random windows, 12 steps at 2 ranks × 8 windows.
const RANDOM: &str = r#"
[run]
name = "random"
seed = 1
world_size = 2
timeout_s = 60

[load]
source = "text"
path = "corpus.txt"
sampling = "random"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 256
d_model = 16
heads = 2
layers = 1
seq_len = 16
dropout = 0.0

[train]
steps = 12
batch_size = 8
optimizer = "adamw"
lr = 0.003

[validate]
every_steps = 6
batches = 1

[checkpoint]
every_steps = 6
"#;

/// Random windows are a function of (seed, step, global sample index): a run stopped at step 6
/// at 2 ranks × 8 windows and resumed at 4 ranks × 4 draws the same windows, and ends as the
/// uninterrupted run.
#[test]
fn random_windows_resumed_from_2_ranks_to_4_equal_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/data/tempest.txt"), d.join("corpus.txt"))
        .unwrap();
    write(d, "p.toml", RANDOM);
    assert_ok(&run(&["run", "p.toml", "--out", "whole"], d));
    assert_ok(&run(&["run", "p.toml", "--out", "cut", "--set", "train.steps=6"], d));
    let four = ["--set", "run.world_size=4", "--set", "train.batch_size=4", "--set", "train.steps=12"];
    assert_ok(&run(&[&["run", "--resume", "cut"][..], &four].concat(), d));
    assert_close_runs(&d.join("whole"), &d.join("cut"), 1e-5);
}

/// FSDP validates on every rank, each on its share: fewer validation rows than ranks is refused on
/// the plan, as DDP's `validate.on = "split"` is, not after an epoch of training.
#[test]
fn fsdp_with_fewer_validation_rows_than_ranks_is_refused_on_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &TINY.replace("validation_rows = 100", "validation_rows = 3"));
    let fsdp4 = ["--set", "run.world_size=4", "--set", "wrap.strategy=\"fsdp\""];
    let want = "`validate.on` (default): \"rank0\" under FSDP validates on every rank (each gathers the layers), each \
                on its share of the 3 validation row(s), but 4 ranks need at least 4; hold out at least 4 rows, or set \
                validate.on = \"all\" (every rank validates every row)";
    assert_says(&run(&[&["validate", "p.toml"][..], &fsdp4].concat(), d), 2, &[want], "validate");
    assert_says(&run(&[&["run", "p.toml", "--out", "r"][..], &fsdp4].concat(), d), 2, &[want], "run");
    assert!(!d.join("r/manifest.json").exists());
    assert_ok(&run(&[&["validate", "p.toml", "--set", "validate.on=\"all\""][..], &fsdp4].concat(), d));
}

/// `auto` and the memory advice consider only what the model can take: a tied head is never cut
/// into pipeline stages (auto once chose the pipeline, then refused it), and on resume only world
/// sizes that keep the run's global batch are advised.
#[test]
fn auto_and_the_memory_advice_name_only_what_the_run_could_use() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "lm.toml", LM);
    // A rank needs 159 MiB under DDP, 158 under ZeRO-2, 157 under ZeRO-3 (3.2 MiB of training
    // state); the pipeline would need less, untied.
    let auto = ["--set", "wrap.strategy=\"auto\"", "--set", "run.memory_per_rank_mb=156.5"];
    // Tied, no strategy over the whole world fits, and auto considers the mesh shapes: tensor 2 fits.
    let o = run(&[&["validate", "lm.toml"][..], &auto].concat(), d);
    assert_ok(&o);
    let said = "no strategy over the whole world fits (DDP would need 159 MiB, FSDP (ZeRO-2) would need 158 MiB, FSDP \
                (ZeRO-3) would need 157 MiB); considered: data 1 × tensor 2 under DDP needs 155 MiB";
    assert!(text(&o).0.contains(said), "{}", text(&o).0);
    let why = text(&o).0.lines().find(|l| l.contains("wrap.strategy = \"auto\"")).unwrap_or_default().to_owned();
    assert!(!why.contains("pipeline"), "{why}");
    let o = run(&["validate", "lm.toml", "--set", "wrap.strategy=\"auto\"", "--set", "run.memory_per_rank_mb=154"], d);
    assert_says(
        &o,
        2,
        &["`wrap.strategy` (--set wrap.strategy=\"auto\"): no strategy fits run.memory_per_rank_mb = 154 at world size \
           2: DDP would need 159 MiB, FSDP (ZeRO-2) would need 158 MiB, FSDP (ZeRO-3) would need 157 MiB; none fits on \
           up to 4096 ranks: use a smaller model; no mesh shape fits either: data 1 × tensor 2 under DDP needs 155 MiB \
           and sends 0.8 MiB a step of 4 rows; the smallest, data 1 × tensor 2 under DDP, needs 155 MiB"],
        "auto, tied",
    );
    assert!(!text(&o).1.contains("pipeline"), "{}", text(&o).1);
    let o = run(&[&["validate", "lm.toml", "--set", "wrap.model.tied=false"][..], &auto].concat(), d);
    assert_ok(&o);
    assert!(text(&o).0.contains("wrap.strategy = \"auto\": chose the pipeline"), "{}", text(&o).0);
    // On resume the global batch (2 ranks × 4 = 8) stays: world size 3 is not advised.
    assert_ok(&run(&["run", "lm.toml", "--out", "r", "--set", "wrap.strategy=\"fsdp\""], d));
    let o = run(&["run", "--resume", "r", "--set", "train.epochs=2", "--set", "run.memory_per_rank_mb=156.5"], d);
    assert_says(
        &o,
        2,
        &["`run.memory_per_rank_mb` (--set run.memory_per_rank_mb=156.5): each rank would need 157 MiB: 3.2 MiB at \
           once (parameters up to 1.1 MiB, gradients up to 1.0 MiB, optimizer 1.2 MiB) of training state and 154 MiB \
           besides (activations, data, libtorch), under FSDP (ZeRO-3) at world size 2, more than the 156.5 MiB a rank \
           may use; FSDP (ZeRO-3) fits from run.world_size = 4"],
        "resume advice",
    );
    assert!(!text(&o).1.contains("pipeline"), "{}", text(&o).1);
    assert_eq!(manifest_status(&d.join("r")), "complete");
}

/// An experiment of one point of TINY at world size 1, its numerics set in [set].
fn experiment(numerics: &str, lr: &str) -> String {
    format!(
        "pipeline = \"p.toml\"\n\n[set]\n\"run.world_size\" = 1\n\"train.epochs\" = 1\n\"run.numerics\" = \
         \"{numerics}\"\n\"train.lr\" = {lr}\n"
    )
}

/// `sweep --check` reruns under the stored numerics when `run.numerics` changed (as
/// docs/reproducibility.md says), names any other key that changed and then reruns nothing,
/// refuses tolerances that are not finite, non-negative and below 1, and a sweep under an
/// `MKL_CBWR` MKL does not know is refused at once.
#[test]
fn sweep_check_with_changed_numerics_and_tolerances() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    write(d, "e.toml", &experiment("portable", "0.1"));
    assert_ok(&run(&["sweep", "e.toml", "--out", "s"], d));
    write(d, "e.toml", &experiment("native", "0.1"));
    let o = run(&["sweep", "e.toml", "--out", "s", "--check"], d);
    assert_ok(&o);
    assert!(
        text(&o).0.contains("1 points reproduce s: every non-timing value of every trace is identical"),
        "{}",
        text(&o).0
    );
    write(d, "e.toml", &experiment("portable", "0.05"));
    let o = run(&["sweep", "e.toml", "--out", "s", "--check"], d);
    assert_says(
        &o,
        1,
        &[
            "`train.lr`: 0.1 in the run, 0.05 now (experiment [set] train.lr=0.05)",
            "no point was rerun: none has a stored run of its configuration (each line above says why)",
        ],
        "changed lr",
    );
    assert!(!text(&o).1.contains("--tolerance"), "{}", text(&o).1);
    for (bad, want) in [
        ("nan", "invalid value 'nan' for '--tolerance <REL>': NaN is not a relative difference"),
        ("inf", "invalid value 'inf' for '--tolerance <REL>': inf is not a relative difference"),
        ("-1e-6", "invalid value '-1e-6' for '--tolerance <REL>': -0.000001 is not a relative difference"),
        ("2", "invalid value '2' for '--tolerance <REL>': 2 would accept any two values of the same sign"),
    ] {
        let o = run(&["sweep", "e.toml", "--out", "s", "--check", "--tolerance", bad], d);
        assert_says(&o, 2, &[want], bad);
    }
    let o =
        runner().args(["sweep", "e.toml", "--out", "g"]).env("MKL_CBWR", "garbage").current_dir(d).output().unwrap();
    assert_says(&o, 2, &["error: MKL_CBWR=\"garbage\" in the environment is not a value MKL knows"], "MKL_CBWR");
    assert!(!d.join("g").exists(), "nothing ran");
}

/// The smaller ones, each with its message: a schema written to a full disk, gloo's own text after
/// a kill, `run.memory_per_rank_mb` out of range or infinite, and `wrap.bucket_cap_mb` set (to its
/// default) under FSDP.
#[test]
fn the_smaller_refusals_say_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let full = std::fs::File::options().write(true).open("/dev/full").unwrap();
    let o = runner().args(["schema", "--markdown"]).stdout(full).output().unwrap();
    assert_says(
        &o,
        1,
        &["error: cannot write the schema to standard output (No space left on device (os error 28)): nothing \
           complete was written"],
        "schema > /dev/full",
    );
    write(d, "p.toml", TINY);
    for (set, want) in [
        (
            "run.memory_per_rank_mb=1e400",
            "error: --set run.memory_per_rank_mb=1e400: 1e400 is beyond the range of a float (about ±1.8e308); give \
             a finite number",
        ),
        (
            "run.memory_per_rank_mb=inf",
            "`run.memory_per_rank_mb` (--set run.memory_per_rank_mb=inf): must be a finite, positive number of MiB, \
             got inf (leave it out for no limit)",
        ),
        (
            "wrap.bucket_cap_mb=25",
            "`wrap.bucket_cap_mb` (--set wrap.bucket_cap_mb=25): is only read by wrap.strategy = \"ddp\": FSDP \
             reduce-scatters each layer's gradients as one bucket; remove it",
        ),
    ] {
        let o = run(&["validate", "p.toml", "--set", "wrap.strategy=\"fsdp\"", "--set", set], d);
        assert_says(&o, 2, &[want], set);
    }
    // A rank killed mid-run: its peer's error names it, without gloo's C++ source paths.
    write(d, "p.toml", &format!("{TINY}\n[checkpoint]\nevery = 1\n").replace("epochs = 2", "epochs = 30"));
    let err = common::run_and_kill(d, "k", &[], 1);
    assert!(err.contains("error: the run failed: rank 1 was killed by SIGKILL"), "{err}");
    for never in ["__w/pytorch", ".cc:", "pair.cc"] {
        assert!(!err.contains(never), "{never:?} in:\n{err}");
    }
}
