//! `wrap.threads_per_replica`: a rank's threads as several replicas of the model, each computing
//! its part of every batch at once. The oracle is gradient accumulation over the same parts on
//! one thread: the same sums in the same order, so the same bits, at world sizes 1 and 2.
use crate::common;

use std::path::Path;

use common::{assert_ok, run, text, write, SMALL_LM as PIPELINE};

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "book.txt", &common::book());
    write(dir.path(), "threads.toml", PIPELINE);
    // The same pipeline with all of a rank's threads in one replica (the key's default).
    write(dir.path(), "one.toml", &PIPELINE.replace("threads_per_replica = 1\n", ""));
    dir
}

/// Every tensor of a run's final model, by name: its float32 values' bits.
fn weights(dir: &Path) -> Vec<(String, Vec<u32>)> {
    let mut out: Vec<(String, Vec<u32>)> = tch::Tensor::read_safetensors(dir.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(name, t)| (name, Vec::<f32>::try_from(t.reshape([-1])).unwrap().iter().map(|v| v.to_bits()).collect()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn losses(dir: &Path) -> Vec<f64> {
    column(dir, "global_train_loss")
}

fn column(dir: &Path, name: &str) -> Vec<f64> {
    let df = common::trace(dir);
    df.column(name).unwrap().f64().unwrap().iter().flatten().collect()
}

#[test]
fn two_replicas_of_one_thread_equal_gradient_accumulation_bit_for_bit_at_world_sizes_1_and_2() {
    let dir = setup();
    let p = dir.path();
    for world in ["1", "2"] {
        let ws = format!("run.world_size={world}");
        let (split, acc) = (format!("split{world}"), format!("acc{world}"));
        let o = run(&["run", "threads.toml", "--out", &split, "--set", &ws], p);
        assert_ok(&o);
        let (plan, _) = text(&o);
        assert!(
            plan.contains("2 replicas per rank sharing its weights, 1 thread each, computing their parts of every batch at once, gradients summed in order"),
            "{plan}"
        );
        if world == "2" {
            assert!(plan.contains("then averaged across ranks in one all-reduce"), "{plan}");
        }
        // Each batch of 8 as 4 + 4 one after the other, on one thread (DDP's Reducer at world size 2).
        let one = ["--set", "run.threads_per_rank=1", "--set", "train.batch_size=4", "--set", "train.accumulate=2"];
        assert_ok(&run(&[&["run", "one.toml", "--out", &acc, "--set", &ws][..], &one[..]].concat(), p));
        let (a, b) = (losses(&p.join(&split)), losses(&p.join(&acc)));
        assert_eq!(a.len(), 3 * world.parse::<usize>().unwrap());
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "world size {world}: the same losses, to the bit: {a:?} against {b:?}");
        assert_eq!(weights(&p.join(&split)), weights(&p.join(&acc)), "world size {world}: the same final weights");
        assert!(a[a.len() - 1] < a[0], "it learns: {a:?}");
        // Validation's forward pass is split over the replicas too: the same rows, in parts.
        let (va, vb) = (column(&p.join(&split), "val_loss"), column(&p.join(&acc), "val_loss"));
        assert_eq!(va.len(), 3);
        for (x, y) in va.iter().zip(&vb) {
            assert!(((x - y) / y).abs() < 1e-6, "world size {world}: validation {va:?} against {vb:?}");
        }
    }
    // The same model computed as one replica of two threads: equal up to rounding, not bitwise
    // (the products are summed in other orders).
    assert_ok(&run(&["run", "one.toml", "--out", "whole"], p));
    let (a, b) = (losses(&p.join("split1")), losses(&p.join("whole")));
    for (x, y) in a.iter().zip(&b) {
        assert!(((x - y) / y).abs() < 1e-5, "{a:?} against {b:?}");
    }
}

#[test]
fn thread_replicas_that_cannot_split_the_work_are_refused_by_name() {
    let dir = setup();
    let p = dir.path();
    for (set, says) in [
        (
            "wrap.threads_per_replica=3",
            "3 does not divide the rank's 2 threads (run.threads_per_rank); use a divisor of 2",
        ),
        ("wrap.threads_per_replica=0", "must be at least 1"),
        (
            "wrap.model.dropout=0.1",
            "2 replicas per rank (2 threads / 1) would draw dropout's masks from one generator on two threads",
        ),
        (
            "train.batch_size=1",
            "2 replicas per rank (2 threads / 1) need at least 2 rows per batch to split; the rank's batch has 1",
        ),
        (
            "wrap.strategy=\"pipeline\"",
            "are for whole replicas (wrap.strategy = \"ddp\" or \"none\"), not a pipeline's stages",
        ),
    ] {
        let o = run(&["validate", "threads.toml", "--set", set], p);
        let (_, stderr) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{set}: {stderr}");
        assert!(stderr.contains("`wrap.threads_per_replica`") && stderr.contains(says), "{set}: {stderr}");
    }
    // One replica of all the threads: nothing to refuse, whatever the model draws.
    let o =
        run(&["validate", "threads.toml", "--set", "wrap.threads_per_replica=2", "--set", "wrap.model.dropout=0.1"], p);
    assert_ok(&o);
}
