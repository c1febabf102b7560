//! The table of a workload against PyTorch FSDP2.
use std::fmt::Write as _;

use super::{epoch, largest_peak, loss_difference, median, peaks_per_rank, scaled, spread, throughput, Target};
use crate::bench::{Measure, WorkloadResult};

/// A workload against PyTorch FSDP2: tokens/s, each rank's peak resident memory, the step against
/// the runner's own DDP step, and the losses, per world size.
pub(super) fn section(s: &mut String, r: &WorkloadResult, memory: f64, ddp_step: f64, targets: &mut Vec<Target>) {
    let w = &r.workload;
    let per_token = w.kind.throughput_units().last().map_or(1.0, |u| u.1);
    let _ = writeln!(
        s,
        "### {}: {}\n\n\
         The runner with `wrap.strategy = \"{}\"` against PyTorch FSDP2 (benches/reference/fsdp2_torch.py: \
         `fully_shard` on each block, then on the root, as torchtitan), both reading the same token file from the \
         same initial weights in the same order. Tokens/s: all ranks' tokens over the slowest rank's epoch time. \
         Peak MiB: each rank's peak resident memory (VmHWM, sampled every {} ms from outside, the same way for \
         both), median over the repetitions; memory ratio: the largest rank's, runner / FSDP2. Step: epoch time \
         over the steps of an epoch; beside it the runner's own DDP step on the same pipeline.\n",
        w.name,
        w.describe(),
        crate::bench::workload::FSDP_STRATEGY,
        crate::bench::memory::EVERY.as_millis()
    );
    let _ = writeln!(
        s,
        "| world size | threads per rank | tokens/s runner | tokens/s FSDP2 | throughput ratio | peak MiB per rank \
         runner | peak MiB per rank FSDP2 | memory ratio | step ms runner | step ms runner DDP | step ratio to DDP | \
         loss rel. difference to FSDP2 | loss rel. difference to DDP |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for c in &r.cells {
        let ws = c.world_size;
        let tp_ratio = median(&throughput(&c.runner)) / median(&throughput(&c.torch));
        let mem_ratio = median(&largest_peak(&c.runner)) / median(&largest_peak(&c.torch));
        let steps = w.steps_per_epoch(ws) as f64;
        let step_ms = |m: &[Measure]| scaled(epoch(m), 1e3 / steps);
        let step_ratio = median(&epoch(&c.runner)) / median(&epoch(&c.runner_ddp));
        let (diff, diff_ddp) = (loss_difference(&c.runner, &c.torch), loss_difference(&c.runner, &c.runner_ddp));
        let _ = writeln!(
            s,
            "| {ws} | {} | {} | {} | {tp_ratio:.2} | {} | {} | {mem_ratio:.2} | {} | {} | {step_ratio:.2} | {diff:.1e} | \
             {diff_ddp:.1e} |",
            c.threads,
            spread(&scaled(throughput(&c.runner), per_token), 0),
            spread(&scaled(throughput(&c.torch), per_token), 0),
            peaks_per_rank(&c.runner),
            peaks_per_rank(&c.torch),
            spread(&step_ms(&c.runner), 1),
            spread(&step_ms(&c.runner_ddp), 1),
        );
        let t = &w.targets;
        let label = w.label();
        targets.push(Target {
            what: format!("{label} ws {ws}: throughput {tp_ratio:.2}× FSDP2's (target ≥ {}×)", t.throughput),
            met: tp_ratio >= t.throughput,
        });
        targets.push(Target {
            what: format!("{label} ws {ws}: largest per-rank peak memory {mem_ratio:.2}× FSDP2's (target ≤ {memory}×)"),
            met: mem_ratio <= memory,
        });
        if ws == crate::bench::workload::DDP_STEP_WORLD_SIZE {
            targets.push(Target {
                what: format!(
                    "{label} ws {ws}: step {step_ratio:.2}× the runner's own DDP step (target ≤ {ddp_step}×)"
                ),
                met: step_ratio <= ddp_step,
            });
        }
        targets.push(Target {
            what: format!(
                "{label} ws {ws}: per-epoch losses within {diff:.1e} relative of FSDP2's (target ≤ {:.0e})",
                t.loss
            ),
            met: diff <= t.loss,
        });
        targets.push(Target {
            what: format!(
                "{label} ws {ws}: per-epoch losses within {diff_ddp:.1e} relative of the runner's DDP (target ≤ {:.0e})",
                t.loss
            ),
            met: diff_ddp <= t.loss,
        });
    }
    let _ = writeln!(s);
}
