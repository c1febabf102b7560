//! The report's tables from hand-made measures: columns, numbers and targets.
use super::*;
use crate::bench::Cell;

#[test]
fn median_and_spread() {
    assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    assert_eq!(spread(&[1.0, 3.0, 2.0], 1), "2.0 (1.0–3.0)");
    assert_eq!(spread(&[1.234], 2), "1.23");
}

#[test]
fn results_replace_only_their_block() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("RESULTS.md");
    write(&path, "first\n").unwrap();
    let with_notes = std::fs::read_to_string(&path).unwrap() + "\n## Notes\nkept\n";
    std::fs::write(&path, with_notes).unwrap();
    write(&path, "second\n").unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("second") && !text.contains("first") && text.ends_with("## Notes\nkept\n"), "{text}");
}

#[test]
fn the_tables_have_the_kinds_columns_and_targets() {
    let m = |epoch_s, losses: Vec<f64>| Measure { wall_s: 2.0, epoch_s, samples: 1024.0, losses, peak_rss: vec![] };
    let cell = |ws| Cell {
        world_size: ws,
        threads: 2 / ws,
        runner: vec![m(1.0, vec![2.0, 1.0])],
        torch: vec![m(2.0, vec![2.0, 1.00001])],
        runner_portable: vec![m(1.25, vec![2.0, 1.000001])],
        runner_ddp: Vec::new(),
    };
    let results: Vec<WorkloadResult> = crate::bench::catalogue::all()
        .into_iter()
        .filter(|w| w.name == "cnn" || w.name == "transformer")
        .map(|w| WorkloadResult { workload: w, cells: vec![cell(1), cell(2)] })
        .collect();
    let machine = Machine {
        cpu: "test".into(),
        cores: 2,
        peak_flops: 1e12,
        peak_flops_bf16: 5e11,
        command: "runner bench".into(),
    };
    let text = markdown(&machine, 1, &results);
    assert!(text.contains("| epoch s PyTorch | images/s runner | images/s PyTorch | throughput ratio | peak runner |"));
    assert!(text
        .contains("| samples/s runner | samples/s PyTorch | tokens/s runner | tokens/s PyTorch | throughput ratio |"));
    // The transformer's windows are 64 tokens: 1024 samples/s are 65536 tokens/s.
    assert!(
        text.contains("| 1 | 2 | 2.00 | 2.00 | 1.000 | 1.000 | 2.000 | 1024 | 512 | 65536 | 32768 | 2.00 |"),
        "{text}"
    );
    assert!(text.contains("- ✓ cnn ws 2: throughput 2.00× PyTorch's (target ≥ 1.1×)"), "{text}");
    assert!(
        text.contains("- ✓ transformer ws 1: per-epoch losses within 1.0e-5 relative of PyTorch's (target ≤ 1e-5)"),
        "{text}"
    );
    assert!(text.contains("### Targets: 8 of 8 met"), "{text}");
    // The price of the same bits on every CPU: 1.25 s against 1.0 s per epoch.
    assert!(text.contains("| cnn | 2 | 1.000 | 1.250 | 1.250× | 1.0e-6 |"), "{text}");
}

/// A workload run in both precisions gets the bf16 section: each side's speed-up and the final
/// losses, against their targets; the bf16 rows' peak fraction is over the bfloat16 peak.
#[test]
fn bf16_is_compared_with_fp32_where_both_ran() {
    let m =
        |epoch_s, last| Measure { wall_s: 2.0, epoch_s, samples: 1024.0, losses: vec![2.0, last], peak_rss: vec![] };
    let cell = |runner: f64, torch: f64, last| Cell {
        world_size: 1,
        threads: 2,
        runner: vec![m(runner, last)],
        torch: vec![m(torch, last)],
        runner_portable: Vec::new(),
        runner_ddp: Vec::new(),
    };
    let w = crate::bench::catalogue::all().into_iter().find(|w| w.name == "compute-bound").unwrap();
    let results = vec![
        WorkloadResult { workload: w.clone().in_precision(false), cells: vec![cell(1.0, 1.2, 1.0)] },
        WorkloadResult { workload: w.in_precision(true), cells: vec![cell(0.8, 1.0, 1.01)] },
    ];
    let machine = Machine {
        cpu: "test".into(),
        cores: 2,
        peak_flops: 1e12,
        peak_flops_bf16: 5e11,
        command: "runner bench".into(),
    };
    let text = markdown(&machine, 1, &results);
    assert!(text.contains("| compute-bound | 1 | 1.25× | 1.20× | 1.0000 | 1.0100 | 1.0e-2 |"), "{text}");
    assert!(text.contains("- ✗ missed: compute-bound ws 1: bf16 1.25× fp32's throughput (target ≥ 1.5×"), "{text}");
    assert!(text.contains("- ✓ compute-bound ws 1: bf16's final loss within 1.00% of fp32's"), "{text}");
    // In bf16 the runner must beat PyTorch by 1.1× (1.25 here), with no float32 peak target.
    assert!(text.contains("- ✓ compute-bound bf16 ws 1: throughput 1.25× PyTorch's (target ≥ 1.1×)"), "{text}");
    assert!(!text.contains("compute-bound bf16 ws 1: 0"), "{text}");
    assert!(text.contains("0.50× float32: the most bf16 can gain here"), "{text}");
}

