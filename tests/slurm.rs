//! The runner on a real Slurm cluster: Debian's slurm-wlm, one node, started once for this test
//! binary by `common::slurm` (root only: elsewhere these tests fail under CI=true and otherwise
//! print SKIPPED). srun tasks are ranks, every rank runs rank 0's plan, sweeps run as sbatch jobs.
mod common;

use std::path::Path;

use common::slurm::{cluster, Cluster};
use common::{assert_ok, text, trace, write, TINY};
use runner::sweep::check::compare;

/// Every non-timing value of two run directories' traces is the same.
fn assert_same_trace(a: &Path, b: &Path) {
    let differences = compare(&trace(a), &trace(b));
    assert!(differences.is_empty(), "{} and {} differ:\n{}", a.display(), b.display(), differences.join("\n"));
}

fn srun_output(c: &Cluster, dir: &Path, srun: &[&str], args: &[&str]) -> std::process::Output {
    c.srun(srun).args(args).current_dir(dir).output().expect("srun starts")
}

#[test]
fn srun_with_two_tasks_equals_a_local_run_of_two_ranks() {
    let Some(c) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    assert_ok(&common::run(&["run", "p.toml", "--out", "local"], dir.path()));
    let o = srun_output(c, dir.path(), &["-n", "2"], &["run", "p.toml", "--out", "srun"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "srun failed ({}):\n{out}\n{err}\n{}", o.status, c.logs());
    // One run of 2 ranks: rank 0 printed the epoch table once, and no task launched ranks.
    assert_eq!(out.matches("epoch 2/2").count(), 1, "{out}");
    let run_dir = dir.path().join("srun");
    let manifest = std::fs::read_to_string(run_dir.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"status\": \"complete\""), "{manifest}");
    assert_eq!(trace(&run_dir).height(), 2 * 2, "2 epochs × 2 ranks");
    assert_same_trace(&dir.path().join("local"), &run_dir);
}

#[test]
fn srun_tasks_that_disagree_with_the_world_size_are_refused_with_both_numbers() {
    let Some(c) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let o = srun_output(c, dir.path(), &["-n", "2"], &["run", "p.toml", "--out", "o", "--set", "run.world_size=3"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("srun started 2 tasks (SLURM_STEP_NUM_TASKS=2), one rank each, but run.world_size is 3"),
        "{err}"
    );
    // Every rank refused (rank 0's verdict reached rank 1), and no run started.
    assert!(err.contains("error: rank 1:"), "{err}");
    assert!(!dir.path().join("o/trace.parquet").exists());
}

#[test]
fn a_rank_whose_configuration_differs_is_refused_naming_the_key() {
    let Some(c) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    // Each task sets its own learning rate: 0.01 on rank 0, 0.11 on rank 1.
    let runner = env!("CARGO_BIN_EXE_runner");
    let o = c
        .command("srun")
        .args(["-n", "2", "sh", "-c"])
        .arg(format!("exec {runner} run p.toml --out o --set train.lr=0.${{SLURM_PROCID}}1"))
        .current_dir(dir.path())
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("the ranks do not run the same configuration"), "{err}");
    assert!(err.contains("train.lr: rank 0: 0.01, rank 1: 0.11"), "{err}");
    assert!(!dir.path().join("o/manifest.json").exists(), "a refused run claims no directory");
}
