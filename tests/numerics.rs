//! `run.numerics`: "portable" (the default, MKL_CBWR=COMPATIBLE in every rank) or "native" (MKL's
//! kernels for this CPU), chosen by the pipeline before libtorch computes, recorded in the
//! manifest; an MKL_CBWR in the environment wins.
mod common;

use common::*;
use std::path::Path;

fn mkl_cbwr(run_dir: &Path) -> String {
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("manifest.json")).unwrap()).unwrap();
    manifest["numerics"]["mkl_cbwr"].as_str().expect("the manifest records MKL_CBWR").to_owned()
}

#[test]
fn the_pipeline_chooses_portable_or_native_numerics_and_the_environment_wins() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "p.toml", TINY);
    let run_with = |out: &str, extra: &[&str], env: Option<&str>| {
        let mut cmd = runner();
        cmd.args(["run", "p.toml", "--out", out]).args(extra).current_dir(dir.path());
        match env {
            Some(v) => cmd.env("MKL_CBWR", v),
            None => cmd.env_remove("MKL_CBWR"),
        };
        let o = cmd.output().unwrap();
        assert_ok(&o);
        mkl_cbwr(&dir.path().join(out))
    };
    let native = ["--set", "run.numerics=\"native\""];

    // Two ranks: the launcher's setting reaches both.
    assert_eq!(run_with("portable", &[], None), "COMPATIBLE");
    assert_eq!(run_with("native", &native, None), "");
    assert_eq!(run_with("native-again", &native, None), "");
    assert_same_trace(&dir.path().join("native"), &dir.path().join("native-again"));
    // The environment's MKL_CBWR wins over the key, and is what the manifest records.
    assert_eq!(run_with("env", &native, Some("COMPATIBLE")), "COMPATIBLE");
    assert_same_trace(&dir.path().join("portable"), &dir.path().join("env"));

    // The plan says so; a value that is not one of the two is refused by name.
    let o = run(&["validate", "p.toml", "--set", "run.numerics=\"native\""], dir.path());
    assert_ok(&o);
    assert!(text(&o).0.contains("MKL's kernels for this CPU (run.numerics = \"native\")"), "{}", text(&o).0);
    assert!(!text(&run(&["validate", "p.toml"], dir.path())).0.contains("MKL's kernels"));
    let o = run(&["validate", "p.toml", "--set", "run.numerics=\"fast\""], dir.path());
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("run.numerics") && err.contains("portable") && err.contains("native"), "{err}");
}
