//! Hostile input: configurations, environments and files that once reached a panic, an abort,
//! a hang or an out-of-memory kill. Each must get a clear message and an exit code that is not
//! 0, not 101 (a panic) and not a signal, from `runner validate` and from `runner run`.
use crate::common;

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use common::{runner, text, write, TINY};

/// TINY with `key = value` put in `section` (replacing the key where TINY sets it).
fn with(section: &str, key: &str, value: &str) -> String {
    let mut out = String::new();
    let mut current = String::new();
    let mut placed = false;
    for line in TINY.lines() {
        if line.starts_with('[') {
            if current == section && !placed {
                out += &format!("{key} = {value}\n");
                placed = true;
            }
            current = line.trim_matches(['[', ']']).to_owned();
        }
        if current == section && line.split('=').next().is_some_and(|k| k.trim() == key) {
            continue;
        }
        out += line;
        out += "\n";
    }
    if !placed {
        if current != section {
            out += &format!("[{section}]\n");
        }
        out += &format!("{key} = {value}\n");
    }
    out
}

/// Waits for `child` at most `bound`; a hang fails the test (and kills the child).
fn wait(mut child: Child, bound: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > bound {
            let _ = child.kill();
            panic!("runner hung for {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Runs `runner <args>` in `dir` with `env`, and checks the refusal.
fn refused(dir: &Path, args: &[&str], env: &[(&str, &str)], expect: &str, case: &str) {
    let child = runner()
        .args(args)
        .envs(env.iter().copied())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait(child, Duration::from_secs(30));
    let (stdout, stderr) = text(&out);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), None, "{case}: killed by a signal\n{stderr}");
    let code = out.status.code().unwrap();
    assert!(code != 0 && code != 101, "{case}: `runner {}` exited {code}\n{stdout}\n{stderr}", args.join(" "));
    assert!(!stderr.contains("panicked"), "{case}: a panic\n{stderr}");
    assert!(stderr.contains(expect), "{case}: the message does not say {expect:?}:\n{stderr}");
}

#[test]
fn every_hostile_configuration_is_refused_by_validate_and_run_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: Vec<(&str, String, &str)> = vec![
        ("timeout inf", with("run", "timeout_s", "inf"), "`run.timeout_s`"),
        ("timeout 1.8e19", with("run", "timeout_s", "1.8e19"), "`run.timeout_s`"),
        ("timeout 1e19", with("run", "timeout_s", "1e19"), "`run.timeout_s`"),
        ("timeout 1e-300", with("run", "timeout_s", "1e-300"), "`run.timeout_s`"),
        ("timeout nan", with("run", "timeout_s", "nan"), "`run.timeout_s`"),
        ("abort_after inf", with("run", "abort_after_s", "inf"), "`run.abort_after_s`"),
        ("abort_after 1e19", with("run", "abort_after_s", "1e19"), "`run.abort_after_s`"),
        ("abort_after negative", with("run", "abort_after_s", "-1.0"), "`run.abort_after_s`"),
        ("world size 1e9", with("run", "world_size", "1000000000"), "`run.world_size`"),
        ("epochs 1e12", with("train", "epochs", "1000000000000"), "`train.epochs`"),
        ("rows 1e15", with("load", "rows", "1000000000000000"), "`load.rows`"),
        ("rows 1e11", with("load", "rows", "100000000000"), "GiB available"),
        ("features 1e9", with("load", "features", "1000000000"), "`load.features`"),
        (
            "features 1.6e7 × 1e5 rows",
            with("load", "features", "16000000").replace("rows = 600", "rows = 100000"),
            "GiB available",
        ),
        ("classes 1e9", with("load", "classes", "1000000000"), "`load.classes`"),
        ("hidden 1e9", with("wrap.model", "hidden", "[1000000000]"), "`wrap.model.hidden`"),
        ("hidden 2 × 1e6", with("wrap.model", "hidden", "[1000000, 1000000]"), "GiB available"),
        ("bucket cap inf", with("wrap", "bucket_cap_mb", "inf"), "`wrap.bucket_cap_mb`"),
        ("noise inf", with("load", "noise", "inf"), "`load.noise`"),
    ];
    for (case, toml, expect) in &cases {
        write(d, "p.toml", toml);
        refused(d, &["validate", "p.toml"], &[], expect, case);
        refused(d, &["run", "p.toml", "--out", "o"], &[], expect, case);
    }
}

