//! One run directory over several nodes (issue 51): node 0 owns it. Both hosts' launchers given
//! one folder as `--out` (the Slurm recipe on a shared file system) run one run there, which a
//! rerun refuses and `--resume` extends as on a single node; a node whose own `--out` holds
//! another run refuses the run on every node.
use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::common::{self, assert_ok, text, write, TINY};

/// Both nodes of a 2 × 2 run, each in its namespace (`ns`), node 0 at `master`, with `args`
/// after `runner run`; their outputs, node 0's first.
fn both_nodes(ns: &[String; 2], master: &str, d: &Path, args: &[&str]) -> [Output; 2] {
    let node = |i: usize| {
        Command::new("ip")
            .args(["netns", "exec", &ns[i], env!("CARGO_BIN_EXE_runner"), "run"])
            .args(args)
            .args(["--nnodes", "2", "--node-rank", &i.to_string(), "--master-addr", master, "--master-port", "29500"])
            .current_dir(d)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (node(0), node(1));
    [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()]
}

fn manifest(d: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(d.join("shared/manifest.json")).unwrap()).unwrap()
}

/// The trace's ranks, row by row.
fn ranks(d: &Path) -> Vec<u32> {
    common::trace(&d.join("shared")).column("rank").unwrap().u32().unwrap().into_no_null_iter().collect()
}

