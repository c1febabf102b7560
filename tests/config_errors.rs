//! Snapshot tests of what a user sees for bad configurations: the exact message on stderr, exit
//! code 2, and nothing written. Each runs the real binary (`runner validate` and `runner run`).
mod common;

use common::{runner, text, write, TINY};

struct Case {
    name: &'static str,
    /// Appended to the TINY pipeline (later keys in a table override nothing: TOML forbids
    /// duplicates, so cases add new keys or new tables).
    file: &'static str,
    args: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
    expected: &'static str,
}

const CASES: &[Case] = &[Case {
    name: "misspelled key",
    file: "[validate]\nevry = 2\n",
    args: &[],
    env: &[],
    expected: "EXPECTED",
}];

fn check(case: &Case, command: &str) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", &format!("{TINY}{}", case.file));
    write(
        dir.path(),
        "labels.csv",
        "a,b,label,name\n1,2,0,x\n3,4,1,y\n5,6,2,z\n",
    );
    let mut cmd = runner();
    cmd.current_dir(dir.path())
        .args([command, "p.toml"])
        .args(case.args);
    for (k, v) in case.env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}: expected exit code 2\nstdout:\n{stdout}\nstderr:\n{stderr}",
        case.name
    );
    assert_eq!(
        stderr.trim_end(),
        case.expected,
        "{}: the message changed",
        case.name
    );
    assert!(
        !dir.path().join("results").exists(),
        "{}: a rejected config wrote results",
        case.name
    );
}

#[test]
fn bad_configurations_are_explained_by_validate() {
    for case in CASES {
        check(case, "validate");
    }
}

#[test]
fn bad_configurations_are_refused_by_run_before_any_rank_starts() {
    for case in CASES {
        check(case, "run");
    }
}

#[test]
fn a_missing_pipeline_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = runner()
        .current_dir(dir.path())
        .args(["validate", "nope.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out).1.trim_end(),
        "error: cannot read the pipeline file nope.toml: No such file or directory (os error 2)"
    );
}
