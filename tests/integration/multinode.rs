//! Multi-node runs for real: two network namespaces joined by a veth pair act as two hosts with
//! two ranks each. Needs root and iproute2: without them the test fails under `CI=true` and
//! elsewhere prints a loud SKIPPED line. Every test names its namespaces and links uniquely
//! (process id and a counter), so the tests run in parallel.
use crate::common;

mod shared;

use std::process::{Command, Stdio};

use common::{assert_ok, text, write, TINY};
use polars::prelude::*;

pub(crate) struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Two hosts, a and b, at 10.231.N.1 and .2; `None` (with the reason) where this cannot be done.
pub(crate) fn two_hosts() -> Result<(Namespaces, [String; 2], [String; 2]), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("not running as root".into());
    }
    let id = common::unique_name("");
    let ns = [format!("rn{id}a"), format!("rn{id}b")];
    let mut guard = Namespaces(Vec::new());
    for n in &ns {
        ip(&["netns", "add", n])?;
        guard.0.push(n.clone());
    }
    let (va, vb) = (format!("rv{id}a"), format!("rv{id}b"));
    ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
    // Distinct subnets for the tests of one process (different processes: different namespaces).
    let subnet = (fnv(&id) % 250) as u8;
    let addr = [format!("10.231.{subnet}.1"), format!("10.231.{subnet}.2")];
    for ((n, v), a) in ns.iter().zip([&va, &vb]).zip(&addr) {
        ip(&["link", "set", v, "netns", n])?;
        ip(&["-n", n, "addr", "add", &format!("{a}/24"), "dev", v])?;
        ip(&["-n", n, "link", "set", v, "up"])?;
        ip(&["-n", n, "link", "set", "lo", "up"])?;
    }
    Ok((guard, ns, addr))
}

/// A small hash of a name, to spread the tests' subnets.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

