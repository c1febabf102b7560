//! The runner against itself: portable numerics against native, bf16 against fp32.
use std::fmt::Write as _;

use super::{epoch, loss_difference, median, spread, throughput, Target};
use crate::bench::{Measure, WorkloadResult};

/// What the same bits on every CPU cost: the runner with `run.numerics = "portable"`
/// (every kernel family pinned) against the runner as it runs by default, in epoch time, and how far
/// apart their losses end.
pub(super) fn numerics_cost(s: &mut String, results: &[WorkloadResult]) {
    if results.iter().all(|r| r.cells.iter().all(|c| c.runner_portable.is_empty())) {
        return;
    }
    let _ = writeln!(
        s,
        "### The cost of reproducible numerics\n\n\
         The runner computes with this CPU's own kernels by default (`run.numerics = \"native\"`), as PyTorch \
         does above. `run.numerics = \"portable\"` (MKL's COMPATIBLE branch, ATen's AVX2 kernels, oneDNN off) gives \
         the same bits on any x86-64 CPU with AVX2, \
         for results committed and checked on other machines. Here the runner runs both ways, alternating with the \
         runs above. Cost: portable epoch time over native epoch time (medians). Loss difference: the largest \
         relative difference of their per-epoch losses.\n\n\
         | workload | world size | epoch s, native | epoch s, portable | cost | loss rel. difference |\n\
         |---|---:|---:|---:|---:|---:|"
    );
    for r in results {
        for c in r.cells.iter().filter(|c| !c.runner_portable.is_empty()) {
            let cost = median(&epoch(&c.runner_portable)) / median(&epoch(&c.runner));
            let diff = loss_difference(&c.runner_portable, &c.runner);
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {cost:.3}× | {diff:.1e} |",
                r.workload.label(),
                c.world_size,
                spread(&epoch(&c.runner), 3),
                spread(&epoch(&c.runner_portable), 3)
            );
        }
    }
    let _ = writeln!(s);
}

/// bf16 against fp32, where a workload ran in both: each side's speed-up and the runner's final
/// loss in each, with their targets (≥ 1.5× the throughput, the final loss within 2%).
pub(super) fn comparison(s: &mut String, results: &[WorkloadResult], targets: &mut Vec<Target>) {
    const SPEEDUP: f64 = 1.5;
    const LOSS: f64 = 0.02;
    let pairs: Vec<(&WorkloadResult, &WorkloadResult)> = results
        .iter()
        .filter(|r| r.workload.bf16)
        .filter_map(|b| results.iter().find(|f| !f.workload.bf16 && f.workload.name == b.workload.name).map(|f| (f, b)))
        .collect();
    if pairs.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "### bf16 against fp32\n\nSpeed-up: bf16 throughput over fp32 throughput (medians), on each side. Final loss: \
         the runner's last epoch, median over the repetitions.\n\n\
         | workload | world size | speed-up runner | speed-up PyTorch | final loss fp32 | final loss bf16 | loss rel. difference |\n\
         |---|---:|---:|---:|---:|---:|---:|"
    );
    let final_loss = |m: &[Measure]| median(&m.iter().filter_map(|m| m.losses.last().copied()).collect::<Vec<_>>());
    for (fp32, bf16) in pairs {
        for (f, b) in fp32.cells.iter().zip(&bf16.cells).filter(|(f, b)| f.world_size == b.world_size) {
            let ws = f.world_size;
            let speedup = |fm: &[Measure], bm: &[Measure]| median(&throughput(bm)) / median(&throughput(fm));
            let (runner, torch) = (speedup(&f.runner, &b.runner), speedup(&f.torch, &b.torch));
            let (lf, lb) = (final_loss(&f.runner), final_loss(&b.runner));
            let diff = (lb - lf).abs() / lf.abs().max(f64::MIN_POSITIVE);
            let name = fp32.workload.name;
            let _ = writeln!(s, "| {name} | {ws} | {runner:.2}× | {torch:.2}× | {lf:.4} | {lb:.4} | {diff:.1e} |");
            targets.push(Target {
                what: format!(
                    "{name} ws {ws}: bf16 {runner:.2}× fp32's throughput (target ≥ {SPEEDUP}×; PyTorch: {torch:.2}×)"
                ),
                met: runner >= SPEEDUP,
            });
            targets.push(Target {
                what: format!(
                    "{name} ws {ws}: bf16's final loss within {:.2}% of fp32's (target ≤ {}%)",
                    100.0 * diff,
                    100.0 * LOSS
                ),
                met: diff <= LOSS,
            });
        }
    }
    let _ = writeln!(s);
}
