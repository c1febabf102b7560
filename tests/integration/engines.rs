//! The engines' contracts: Kubeflow Trainer's TrainJob (`PET_*`) and SkyPilot (`SKYPILOT_*`)
//! start one `runner run` per node with only their variables, and the run is the one the
//! `--nnodes` launcher gives. Two hosts are two network namespaces, as in `multinode.rs`.
use crate::common;

use std::process::{Command, Output, Stdio};

use common::{assert_ok, text, write, TINY};

/// `runner run p.toml --out OUT ARGS` on host `ns` with exactly the variables `vars` (the
/// engine's; nothing of this process's environment).
fn on_host(ns: &str, dir: &std::path::Path, out: &str, args: &[&str], vars: &[(&str, String)]) -> std::process::Child {
    Command::new("ip")
        .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_runner"), "run", "p.toml", "--set", "run.world_size=4"])
        .args(["--out", out])
        .args(args)
        .env_clear()
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn both(a: std::process::Child, b: std::process::Child) -> (Output, Output) {
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert_ok(&a);
    assert_ok(&b);
    (a, b)
}

#[test]
fn trainjob_and_skypilot_variables_alone_start_the_run_the_nnodes_launcher_gives() {
    let (_guard, ns, addr) = match crate::multinode::two_hosts() {
        Ok(hosts) => hosts,
        Err(why) => {
            let test = "trainjob_and_skypilot_variables_alone_start_the_run_the_nnodes_launcher_gives";
            common::cannot_run(test, &format!("cannot make network namespaces ({why})"));
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let d = dir.path();
    // The oracle: the launcher's flags.
    let flags = |i: usize| {
        let rank = i.to_string();
        let args = ["--nnodes", "2", "--node-rank", &rank, "--master-addr", &addr[0], "--master-port", "29510"];
        on_host(&ns[i], d, &format!("flags{i}"), &args, &[])
    };
    both(flags(0), flags(1));
    // Kubeflow Trainer's TrainJob: torchrun's PET_* variables, as its torch plugin sets them.
    let trainjob = |i: usize| {
        let vars = [
            ("PET_NNODES", "2".to_owned()),
            ("PET_NPROC_PER_NODE", "2".to_owned()),
            ("PET_NODE_RANK", i.to_string()),
            ("PET_MASTER_ADDR", addr[0].clone()),
            ("PET_MASTER_PORT", "29511".to_owned()),
        ];
        on_host(&ns[i], d, &format!("trainjob{i}"), &[], &vars)
    };
    let (node0, _) = both(trainjob(0), trainjob(1));
    let (out, _) = text(&node0);
    assert!(
        out.contains(&format!(
            "nodes: 2 × 2 ranks, this is node 0; node 0 at {}:29511, from Kubeflow TrainJob (PET_NNODES=2, \
             PET_NODE_RANK=0, PET_MASTER_ADDR={}, PET_MASTER_PORT=29511, PET_NPROC_PER_NODE=2)",
            addr[0], addr[0]
        )),
        "{out}"
    );
    // SkyPilot: every node gets the node list, node 0 first.
    let skypilot = |i: usize| {
        let vars = [
            ("SKYPILOT_NODE_IPS", format!("{}\n{}\n", addr[0], addr[1])),
            ("SKYPILOT_NUM_NODES", "2".to_owned()),
            ("SKYPILOT_NODE_RANK", i.to_string()),
            ("SKYPILOT_NUM_GPUS_PER_NODE", "0".to_owned()),
        ];
        on_host(&ns[i], d, &format!("skypilot{i}"), &["--master-port", "29512"], &vars)
    };
    let (node0, _) = both(skypilot(0), skypilot(1));
    assert!(text(&node0).0.contains("from SkyPilot (SKYPILOT_NUM_NODES=2, SKYPILOT_NODE_RANK=0"), "{}", text(&node0).0);
    // The same run: the same model, bit for bit.
    let model = |run: &str| std::fs::read(d.join(run).join("model.safetensors")).unwrap();
    assert_eq!(model("trainjob0"), model("flags0"), "TrainJob's run is the --nnodes launcher's");
    assert_eq!(model("skypilot0"), model("flags0"), "SkyPilot's run is the --nnodes launcher's");
}

#[test]
fn contradicting_engines_and_a_world_size_the_engine_does_not_start_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let refused = |vars: &[(&str, &str)], sets: &[&str]| -> String {
        let mut c = common::runner();
        c.args(["run", "p.toml", "--out", "o"]).current_dir(dir.path());
        for s in sets {
            c.args(["--set", s]);
        }
        let out = c.envs(vars.iter().copied()).output().unwrap();
        let (_, err) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(!dir.path().join("o/manifest.json").exists(), "a refused run writes nothing");
        err
    };
    let err = refused(&[("PET_NNODES", "2"), ("SLURM_NNODES", "3")], &[]);
    assert!(err.contains("the engines disagree: SLURM_NNODES=3 but PET_NNODES=2"), "{err}");
    let err = refused(
        &[("PET_NNODES", "2"), ("PET_NPROC_PER_NODE", "2"), ("PET_MASTER_ADDR", "127.0.0.1")],
        &["run.world_size=3"],
    );
    assert!(
        err.contains("PET_NPROC_PER_NODE=2 over PET_NNODES=2 nodes starts 4 ranks, but run.world_size is 3"),
        "{err}"
    );
    let err =
        refused(&[("SKYPILOT_NUM_NODES", "2"), ("SKYPILOT_NODE_IPS", "10.0.0.1"), ("SKYPILOT_NODE_RANK", "0")], &[]);
    assert!(err.contains("SKYPILOT_NODE_IPS lists 1 address but SKYPILOT_NUM_NODES=2"), "{err}");
}

#[test]
fn a_trainjob_node_whose_master_never_answers_fails_within_the_timeout_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let started = std::time::Instant::now();
    let out = common::runner()
        .args(["run", "p.toml", "--out", "o", "--set", "run.world_size=4", "--set", "run.timeout_s=2"])
        .envs([("PET_NNODES", "2"), ("PET_NODE_RANK", "1"), ("PET_MASTER_ADDR", "127.0.0.1")])
        .env("PET_MASTER_PORT", port.to_string())
        .current_dir(dir.path())
        .output()
        .unwrap();
    let (_, err) = text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "the message names the master: {err}");
    assert!(started.elapsed().as_secs() < 20, "took {:?}: {err}", started.elapsed());
}