#[test]
fn pipeline_files_that_are_not_regular_or_too_large_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("a-directory")).unwrap();
    nix::unistd::mkfifo(&d.join("fifo.toml"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    let big = d.join("big.toml");
    std::fs::File::create(&big).unwrap().set_len(5 << 20).unwrap();
    for (file, expect) in [
        ("/dev/zero", "is a device"),
        ("fifo.toml", "is a FIFO"),
        ("a-directory", "is a directory"),
        ("big.toml", "more than the 4 MiB"),
    ] {
        refused(d, &["validate", file], &[], expect, file);
        refused(d, &["run", file, "--out", "o"], &[], expect, file);
    }
    refused(d, &["sweep", "/dev/zero"], &[], "is a device", "experiment /dev/zero");
}

#[test]
fn data_and_weight_files_that_are_not_regular_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    nix::unistd::mkfifo(&d.join("fifo.csv"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    std::fs::create_dir(d.join("dir.csv")).unwrap();
    let data = |path: &str| {
        TINY.replace(
            "rows = 600\nfeatures = 5\nclasses = 3\n",
            &format!("source = \"csv\"\npath = \"{path}\"\ntarget = \"y\"\n"),
        )
    };
    for (path, expect) in [("/dev/zero", "is a device"), ("fifo.csv", "is a FIFO"), ("dir.csv", "is a directory")] {
        write(d, "p.toml", &data(path));
        refused(d, &["validate", "p.toml"], &[], expect, path);
        refused(d, &["run", "p.toml", "--out", "o"], &[], expect, path);
    }
    // Initial weights: a FIFO, and a file holding a NaN.
    write(d, "p.toml", &with("wrap", "init", "\"fifo.safetensors\""));
    nix::unistd::mkfifo(&d.join("fifo.safetensors"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    refused(d, &["validate", "p.toml"], &[], "is a FIFO", "init FIFO");
    use tch::{Kind, Tensor};
    let shapes: [(&str, &[i64]); 4] =
        [("layer0.weight", &[16, 5]), ("layer0.bias", &[16]), ("layer1.weight", &[3, 16]), ("layer1.bias", &[3])];
    let named: Vec<(String, Tensor)> =
        shapes.iter().map(|(n, s)| (n.to_string(), Tensor::zeros(*s, (Kind::Float, tch::Device::Cpu)))).collect();
    let _ = named[2].1.get(0).get(0).fill_(f64::NAN);
    Tensor::write_safetensors(&named, d.join("nan.safetensors")).unwrap();
    write(d, "p.toml", &with("wrap", "init", "\"nan.safetensors\""));
    refused(d, &["validate", "p.toml"], &[], "`layer1.weight` holds 1 NaN or infinite values", "init NaN");
    refused(d, &["run", "p.toml", "--out", "o"], &[], "NaN or infinite", "init NaN");
}

#[test]
fn rank_variables_out_of_range_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(d, "p.toml", TINY);
    let base = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")];
    let cases: [(&[(&str, &str)], &str); 5] = [
        (&[("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")], "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
        (&[("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "3")], "LOCAL_WORLD_SIZE=3 must be between 1 and WORLD_SIZE=2"),
        (&[("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "0")], "LOCAL_WORLD_SIZE=0"),
        (&[("LOCAL_RANK", "-1")], "LOCAL_RANK=\"-1\" is not a number"),
        (&[("MASTER_PORT", "70000")], "MASTER_PORT=\"70000\" is not a port number"),
    ];
    for (extra, expect) in cases {
        let mut env: Vec<(&str, &str)> = base.to_vec();
        env.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
        env.extend_from_slice(extra);
        refused(d, &["run", "p.toml", "--out", "o"], &env, expect, expect);
    }
    let env = [("RANK", "0"), ("WORLD_SIZE", "0"), ("MASTER_PORT", "1")];
    refused(d, &["run", "p.toml", "--out", "o"], &env, "RANK=0 is not below WORLD_SIZE=0", "WORLD_SIZE=0");
}
