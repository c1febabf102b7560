//! Helpers for tests that run the real `runner` binary.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn runner() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_runner"));
    // The tests' own environment must not leak config values into the runs.
    for (k, _) in std::env::vars() {
        if k.starts_with("RUNNER_") || ["RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"].contains(&k.as_str()) {
            c.env_remove(k);
        }
    }
    c
}

pub fn run(args: &[&str], dir: &Path) -> Output {
    runner().args(args).current_dir(dir).output().expect("runner starts")
}

pub fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

pub fn assert_ok(o: &Output) {
    let (out, err) = text(o);
    assert!(o.status.success(), "runner failed ({}):\nstdout:\n{out}\nstderr:\n{err}", o.status);
}

/// A small, quick pipeline: 600 training rows × 5 features, 3 classes.
pub const TINY: &str = r#"
[run]
name = "tiny"
seed = 3
world_size = 2
timeout_s = 30

[load]
rows = 600
features = 5
classes = 3
validation_rows = 100

[wrap.model]
hidden = [16]

[train]
epochs = 2
batch_size = 16
"#;

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Spawning with captured output, for processes that must run at the same time.
pub trait OutputLater {
    fn output_later(&mut self) -> std::process::Child;
}

impl OutputLater for Command {
    fn output_later(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("runner starts")
    }
}