#[test]
fn two_hosts_run_one_run_in_one_shared_run_directory() {
    let (_guard, ns, addr) = match super::two_hosts() {
        Ok(hosts) => hosts,
        Err(why) => {
            common::cannot_run(
                "two_hosts_run_one_run_in_one_shared",
                &format!("cannot make network namespaces ({why})"),
            );
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    // Sharded: each rank writes its own piece of each checkpoint.
    let fresh = ["p.toml", "--set", "run.world_size=4", "--set", "wrap.strategy=\"fsdp\""]
        .into_iter()
        .chain(["--set", "checkpoint.every=1", "--out", "shared"])
        .collect::<Vec<_>>();
    let [a, b] = both_nodes(&ns, &addr[0], d, &fresh);
    assert_ok(&a);
    assert_ok(&b);
    assert!(text(&b).0.contains("run directory: shared (node 0's: it records the run)"), "{}", text(&b).0);
    let m = manifest(d);
    assert_eq!(m["status"], "complete", "{m:#}");
    assert_eq!(ranks(d), [0, 1, 2, 3, 0, 1, 2, 3], "one row per rank per epoch, from both hosts");
    // Host b's ranks wrote their own pieces of each checkpoint; rank 0 its index.
    assert!(d.join("shared/checkpoints/epoch-0002/index.json").is_file());
    for r in 0..4 {
        assert!(d.join(format!("shared/checkpoints/epoch-0002/rank-{r}.safetensors")).is_file(), "rank {r}");
    }
    let left: Vec<String> = std::fs::read_dir(d.join("shared"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n != ".runner.lock")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    // Again: the complete run is kept, as on a single node; every node refuses with exit 2.
    let before = std::fs::read_to_string(d.join("shared/manifest.json")).unwrap();
    for (i, o) in both_nodes(&ns, &addr[0], d, &fresh).iter().enumerate() {
        let (_, err) = text(o);
        assert_eq!(o.status.code(), Some(2), "node {i}: {err}");
        assert!(err.contains("shared holds this configuration's complete run"), "node {i}: {err}");
        assert!(i == 0 || err.contains("node 1: node 0 refused to start the run"), "node {i}: {err}");
    }
    assert_eq!(std::fs::read_to_string(d.join("shared/manifest.json")).unwrap(), before);

    // Extended with --resume: both nodes go on in it from its last checkpoint.
    let [a, b] = both_nodes(&ns, &addr[0], d, &["--resume", "shared", "--set", "train.epochs=3"]);
    assert_ok(&a);
    assert_ok(&b);
    let m = manifest(d);
    assert_eq!(m["status"], "complete", "{m:#}");
    assert_eq!(ranks(d), [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]);
    assert!(std::fs::read_to_string(d.join("shared/config.toml")).unwrap().contains("epochs = 3"));
}

/// Issue 51 (item 2): each node's own `--out` (a local disk) is allowed; one that holds another
/// run refuses the run on every node at once, naming the node and why (node 0 once waited and
/// failed after run.timeout_s, saying only that node 1 never joined).
#[test]
fn a_node_whose_own_run_directory_holds_another_run_refuses_the_run_on_every_node() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    assert_ok(&common::run(&["run", "p.toml", "--set", "train.epochs=1", "--out", "other"], d));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let node = |i: usize, out: &str| {
        common::runner()
            .args(["run", "p.toml", "--set", "run.world_size=4", "--set", "run.timeout_s=20", "--out", out])
            .args([
                "--nnodes",
                "2",
                "--node-rank",
                &i.to_string(),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
            ])
            .current_dir(d)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let started = std::time::Instant::now();
    let (a, b) = (node(0, "mine"), node(1, "other"));
    for (i, o) in [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()].iter().enumerate() {
        let (_, err) = text(o);
        assert_eq!(o.status.code(), Some(2), "node {i}: {err}");
        assert!(err.contains("--out other is not this run's directory: it holds run "), "node {i}: {err}");
        if i == 0 {
            assert!(
                err.contains("a node cannot start, so every node refused to start:\n  node 1: --out other"),
                "{err}"
            );
        }
        assert!(!err.contains("[rank"), "node {i} started ranks:\n{err}");
    }
    assert!(started.elapsed().as_secs() < 20, "refused at once, not after run.timeout_s: {:?}", started.elapsed());
    assert!(!d.join("mine/trace.parquet").exists(), "no rank trained");
    let other = std::fs::read_to_string(d.join("other/manifest.json")).unwrap();
    assert!(other.contains("\"status\": \"complete\""), "the other run is kept: {other}");
}

/// Each node's own `--out` cannot hold a checkpoint (rank 0 writes its index beside every rank's
/// pieces, and every rank reads them to resume): refused on every node before any rank starts,
/// naming the setting (the run once trained its first epoch and failed writing the checkpoint).
#[test]
fn checkpoints_in_each_nodes_own_run_directory_are_refused_on_every_node() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let node = |i: usize| {
        common::runner()
            .args(["run", "p.toml", "--set", "run.world_size=4", "--set", "checkpoint.every=1"])
            .args(["--set", "wrap.strategy=\"fsdp\"", "--out", &format!("node{i}")])
            .args([
                "--nnodes",
                "2",
                "--node-rank",
                &i.to_string(),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
            ])
            .current_dir(d)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (node(0), node(1));
    for (i, o) in [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()].iter().enumerate() {
        let (_, err) = text(o);
        assert_eq!(o.status.code(), Some(2), "node {i}: {err}");
        let why = "--out node1 is not node 0's run directory, and the run writes checkpoints (checkpoint.every = 1)";
        assert!(err.contains(why), "node {i}: {err}");
        assert!(!err.contains("[rank"), "node {i} started ranks:\n{err}");
    }
    assert!(!d.join("node1").exists(), "node 1 took no directory");
}

/// An elastic run needs one run directory every node sees (every rank reads the checkpoints): a
/// node given another `--out` is refused with exit 2 before it joins a round, and node 0 goes on
/// without it (it once joined, then failed with exit 1, and the round it joined failed too).
#[test]
fn a_node_of_an_elastic_run_with_another_run_directory_is_refused_before_it_joins() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let node = |i: usize, out: &str| {
        common::runner()
            .args(["run", "p.toml", "--set", "run.world_size=4", "--set", "run.timeout_s=3", "--out", out])
            .args([
                "--nnodes",
                "1:2",
                "--node-rank",
                &i.to_string(),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
            ])
            .current_dir(d)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let a = node(0, "a");
    let b = node(1, "b").wait_with_output().unwrap();
    let (_, err) = text(&b);
    assert_eq!(b.status.code(), Some(2), "{err}");
    assert!(err.contains("node 1: --out b is not node 0's run directory: an elastic or restarted run"), "{err}");
    assert!(!err.contains("[rank"), "node 1 started ranks:\n{err}");
    let a = a.wait_with_output().unwrap();
    assert_ok(&a);
    assert!(text(&a).1.contains("1 of 2 nodes: the run goes on at world size 2"), "{}", text(&a).1);
    assert!(!d.join("b/manifest.json").exists(), "node 1 wrote nothing");
}
