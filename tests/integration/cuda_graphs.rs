//! `run.cuda_graphs` on the plan: what a replayed step cannot hold is refused by name, on any
//! machine (`runner validate --device cuda` plans for a GPU machine from this one). The capture
//! itself runs on a GPU only: `scripts/gpu_check.py`'s perf section runs it and holds its losses
//! equal to the uncaptured run's.
use crate::common;

use common::{run, text, write, TINY};

const GPU_LM: &str = r#"
[run]
name = "graphs"
device = "cuda"
backend = "nccl"
world_size = 1
cuda_graphs = true

[load]
source = "text"
path = "corpus.txt"
sampling = "random"

[normalize]
method = "none"

[wrap.model]
kind = "transformer"
vocab = 256
d_model = 32
heads = 2
layers = 2
seq_len = 32

[train]
steps = 20
batch_size = 8
optimizer = "adamw"
clip_grad_norm = 1.0
"#;

fn validate(dir: &std::path::Path, sets: &[&str]) -> (Option<i32>, String, String) {
    let mut args = vec!["validate", "p.toml", "--device", "cuda"];
    for s in sets {
        args.extend(["--set", s]);
    }
    let o = run(&args, dir);
    let (out, err) = text(&o);
    (o.status.code(), out, err)
}

#[test]
fn a_replayable_gpu_step_is_planned_with_its_capture_and_what_cannot_be_replayed_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", GPU_LM);
    write(dir.path(), "corpus.txt", &"to be or not to be, that is the question. ".repeat(200));
    let (code, out, err) = validate(dir.path(), &[]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("captured as a CUDA graph at step 4, replayed from then on (run.cuda_graphs)"), "{out}");
    for (set, key, why) in [
        ("wrap.model.dropout=0.1", "wrap.model.dropout", "a replay does not read"),
        ("train.accumulate=2", "train.accumulate", "adds to the gradients"),
        ("wrap.activation_checkpointing.policy=\"full\"", "wrap.activation_checkpointing.policy", "random states"),
        ("wrap.strategy=\"fsdp\"", "run.cuda_graphs", "holds collectives"),
    ] {
        let (code, out, err) = validate(dir.path(), &[set]);
        assert_eq!(code, Some(2), "{set}: {out}\n{err}");
        assert!(err.contains(&format!("`{key}`")) && err.contains(why), "{set}: {err}");
    }
    let (code, _, err) = validate(dir.path(), &["run.world_size=2"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("`run.cuda_graphs`") && err.contains("\"none\""), "{err}");
    // Each rank alone replays its own step.
    let (code, out, err) = validate(dir.path(), &["run.world_size=2", "wrap.strategy=\"none\""]);
    assert_eq!(code, Some(0), "{out}\n{err}");
}

#[test]
fn cuda_graphs_are_refused_on_the_cpu_and_where_an_epoch_s_last_batch_is_short() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &format!("{TINY}\n"));
    // The CPU: naming the key, and what to do.
    let o = run(&["run", "p.toml", "--set", "run.cuda_graphs=true", "--set", "run.world_size=1"], dir.path());
    let err = text(&o).1;
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("`run.cuda_graphs`") && err.contains("run.device = \"cuda\""), "{err}");
    assert!(!dir.path().join("results").exists(), "nothing written");
    // 600 rows at batch 16 on one rank: the epoch's last batch holds 8 rows.
    let sets = ["run.cuda_graphs=true", "run.world_size=1", "run.device=\"cuda\""];
    let mut args = vec!["validate", "p.toml", "--device", "cuda"];
    sets.iter().for_each(|s| args.extend(["--set", s]));
    let o = run(&args, dir.path());
    let err = text(&o).1;
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("`train.batch_size`") && err.contains("last batch of 8 rows"), "{err}");
    args.extend(["--set", "train.batch_size=20"]);
    let o = run(&args, dir.path());
    assert!(o.status.success(), "{}", text(&o).1);
}