#[test]
fn two_hosts_with_two_ranks_each_train_as_one_job() {
    let (_guard, ns, addr) = match two_hosts() {
        Ok(hosts) => hosts,
        Err(why) => {
            common::cannot_run(
                "two_hosts_with_two_ranks_each_train_as_one_job",
                &format!("cannot make network namespaces ({why})"),
            );
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let node = |i: usize| {
        Command::new("ip")
            .args(["netns", "exec", &ns[i], env!("CARGO_BIN_EXE_runner"), "run", "p.toml", "--set", "run.world_size=4"])
            .args(["--nnodes", "2", "--node-rank", &i.to_string(), "--master-addr", &addr[0], "--master-port", "29500"])
            .args(["--out", &format!("node{i}")])
            .current_dir(dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (node(0), node(1));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert_ok(&a);
    assert_ok(&b);
    let df = ParquetReader::new(std::fs::File::open(dir.path().join("node0/trace.parquet")).unwrap()).finish().unwrap();
    assert_eq!(df.height(), 4 * 2, "one row per rank per epoch, from both hosts");
    let ranks: Vec<u32> = df.column("rank").unwrap().u32().unwrap().into_no_null_iter().collect();
    assert_eq!(ranks, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    let (out, _) = text(&a);
    assert!(out.contains("run directory: node0"), "{out}");
}

#[test]
fn nodes_with_different_configurations_all_refuse_before_any_rank_starts() {
    // Two namespaces where they can be made; otherwise two launchers on loopback.
    let hosts = two_hosts();
    if let Err(why) = &hosts {
        common::cannot_run(
            "nodes_with_different_configurations (in two namespaces)",
            &format!("cannot make network namespaces ({why})"),
        );
        eprintln!("both nodes on 127.0.0.1 instead");
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let master = hosts.as_ref().map_or("127.0.0.1".to_string(), |h| h.2[0].clone());
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let node = |i: usize, sets: &[&str]| {
        let mut c = match &hosts {
            Ok((_, ns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns[i], env!("CARGO_BIN_EXE_runner")]);
                c
            }
            Err(_) => common::runner(),
        };
        c.args(["run", "p.toml", "--set", "run.world_size=4"])
            .args(sets.iter().flat_map(|s| ["--set", s]))
            .args(["--nnodes", "2", "--node-rank", &i.to_string(), "--master-addr", &master, "--master-port", &port])
            .args(["--out", &format!("node{i}")])
            .current_dir(dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let a = node(0, &[]);
    let b = node(1, &["train.lr=0.05", "wrap.model.hidden=[70]", "run.seed=9"]);
    for (i, o) in [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()].into_iter().enumerate() {
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "node {i}: {err}");
        assert!(err.contains("the nodes do not run the same configuration; every node refused to start"), "{err}");
        for line in [
            "train.lr: node 0: 0.",
            "node 1: 0.05",
            "wrap.model.hidden: node 0: [16], node 1: [70]",
            "run.seed: node 0: 3, node 1: 9",
        ] {
            assert!(err.contains(line), "node {i} does not name {line:?}:\n{err}");
        }
        assert!(!err.contains("[rank"), "node {i} started ranks:\n{err}");
        let run_dir = dir.path().join(format!("node{i}"));
        let manifest = std::fs::read_to_string(run_dir.join("manifest.json")).unwrap();
        assert!(manifest.contains("\"status\": \"failed\""), "{manifest}");
        assert!(!run_dir.join("trace.parquet").exists());
    }
}

/// 4 ranks over 2 hosts by default; at 2 ranks, gradient accumulation keeps the global batch.
/// 2000 rows at 4 × 8: 63 optimizer steps per epoch, a checkpoint every 5.
const ELASTIC: &str = r#"
[run]
name = "elastic"
seed = 5
world_size = 4
timeout_s = 30
abort_after_s = 2
max_restarts = 3
rejoin_timeout_s = 3

[load]
rows = 2000
features = 6
classes = 3
validation_rows = 100

[wrap.model]
hidden = [24]

[train]
epochs = 3
batch_size = 8
optimizer = "adam"
lr = 0.005

[checkpoint]
every_steps = 5
"#;

/// Every tensor of two `model.safetensors` within `tol`.
fn assert_models_close(a: &std::path::Path, b: &std::path::Path, tol: f64) {
    let read = |d: &std::path::Path| -> std::collections::BTreeMap<String, tch::Tensor> {
        tch::Tensor::read_safetensors(d.join("model.safetensors")).unwrap().into_iter().collect()
    };
    let (a, b) = (read(a), read(b));
    assert_eq!(a.len(), b.len());
    for ((name, x), (other, y)) in a.iter().zip(&b) {
        assert_eq!(name, other);
        let diff = (x - y).abs().max().double_value(&[]);
        assert!(diff <= tol, "{name} differs by {diff}");
    }
}

/// Rank 0's global training loss of every trace row.
fn rank0_losses(dir: &std::path::Path) -> Vec<f64> {
    let df = common::trace(dir);
    let rank0 = df.filter(&df.column("rank").unwrap().u32().unwrap().equal(0)).unwrap();
    rank0.column("global_train_loss").unwrap().f64().unwrap().into_no_null_iter().collect()
}

#[test]
fn an_elastic_run_goes_on_without_a_lost_host_and_takes_it_back_at_a_checkpoint() {
    let (_guard, ns, addr) = match two_hosts() {
        Ok(hosts) => hosts,
        Err(why) => {
            common::cannot_run("an_elastic_run_goes_on", &format!("cannot make network namespaces ({why})"));
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", ELASTIC);
    // The uninterrupted run: 4 ranks on this host.
    assert_ok(&common::run(&["run", "p.toml", "--out", "whole"], d));

    let (killed, resumed) = (d.join("killed.once"), d.join("b-is-back"));
    let node = |i: usize| {
        let stderr = std::fs::File::create(d.join(format!("node{i}.stderr"))).unwrap();
        Command::new("ip")
            .args(["netns", "exec", &ns[i], env!("CARGO_BIN_EXE_runner"), "run", "p.toml", "--out", "shared"])
            .args(["--nnodes", "1:2", "--node-rank", &i.to_string(), "--master-addr", &addr[0]])
            .args(["--master-port", "29500"])
            // Host b's rank 2 stops in step 12 (the launcher is killed there); at 2 ranks from
            // the checkpoint of step 10, rank 0 waits in step 12 (its batch 23) until host b is
            // back and waits to join.
            .env("RUNNER_TEST_STALL_AT", format!("2:train, epoch 1, step 12@{}", killed.display()))
            .env("RUNNER_TEST_WAIT_AT", format!("0:train, epoch 1, step 23@{}", resumed.display()))
            .current_dir(d)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap()
    };
    let wait = |what: &str, ready: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !ready() {
            let logs: String = (0..2)
                .map(|i| std::fs::read_to_string(d.join(format!("node{i}.stderr"))).unwrap_or_default())
                .collect();
            assert!(std::time::Instant::now() < deadline, "never saw {what}:\n{logs}");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    };
    let mut a = node(0);
    let mut b = node(1);
    wait("host b's rank 2 in step 12", &|| killed.exists());
    b.kill().unwrap();
    b.wait().unwrap();
    let manifest = || std::fs::read_to_string(d.join("shared/manifest.json")).unwrap_or_default();
    let at_two = || {
        let m: serde_json::Value = serde_json::from_str(&manifest()).unwrap_or_default();
        m["reshards"].as_array().is_some_and(|r| r.iter().any(|r| r["to"]["world_size"] == 2))
    };
    wait("host a going on alone", &at_two);
    let b_log = d.join("node1.stderr");
    std::fs::remove_file(&b_log).unwrap();
    let mut b = node(1);
    wait("host b waiting to join", &|| {
        std::fs::read_to_string(&b_log).unwrap_or_default().contains("waiting for round")
    });
    std::fs::write(&resumed, "").unwrap();
    let (a, b) = (a.wait().unwrap(), b.wait().unwrap());
    let logs: String =
        (0..2).map(|i| std::fs::read_to_string(d.join(format!("node{i}.stderr"))).unwrap_or_default()).collect();
    assert!(a.success() && b.success(), "{a} {b}:\n{logs}");

    let m: serde_json::Value = serde_json::from_str(&manifest()).unwrap();
    assert_eq!(m["status"], "complete", "{m:#}");
    let reshards = m["reshards"].as_array().unwrap();
    assert_eq!(reshards.len(), 2, "{m:#}");
    let size = |r: &serde_json::Value, k: &str| r[k]["world_size"].as_u64().unwrap();
    assert_eq!((size(&reshards[0], "from"), size(&reshards[0], "to")), (4, 2), "{m:#}");
    assert_eq!((size(&reshards[1], "from"), size(&reshards[1], "to")), (2, 4), "{m:#}");
    // Host b left in step 12: the run went on at 2 ranks from the checkpoint of step 10, and took
    // b back at a later checkpoint (every 5 steps) once it asked to join, in step 12 at the earliest.
    assert_eq!(reshards[0]["step"], 10, "{m:#}");
    let back = reshards[1]["step"].as_u64().unwrap();
    assert!(back.is_multiple_of(5) && back >= 15, "{m:#}");
    let (whole, shared) = (rank0_losses(&d.join("whole")), rank0_losses(&d.join("shared")));
    assert_eq!(whole.len(), shared.len());
    for (x, y) in whole.iter().zip(&shared) {
        assert!((x - y).abs() <= 1e-5, "losses {whole:?} and {shared:?}");
    }
    assert_models_close(&d.join("whole"), &d.join("shared"), 1e-5);
}

/// Issue 51: an elastic run started with fewer than MAX nodes (node 1 never comes) runs at the
/// smaller world size from its first round; its ranks once refused plan.json as edited.
#[test]
fn an_elastic_run_starts_below_max_nodes() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let o = common::run(
        &["run", "p.toml", "--set", "run.world_size=4", "--set", "run.timeout_s=2", "--out", "x"]
            .into_iter()
            .chain(["--nnodes", "1:2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", &port])
            .collect::<Vec<_>>(),
        dir.path(),
    );
    let (_, err) = text(&o);
    assert_ok(&o);
    assert!(err.contains("1 of 2 nodes: the run goes on at world size 2"), "{err}");
    let manifest = std::fs::read_to_string(dir.path().join("x/manifest.json")).unwrap();
    assert!(manifest.contains("\"status\": \"complete\""), "{manifest}");
}

/// Issue 51: a node of an elastic run started with another `--set` is refused with exit 2 on
/// every node, naming the key and each node's value, before any rank starts (node 0 once waited
/// and failed 41 s later; node 1 exited 1 naming only run ids).
#[test]
fn nodes_of_an_elastic_run_with_different_configurations_all_refuse_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let node = |rank: &str, lr: &str| {
        common::runner()
            .args(["run", "p.toml", "--set", "run.world_size=4", "--set", "run.timeout_s=10", "--out", "x"])
            .args(["--set", &format!("train.lr={lr}")])
            .args(["--nnodes", "1:2", "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port", &port])
            .current_dir(dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let started = std::time::Instant::now();
    let a = node("0", "0.01");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let b = node("1", "0.05");
    for (n, o) in [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()].iter().enumerate() {
        let (_, err) = text(o);
        assert_eq!(o.status.code(), Some(2), "node {n}: {err}");
        assert!(err.contains("the nodes do not run the same configuration"), "node {n}: {err}");
        assert!(err.contains("train.lr: node 0: 0.01, node 1: 0.05"), "node {n}: {err}");
    }
    assert!(started.elapsed().as_secs() < 10, "refused at once, not after the round's wait: {:?}", started.elapsed());
    assert!(!dir.path().join("x/trace.parquet").exists(), "no rank trained");
}
