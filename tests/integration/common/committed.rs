//! The committed sweeps' checks (results/NAME, made by experiments/NAME.toml): their tables
//! rebuild from their traces, and their points reproduce bit for bit here.
use std::path::Path;

use super::{assert_ok, run, text};

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The table lines (`| ... |`) of a markdown text, from the header on.
pub fn table_lines(md: &str) -> Vec<&str> {
    md.lines().skip_while(|l| !l.starts_with("| world size |")).take_while(|l| l.starts_with('|')).collect()
}

/// `runner report` rebuilds results/`name`'s table.md and table.csv from its traces alone, byte
/// for byte.
pub fn assert_reports_as_committed(name: &str) {
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("results").join(name);
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join(name);
    super::copy_tree(&committed, &copy);
    for f in ["table.md", "table.csv"] {
        std::fs::remove_file(copy.join(f)).unwrap();
    }
    assert_ok(&run(&["report", name], dir.path()));
    for f in ["table.md", "table.csv"] {
        assert_eq!(read(&copy.join(f)), read(&committed.join(f)), "{name}: {f}");
    }
}

/// `runner sweep experiments/`name`.toml --check` reruns its `points` and finds every non-timing
/// value of every trace identical, whatever kernels the environment asks for.
pub fn assert_reproduces(name: &str, points: usize) {
    let mut check = super::runner();
    let experiment = format!("experiments/{name}.toml");
    check.args(["sweep", experiment.as_str(), "--check"]).current_dir(env!("CARGO_MANIFEST_DIR"));
    for var in ["MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"] {
        check.env_remove(var);
    }
    let o = check.output().unwrap();
    assert_ok(&o);
    let out = text(&o).0;
    let said = format!("{points} points reproduce results/{name}: every non-timing value of every trace is identical.");
    assert!(out.contains(&said), "{out}");
}
