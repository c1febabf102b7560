//! Multi-node runs for real: two network namespaces joined by a veth pair act as two hosts with
//! two ranks each. Needs root and iproute2: without them the test fails under `CI=true` and
//! elsewhere prints a loud SKIPPED line. Every test names its namespaces and links uniquely
//! (process id and a counter), so the tests run in parallel.
mod common;

use std::process::{Command, Stdio};

use common::{assert_ok, text, write, TINY};
use polars::prelude::*;

struct Namespaces(Vec<String>);

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
fn two_hosts() -> Result<(Namespaces, [String; 2], [String; 2]), String> {
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
