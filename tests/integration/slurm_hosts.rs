//! Slurm over several hosts, for real: `scripts/slurm-cluster.sh` starts slurmctld on one
//! network-namespace host and a slurmd on each of three others (their own addresses, hostnames
//! and spool folders, munge shared), once for this test binary; its `down` runs when the binary
//! ends. On it, a job's ranks train on two hosts, a higher-priority job preempts a running one
//! that Slurm requeues, and a node taken down mid-job (requeued too): each run ends as the
//! uninterrupted one, bit for bit.
use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{text, write, TINY};

struct Hosts {
    dir: PathBuf,
    _watchdog: std::process::Child,
}

/// The tests share one cluster of 3 hosts and two partitions: one at a time, so that one test's
/// high-priority job never preempts another's (each test's own preemption is its own).
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The binary's cluster of 3 hosts; `None` (after a SKIPPED line, a failure under CI=true)
/// where it cannot run.
fn hosts() -> Option<&'static Hosts> {
    static HOSTS: OnceLock<Option<Hosts>> = OnceLock::new();
    HOSTS
        .get_or_init(|| {
            if !nix::unistd::geteuid().is_root() {
                common::cannot_run("slurm_hosts", "the multi-host Slurm cluster needs root");
                return None;
            }
            let dir = std::env::temp_dir().join(common::unique_name("rslurm"));
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/slurm-cluster.sh");
            // Stops the cluster once this test process is gone, however it ends.
            let watchdog = Command::new("sh")
                .args([
                    "-c",
                    &format!(
                        "while kill -0 {} 2>/dev/null; do sleep 0.5; done; '{}' down '{}'",
                        std::process::id(),
                        script.display(),
                        dir.display()
                    ),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let up = Command::new(&script).arg("up").arg(&dir).arg("3").output().unwrap();
            assert!(up.status.success(), "scripts/slurm-cluster.sh up: {}", text(&up).1);
            Some(Hosts { dir, _watchdog: watchdog })
        })
        .as_ref()
}

impl Hosts {
    /// A Slurm client command run from the ctl host.
    fn client(&self, program: &str) -> Command {
        let mut c = Command::new(self.dir.join("on-ctl"));
        c.arg(program);
        for (k, _) in std::env::vars() {
            if k.starts_with("RUNNER_") || k.starts_with("SLURM_") {
                c.env_remove(k);
            }
        }
        c
    }

    /// Submits `script` (a batch script's body) from `dir` with `args`; the job's id.
    fn sbatch(&self, dir: &Path, args: &[&str], script: &str) -> String {
        write(dir, "job.sh", &format!("#!/bin/sh\n{script}\n"));
        let out = self
            .client("sbatch")
            .args(["--parsable", "-D"])
            .arg(dir)
            .args(args)
            .arg(dir.join("job.sh"))
            .output()
            .unwrap();
        assert!(out.status.success(), "sbatch: {}", text(&out).1);
        text(&out).0.trim().to_owned()
    }

    fn job(&self, id: &str, field: &str) -> String {
        let out = self.client("scontrol").args(["show", "job", id]).output().unwrap();
        let (shown, _) = text(&out);
        let key = format!("{field}=");
        shown.split_whitespace().find_map(|w| w.strip_prefix(&key)).unwrap_or_default().to_owned()
    }

    /// Waits until job `id` has ended; its final state.
    fn wait(&self, id: &str, limit: Duration) -> String {
        let start = Instant::now();
        loop {
            let state = self.job(id, "JobState");
            if ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"].contains(&state.as_str()) {
                return state;
            }
            assert!(start.elapsed() < limit, "job {id} still {state} after {limit:?}: {}", self.logs());
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    fn logs(&self) -> String {
        let tail = |p: &str| std::fs::read_to_string(self.dir.join("log").join(p)).unwrap_or_default();
        let ctld = tail("slurmctld.log");
        let lines: Vec<&str> = ctld.lines().collect();
        format!("slurmctld.log:\n{}", lines[lines.len().saturating_sub(20)..].join("\n"))
    }
}

/// The training every test runs: TINY at 4 ranks with a checkpoint each epoch.
fn runner_line(out: &Path, epochs: usize) -> String {
    format!(
        "srun {} run p.toml --set run.world_size=4 --set train.epochs={epochs} --set checkpoint.every=1 --out {}",
        env!("CARGO_BIN_EXE_runner"),
        out.display()
    )
}

/// The same run on this machine's own launcher, uninterrupted: the oracle.
fn uninterrupted(dir: &Path, out: &str, epochs: usize) -> Vec<u8> {
    let sets = ["--set", "run.world_size=4", "--set", &format!("train.epochs={epochs}"), "--set", "checkpoint.every=1"];
    common::assert_ok(
        &common::runner().args(["run", "p.toml", "--out", out]).args(sets).current_dir(dir).output().unwrap(),
    );
    std::fs::read(dir.join(out).join("model.safetensors")).unwrap()
}

fn wait_for_checkpoint(run: &Path, epoch: usize) {
    let index = run.join(format!("checkpoints/epoch-{epoch:04}/index.json"));
    let start = Instant::now();
    while !index.exists() {
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint {}", index.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_job_of_two_hosts_trains_as_one_host_does() {
    let _alone = alone();
    let Some(h) = hosts() else { return };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let run = dir.path().join("o");
    let id = h.sbatch(dir.path(), &["-N", "2", "--ntasks-per-node", "2", "-o", "job.out"], &runner_line(&run, 2));
    assert_eq!(h.wait(&id, Duration::from_secs(120)), "COMPLETED", "{}", h.logs());
    // Slurm placed it on two hosts, named as a host list; node 0's launcher found the first.
    let nodes = h.job(&id, "NodeList");
    assert!(nodes.starts_with("node[") && nodes.contains('-'), "two hosts, as a range: {nodes}");
    // The manifest records each rank's host: two ranks on each of the job's two hosts.
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("manifest.json")).unwrap()).unwrap();
    let hosts: Vec<&str> = manifest["hosts"].as_array().unwrap().iter().map(|h| h.as_str().unwrap()).collect();
    let expanded = runner::launch::slurm::expand_nodelist(&nodes).unwrap();
    assert_eq!(hosts, [&expanded[0], &expanded[0], &expanded[1], &expanded[1]], "{manifest}");
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        uninterrupted(dir.path(), "local", 2),
        "the model of 2 hosts is the model of one, bit for bit"
    );
}

