//! The GPU check (scripts/gpu_check.py, docs/gpus.md) in its `--cpu` mode with this build's
//! runner: the script that runs on a lent GPU machine is tested where no GPU is, so that it does
//! not rot between the rare times one is lent. The perf section runs its tiny shapes at one batch
//! size, `torch.compile` with dynamo's eager backend (inductor's C++ takes half a minute a point).
use crate::common;

use std::process::Command;

#[test]
fn the_gpu_check_runs_its_sections_on_the_cpu_and_writes_its_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    // The shared section (two launchers) is left to `scripts/gpu-bundle.sh --tests`, which runs
    // every section on the CPU before a GPU is used: here it would add a third to the time.
    let sections = ["env", "fsdp", "gpt2", "perf"];
    let o = Command::new(common::reference_python())
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu_check.py"))
        .args(["--runner", env!("CARGO_BIN_EXE_runner"), "--cpu", "--only", &sections.join(",")])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let report = std::fs::read_to_string(out.join("report.md")).unwrap_or_default();
    assert!(o.status.success(), "{}\n{report}\n{}", common::text(&o).0, common::text(&o).1);
    for section in sections {
        assert!(report.contains(&format!("## {section}\n")), "no section {section}:\n{report}");
    }
    assert_eq!(report.matches("**PASS**").count(), sections.len(), "{report}");
    assert!(report.contains("all sections passed"), "{report}");
    // Each comparison printed its epochs, and the throughput table has both sides.
    assert!(report.contains("| 5 | "), "{report}");
    assert!(report.contains("runner ÷ PyTorch tokens/s"), "{report}");
    // The perf section: each batch's runner, eager and compiled rows, the plan's GPU estimate
    // (`runner validate --device cuda`), and the ratios.
    for batch in [4] {
        for who in ["runner", "PyTorch eager", "torch.compile"] {
            assert!(report.contains(&format!("| {batch} | {who}")), "no {who} row at batch {batch}:\n{report}");
        }
        assert!(report.contains(&format!("- batch {batch}: runner ÷ eager ")), "{report}");
    }
    // CUDA graphs replay CUDA kernels: on the CPU the plan refuses them by name, which the check checks.
    assert!(report.contains("CUDA graphs: refused on the CPU by the plan"), "{report}");
    // The runner's row ends with the plan's two GPU estimates (`runner validate --device cuda`).
    let row = report.lines().find(|l| l.starts_with("| 4 | runner |")).unwrap_or_default();
    assert_eq!(row.matches(" MiB |").count(), 2, "{row}\n{report}");
}