/// The FSDP2 workload's table: tokens/s, each rank's peak memory, the step against the
/// runner's own DDP step (a target at world size 2 only), and no numerics section.
#[test]
fn the_fsdp_workload_has_memory_and_the_ddp_step() {
    let mib = 1u64 << 20;
    let m = |epoch_s, peaks: [u64; 2], last| Measure {
        wall_s: 3.0,
        epoch_s,
        samples: 256.0,
        losses: vec![5.0, last],
        peak_rss: peaks.iter().map(|p| p * mib).collect(),
    };
    let cell = |ws| Cell {
        world_size: ws,
        threads: 1,
        runner: vec![m(1.0, [300, 310], 4.0), m(1.2, [302, 308], 4.0)],
        torch: vec![m(2.0, [700, 690], 4.00001), m(2.2, [700, 690], 4.00001)],
        runner_portable: Vec::new(),
        runner_ddp: vec![m(0.8, [340, 350], 4.0), m(1.0, [340, 350], 4.0)],
    };
    let w = crate::bench::catalogue::all().into_iter().find(|w| w.name == "fsdp").unwrap();
    let results = vec![WorkloadResult { workload: w, cells: vec![cell(2), cell(4)] }];
    let machine = Machine {
        cpu: "test".into(),
        cores: 2,
        peak_flops: 1e12,
        peak_flops_bf16: f64::NAN,
        command: "runner bench --workload fsdp".into(),
    };
    let text = markdown(&machine, 2, &results);
    // 256 windows of 64 tokens per epoch: 16384 tokens in 1.1 s (median); 16 steps of 8 at 2 ranks.
    assert!(
        text.contains(
            "| 2 | 1 | 15019 (13653–16384) | 7820 (7447–8192) | 1.92 | 301 / 309 | 700 / 690 | 0.44 | \
             68.8 (62.5–75.0) | 56.2 (50.0–62.5) | 1.22 | 2.5e-6 | 0.0e0 |"
        ),
        "{text}"
    );
    assert!(text.contains("| 4 | 1 | 15019 (13653–16384) |"), "{text}");
    assert!(text.contains("- ✓ fsdp ws 2: throughput 1.92× FSDP2's (target ≥ 1.2×)"), "{text}");
    assert!(text.contains("- ✓ fsdp ws 4: largest per-rank peak memory 0.44× FSDP2's (target ≤ 1×)"), "{text}");
    assert!(text.contains("- ✓ fsdp ws 2: step 1.22× the runner's own DDP step (target ≤ 1.3×)"), "{text}");
    assert!(!text.contains("fsdp ws 4: step"), "the DDP step's target is at world size 2: {text}");
    assert!(text.contains("- ✓ fsdp ws 4: per-epoch losses within 2.5e-6 relative of FSDP2's"), "{text}");
    assert!(text.contains("### Targets: 9 of 9 met"), "{text}");
    assert!(!text.contains("The cost of reproducible numerics"), "{text}");
}

#[test]
fn loss_difference_is_relative_and_catches_missing_epochs() {
    let m = |losses: Vec<f64>| Measure { wall_s: 1.0, epoch_s: 1.0, samples: 1.0, losses, peak_rss: vec![] };
    assert!((loss_difference(&[m(vec![1.0, 0.5])], &[m(vec![1.0, 0.5001])]) - 1e-4 / 0.5001).abs() < 1e-12);
    assert_eq!(loss_difference(&[m(vec![1.0])], &[m(vec![1.0, 0.5])]), f64::INFINITY);
}
