//! The runner on a real Slurm cluster: Debian's slurm-wlm, one node, started once for this test
//! binary by `common::slurm` (root only: elsewhere these tests fail under CI=true and otherwise
//! print SKIPPED). srun tasks are ranks, every rank runs rank 0's plan, sweeps run as sbatch jobs.
use crate::common;

use std::path::Path;

use common::slurm::{cluster, Cluster};
use common::{assert_ok, text, trace, write, TINY};
use runner::sweep::check::compare;

/// Every non-timing value of two run directories' traces is the same.
fn assert_same_trace(a: &Path, b: &Path) {
    let (differences, _) = compare(&trace(a), &trace(b), None);
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

const EXPERIMENT: &str = r#"
pipeline = "p.toml"

[sweep]
"run.seed" = [1, 2]

[slurm]
nodes = 1
time = "10"
extra = ["--comment=runner-test"]
"#;

/// table.csv's values, less the columns that measure time.
fn table_without_timings(sweep: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(sweep.join("table.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    // Times and resident memory are measured, not computed: they differ from run to run.
    let timing = |c: &str| {
        ["epoch_s", "samples_per_s", "peak_rss_bytes"].iter().any(|p| c.starts_with(p))
            || ["speedup", "efficiency"].contains(&c)
    };
    lines
        .flat_map(|l| {
            let values: Vec<&str> = l.split(',').collect();
            header
                .iter()
                .zip(values)
                .filter(|(c, _)| !timing(c))
                .map(|(c, v)| (c.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn a_sweep_through_slurm_equals_a_local_sweep_and_skips_and_checks_like_one() {
    let Some(c) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    write(dir.path(), "exp.toml", EXPERIMENT);
    assert_ok(&common::run(&["sweep", "exp.toml", "--out", "local"], dir.path()));
    let sweep = |extra: &[&str]| {
        let mut args = vec!["sweep", "exp.toml", "--out", "slurm", "--launcher", "slurm"];
        args.extend(extra);
        c.runner().args(args).current_dir(dir.path()).output().unwrap()
    };
    let o = sweep(&[]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}\n{}", c.logs());
    assert_eq!(out.matches("submitted as job").count(), 2, "{out}");
    assert!(out.contains("2 of 2 points complete (2 run now"), "{out}");
    for point in ["seed=1", "seed=2"] {
        assert_same_trace(&dir.path().join("local").join(point), &dir.path().join("slurm").join(point));
        let script = std::fs::read_to_string(dir.path().join("slurm").join(point).join("slurm.sh")).unwrap();
        for line in
            ["#SBATCH --requeue", "#SBATCH --signal=USR1@90", "#SBATCH --time=10", "#SBATCH --comment=runner-test"]
        {
            assert!(script.contains(line), "{script}");
        }
        assert!(script.contains("exec srun "), "{script}");
    }
    assert_eq!(table_without_timings(&dir.path().join("local")), table_without_timings(&dir.path().join("slurm")));

    // Complete points are skipped, as locally; --check reruns them as jobs and compares.
    let o = sweep(&[]);
    let (out, _) = text(&o);
    assert!(o.status.success() && out.contains("0 run now, 2 already complete") && !out.contains("submitted"), "{out}");
    let o = sweep(&["--check"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("2 points reproduce"), "{out}");
}

/// A random search under ASHA (rungs at 1 and 2 epochs): each run of a trial to a rung is a job,
/// two at a time.
const SEARCH: &str = r#"
pipeline = "p.toml"

[search]
method = "random"
trials = 3
metric = "val_loss"
seed = 4
parallel = 2
scheduler = "asha"
min_epochs = 1

[search.space]
"train.lr" = { log_uniform = [0.01, 0.3] }

[slurm]
nodes = 1
time = "10"
"#;

#[test]
fn a_search_through_slurm_equals_the_local_search_and_continues_its_promoted_trial_in_a_job() {
    let Some(c) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    write(dir.path(), "search.toml", SEARCH);
    assert_ok(&common::run(&["sweep", "search.toml", "--out", "local"], dir.path()));
    let o = c
        .runner()
        .args(["sweep", "search.toml", "--out", "slurm", "--launcher", "slurm"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}\n{}", c.logs());
    assert!(out.contains("→ rung 1 (2 epochs): continues"), "{out}");
    let (local, slurm) = (dir.path().join("local"), dir.path().join("slurm"));
    for file in ["table.md", "table.csv"] {
        let read = |d: &Path| std::fs::read_to_string(d.join(file)).unwrap();
        assert_eq!(read(&local), read(&slurm), "{file}");
    }
    let table = std::fs::read_to_string(slurm.join("table.md")).unwrap();
    assert!(table.contains("1 complete, 2 stopped early"), "{table}");
    for trial in ["trial-000", "trial-001", "trial-002"] {
        assert_same_trace(&local.join(trial), &slurm.join(trial));
    }
    let promoted = ["trial-000", "trial-001", "trial-002"]
        .into_iter()
        .find(|t| std::fs::read_to_string(slurm.join(t).join("slurm.sh")).unwrap().contains("--resume"))
        .expect("the promoted trial's last job resumed its run");
    let log = std::fs::read_to_string(slurm.join(promoted).join("run.log")).unwrap();
    assert!(log.contains("resuming run"), "{log}");
}

#[test]
fn stopping_a_slurm_sweep_cancels_its_jobs() {
    let Some(c) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &TINY.replace("epochs = 2", "epochs = 500"));
    write(dir.path(), "exp.toml", "pipeline = \"p.toml\"\n[sweep]\n\"train.lr\" = [0.0123]\n");
    let sweep = c
        .runner()
        .args(["sweep", "exp.toml", "--out", "s", "--launcher", "slurm"])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let job = || {
        let o =
            c.command("squeue").args(["-h", "--states=all", "-n", "runner:lr=0.0123", "-o", "%i %T"]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim().split_once(' ').map(|(i, s)| (i.to_owned(), s.to_owned()))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while job().is_none_or(|(_, s)| s != "RUNNING") {
        assert!(std::time::Instant::now() < deadline, "the job never ran:\n{}", c.logs());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let (id, _) = job().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(sweep.id() as i32), nix::sys::signal::Signal::SIGINT).unwrap();
    let o = sweep.wait_with_output().unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(130), "{out}\n{err}");
    assert!(err.contains("the sweep cancelled its Slurm jobs (scancel)"), "{err}");
    assert!(out.contains("lr=0.0123: cancelled (scancel)"), "{out}");
    while c.job_state(&id).is_some_and(|s| s != "CANCELLED") {
        assert!(std::time::Instant::now() < deadline, "job {id} was not cancelled");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn sigusr1_preempts_a_job_which_checkpoints_requeues_itself_and_ends_as_if_uninterrupted() {
    let Some(c) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", &TINY.replace("rows = 600", "rows = 6000").replace("epochs = 2", "epochs = 12"));
    assert_ok(&common::run(&["run", "p.toml", "--out", "whole"], d));
    let runner = env!("CARGO_BIN_EXE_runner");
    write(d, "job.sh", &format!("#!/bin/sh\nexec srun {runner} run p.toml --out o\n"));
    let log = d.join("job.log");
    let o = c
        .command("sbatch")
        .args(["--parsable", "--ntasks=2", "--requeue", "--open-mode=append", "--output"])
        .arg(&log)
        .arg("--chdir")
        .arg(d)
        .arg(d.join("job.sh"))
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "sbatch: {err}");
    let id = out.trim().to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    // Mid-run (the first epoch's row is written), Slurm signals every task of the job's steps.
    while !d.join("o/trace.parquet").exists() {
        assert!(std::time::Instant::now() < deadline, "the job did not train:\n{}", c.logs());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(c.command("scancel").args(["--signal=USR1", &id]).status().unwrap().success());
    while c.job_state(&id).as_deref() != Some("COMPLETED") {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(std::time::Instant::now() < deadline, "job {id} did not complete: {:?}\n{log}", c.job_state(&id));
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let log = std::fs::read_to_string(&log).unwrap();
    let step: usize = log
        .split("preempted at step ")
        .nth(1)
        .and_then(|rest| rest.split(':').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no preemption in the job's output:\n{log}"));
    assert!(log.contains(&format!("preempted at step {step}: checkpoint written, job requeued")), "{log}");
    assert!(log.contains(&format!("(preempted at step {step})")), "the requeued job resumed there:\n{log}");
    let manifest = std::fs::read_to_string(d.join("o/manifest.json")).unwrap();
    assert!(manifest.contains("\"status\": \"complete\""), "{manifest}");
    let shown = c.command("scontrol").args(["show", "job", &id]).output().unwrap();
    assert!(String::from_utf8_lossy(&shown.stdout).contains("Restarts=1"), "requeued once");
    assert_same_trace(&d.join("whole"), &d.join("o"));
}

#[test]
fn a_failed_rank_requeues_the_job_which_resumes_and_ends_as_if_uninterrupted() {
    let Some(c) = cluster() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pipeline = TINY
        .replace("rows = 600", "rows = 3000")
        .replace("epochs = 2", "epochs = 3")
        .replace("timeout_s = 30", "timeout_s = 30\nmax_restarts = 2")
        + "\n[checkpoint]\nevery_steps = 20\n";
    write(d, "p.toml", &pipeline);
    assert_ok(&common::run(&["run", "p.toml", "--out", "whole"], d));
    let runner = env!("CARGO_BIN_EXE_runner");
    write(d, "job.sh", &format!("#!/bin/sh\nexec srun {runner} run p.toml --out o\n"));
    let (log, once) = (d.join("job.log"), d.join("stalled.once"));
    // Rank 1 stops in step 5 of epoch 2, where the test kills it.
    let o = c
        .command("sbatch")
        .env("RUNNER_TEST_STALL_AT", format!("1:train, epoch 2, step 5@{}", once.display()))
        .args(["--parsable", "--ntasks=2", "--requeue", "--open-mode=append", "--output"])
        .arg(&log)
        .arg("--chdir")
        .arg(d)
        .arg(d.join("job.sh"))
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "sbatch: {err}");
    let id = out.trim().to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !once.exists() {
        assert!(std::time::Instant::now() < deadline, "the job did not reach epoch 2:\n{}", c.logs());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The job's task of rank 1: this job's runner process with SLURM_PROCID=1.
    let task = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let has = |v: String| env.split(|b| *b == 0).any(|x| x == v.as_bytes());
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
            exe == Path::new(runner) && has(format!("SLURM_JOB_ID={id}")) && has("SLURM_PROCID=1".into())
        })
        .expect("rank 1's task");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(task), nix::sys::signal::Signal::SIGKILL).unwrap();
    while c.job_state(&id).as_deref() != Some("COMPLETED") {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(std::time::Instant::now() < deadline, "job {id} did not complete: {:?}\n{log}", c.job_state(&id));
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("a rank failed, job requeued"), "{log}");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("o/manifest.json")).unwrap()).unwrap();
    assert_eq!(m["status"], "complete", "{m:#}\n{log}");
    let restarts = m["restarts"].as_array().unwrap();
    assert_eq!(restarts.len(), 1, "{m:#}");
    assert_eq!(restarts[0]["by"], "slurm", "{m:#}");
    // Rank 0's account: it lost its peer.
    assert!(m["failures"][0]["cause"].as_str().unwrap().starts_with("rank 0: "), "{m:#}");
    assert!(m["goodput"]["wall_s"].as_f64().unwrap() > m["goodput"]["restart_s"].as_f64().unwrap(), "{m:#}");
    let shown = c.command("scontrol").args(["show", "job", &id]).output().unwrap();
    assert!(String::from_utf8_lossy(&shown.stdout).contains("Restarts=1"), "requeued once");
    assert_same_trace(&d.join("whole"), &d.join("o"));
    let model = |o: &str| std::fs::read(d.join(o).join("model.safetensors")).unwrap();
    assert!(model("whole") == model("o"), "model.safetensors differs");
}
