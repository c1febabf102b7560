//! The plan's GPU memory model against the one recorded GPU point, planned here on the CPU with
//! `runner validate --device cuda`: the GPU check's GPT-2-small-sized run (scripts/gpu_check.py,
//! bf16, batch 8 × 1024, AdamW) peaked at 10.41 GiB allocated and 12.81 GiB reserved on an H200
//! (docs/gpus.md).
use crate::common;

use std::path::Path;
use std::process::Command;

use common::{run, text};

/// The GPU check's own GPT-2 pipeline (scripts/gpu_check.py's template) at `batch`, with a token
/// file of random ids, written into `dir` as gpt2.toml.
fn gpt2_pipeline(dir: &Path, batch: usize) {
    let script = format!(
        "import sys; sys.path.insert(0, {scripts:?}); import gpu_check; \
         gpu_check.write_gpt2({dir:?}, gpu_check.GPT2_SMALL, {batch}, 'cuda', 'nccl', n_tokens=200_000)",
        scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts").display().to_string(),
        dir = dir.display().to_string(),
    );
    let o = Command::new(common::reference_python()).args(["-c", &script]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o).1);
}

/// The GiB before `what` in the plan's "GPU memory per rank" line.
fn gib_before(out: &str, what: &str) -> f64 {
    let line = out.lines().find(|l| l.contains("GPU memory per rank")).unwrap_or_else(|| panic!("no GPU line:\n{out}"));
    let at = line.find(what).unwrap_or_else(|| panic!("no {what} in {line}"));
    let words: Vec<&str> = line[..at].split_whitespace().collect();
    assert_eq!(words[words.len() - 1], "GiB", "{line}");
    words[words.len() - 2].parse().unwrap()
}

#[test]
fn the_plan_for_a_gpu_made_on_the_cpu_replays_the_recorded_h200_point_within_15_percent() {
    let dir = tempfile::tempdir().unwrap();
    gpt2_pipeline(dir.path(), 8);
    // This build has no CUDA: the plan for this machine refuses the device, naming the key.
    let here = run(&["validate", "gpt2.toml"], dir.path());
    assert_eq!(here.status.code(), Some(2), "{}", text(&here).0);
    assert!(text(&here).1.contains("`run.device`"), "{}", text(&here).1);
    // Planned for a GPU machine, it gives the device's estimate.
    let o = run(&["validate", "gpt2.toml", "--device", "cuda"], dir.path());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let allocated = gib_before(&out, "allocated at the peak");
    let reserved = gib_before(&out, "reserved by the caching allocator");
    assert!((allocated - 10.41).abs() / 10.41 < 0.15, "allocated {allocated} GiB against 10.41 measured");
    assert!((reserved - 12.81).abs() / 12.81 < 0.15, "reserved {reserved} GiB against 12.81 measured");
    // No libtorch view of this machine's (absent) GPUs under a plan for another machine.
    assert!(!out.contains("sees 0 GPU"), "{out}");
}

#[test]
fn a_plan_for_another_machine_still_refuses_what_no_machine_runs() {
    let dir = tempfile::tempdir().unwrap();
    gpt2_pipeline(dir.path(), 8);
    // nccl moves GPU memory only, on every machine.
    let o = run(&["validate", "gpt2.toml", "--device", "cpu"], dir.path());
    let err = text(&o).1;
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("`run.backend`") && err.contains("nccl moves GPU memory only"), "{err}");
    // The CPU run has no GPU line.
    let o = run(&["validate", "gpt2.toml", "--device", "cpu", "--set", "run.backend=\"gloo\""], dir.path());
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(!text(&o).0.contains("GPU memory per rank"), "{}", text(&o).0);
}