/// A requeueable job of 30 epochs on two hosts, interrupted by `interrupt(job id)` once its
/// second checkpoint is written: Slurm requeues it, and it ends as the uninterrupted run, bit
/// for bit.
fn requeued_job_ends_as_if_uninterrupted(h: &Hosts, interrupt: impl FnOnce(&Path, &str)) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let run = dir.path().join("o");
    let args = ["--requeue", "-N", "2", "--ntasks-per-node", "2", "-o", "job.out"];
    let id = h.sbatch(dir.path(), &args, &runner_line(&run, 30));
    wait_for_checkpoint(&run, 2);
    interrupt(dir.path(), &id);
    assert_eq!(h.wait(&id, Duration::from_secs(180)), "COMPLETED", "{}", h.logs());
    assert!(h.job(&id, "Restarts").parse::<u32>().unwrap() >= 1, "Slurm requeued the job");
    let manifest = std::fs::read_to_string(run.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"status\": \"complete\"") && manifest.contains("\"by\": \"slurm\""), "{manifest}");
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        uninterrupted(dir.path(), "local", 30),
        "the requeued job resumed from its checkpoint to the uninterrupted model"
    );
}

#[test]
fn a_job_preempted_by_a_higher_priority_one_is_requeued_and_ends_as_if_uninterrupted() {
    let _alone = alone();
    let Some(h) = hosts() else { return };
    requeued_job_ends_as_if_uninterrupted(h, |dir, _| {
        // Every CPU of every host, in the partition of the higher tier: Slurm preempts the job.
        let high = h.sbatch(dir, &["-p", "high", "-N", "3", "--ntasks-per-node", "4", "-o", "high.out"], "sleep 2");
        assert_eq!(h.wait(&high, Duration::from_secs(60)), "COMPLETED", "{}", h.logs());
    });
}

#[test]
fn a_node_taken_down_mid_job_is_requeued_and_the_run_completes_as_if_uninterrupted() {
    let _alone = alone();
    let Some(h) = hosts() else { return };
    requeued_job_ends_as_if_uninterrupted(h, |_, id| {
        // A host of the job other than the one running its batch script.
        let nodes = runner::launch::slurm::expand_nodelist(&h.job(id, "NodeList")).unwrap();
        let lost = nodes.iter().find(|n| **n != h.job(id, "BatchHost")).unwrap().clone();
        let node = format!("nodename={lost}");
        let down = h.client("scontrol").args(["update", &node, "state=down", "reason=test"]).output().unwrap();
        assert!(down.status.success(), "{}", text(&down).1);
        // Slurm ends the job and requeues it; the node comes back for the other tests (Slurm may
        // have returned it itself: ReturnToService=2).
        let start = Instant::now();
        while h.job(id, "Restarts") == "0" && start.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = h.client("scontrol").args(["update", &node, "state=resume"]).output();
    });
}

#[test]
fn a_sweep_submitted_as_jobs_lands_its_points_on_different_hosts() {
    let _alone = alone();
    let Some(h) = hosts() else { return };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    // Each point takes a whole host (2 tasks × 2 CPUs of its 4): the three run side by side.
    write(
        dir.path(),
        "exp.toml",
        "pipeline = \"p.toml\"\n\n[set]\n\"run.world_size\" = 2\n\n[sweep]\n\"run.seed\" = [1, 2, 3]\n\n\
         [slurm]\nnodes = 1\nntasks_per_node = 2\ncpus_per_task = 2\n",
    );
    let mut sweep = h.client(env!("CARGO_BIN_EXE_runner"));
    let out = sweep
        .args(["sweep", "exp.toml", "--out", "sw", "--launcher", "slurm"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let (stdout, err) = text(&out);
    assert!(out.status.success(), "{stdout}\n{err}\n{}", h.logs());
    assert!(stdout.contains("3 of 3 points complete"), "{stdout}");
    let mut ranks0: Vec<String> = Vec::new();
    for e in std::fs::read_dir(dir.path().join("sw")).unwrap().flatten().filter(|e| e.path().is_dir()) {
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(e.path().join("manifest.json")).unwrap()).unwrap();
        ranks0.push(manifest["host"].as_str().unwrap().to_owned());
    }
    ranks0.sort();
    ranks0.dedup();
    assert!(ranks0.len() >= 2 && ranks0.iter().all(|h| h.starts_with("node")), "points' hosts: {ranks0:?}");
}
