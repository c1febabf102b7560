//! The `tp` workload's table: the runner's tensor parallelism against PyTorch DTensor's at the
//! same mesh, in tokens/s and each rank's peak resident memory, with the losses side by side.
use std::fmt::Write as _;

use super::{largest_peak, loss_difference, median, peaks_per_rank, scaled, spread, throughput, Target};
use crate::bench::WorkloadResult;

/// Tokens/s of each side and their ratio, each rank's peak resident memory and the largest's
/// ratio, and the losses' largest relative difference, per world size; their targets.
pub(super) fn section(s: &mut String, r: &WorkloadResult, tensor: usize, memory: f64, targets: &mut Vec<Target>) {
    let w = &r.workload;
    let per_token = w.kind.throughput_units().last().map_or(1.0, |u| u.1);
    let _ = writeln!(
        s,
        "### {}: {}\n\n\
         The runner with `wrap.strategy = \"ddp\"` and `[wrap.mesh] tensor = {tensor}` against PyTorch's DTensor \
         tensor parallelism at the same mesh (benches/reference/tp_torch.py: `parallelize_module` with \
         ColwiseParallel q, k, v and fc, RowwiseParallel proj and out, as torchtitan), both reading the same \
         token file from the same initial weights in the same order. Tokens/s: the tokens trained per epoch \
         (each tensor group's once) over the slowest rank's epoch time. Peak MiB: each rank's peak resident \
         memory (VmHWM, sampled every {} ms from outside, the same way for both), median over the repetitions; \
         memory ratio: the largest rank's, runner / DTensor.\n",
        w.name,
        w.describe(),
        crate::bench::memory::EVERY.as_millis()
    );
    let _ = writeln!(
        s,
        "| world size | mesh | threads per rank | tokens/s runner | tokens/s DTensor | throughput ratio | peak MiB \
         per rank runner | peak MiB per rank DTensor | memory ratio | loss rel. difference |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for c in &r.cells {
        let ws = c.world_size;
        let tp_ratio = median(&throughput(&c.runner)) / median(&throughput(&c.torch));
        let mem_ratio = median(&largest_peak(&c.runner)) / median(&largest_peak(&c.torch));
        let diff = loss_difference(&c.runner, &c.torch);
        let _ = writeln!(
            s,
            "| {ws} | data {} × tensor {tensor} | {} | {} | {} | {tp_ratio:.2} | {} | {} | {mem_ratio:.2} | {diff:.1e} |",
            ws / tensor,
            c.threads,
            spread(&scaled(throughput(&c.runner), per_token), 0),
            spread(&scaled(throughput(&c.torch), per_token), 0),
            peaks_per_rank(&c.runner),
            peaks_per_rank(&c.torch),
        );
        let (t, label) = (&w.targets, w.label());
        targets.push(Target {
            what: format!("{label} ws {ws}: throughput {tp_ratio:.2}× DTensor's (target ≥ {}×)", t.throughput),
            met: tp_ratio >= t.throughput,
        });
        targets.push(Target {
            what: format!(
                "{label} ws {ws}: largest per-rank peak memory {mem_ratio:.2}× DTensor's (target ≤ {memory}×)"
            ),
            met: mem_ratio <= memory,
        });
        targets.push(Target {
            what: format!(
                "{label} ws {ws}: per-epoch losses within {diff:.1e} relative of DTensor's (target ≤ {:.0e})",
                t.loss
            ),
            met: diff <= t.loss,
        });
    }
    let _ = writeln!(s);
}

#[cfg(test)]
mod tests {
    use crate::bench::report::{markdown, Machine};
    use crate::bench::{Cell, Measure, WorkloadResult};

    /// The tp workload's table: both sides' tokens/s, each rank's peak memory, the mesh, and the
    /// targets (throughput, memory, losses); no numerics section and no DDP step.
    #[test]
    fn the_tp_workload_has_tokens_memory_and_the_mesh() {
        let mib = 1u64 << 20;
        let m = |epoch_s, peaks: [u64; 2], last| Measure {
            wall_s: 3.0,
            epoch_s,
            samples: 256.0,
            losses: vec![5.0, last],
            peak_rss: peaks.iter().map(|p| p * mib).collect(),
        };
        let cell = Cell {
            world_size: 2,
            threads: 1,
            runner: vec![m(1.0, [300, 310], 4.0)],
            torch: vec![m(1.5, [400, 390], 4.00001)],
            runner_portable: Vec::new(),
            runner_ddp: Vec::new(),
        };
        let w = crate::bench::catalogue::all().into_iter().find(|w| w.name == "tp").unwrap();
        let results = vec![WorkloadResult { workload: w, cells: vec![cell] }];
        let machine = Machine {
            cpu: "test".into(),
            cores: 2,
            peak_flops: 1e12,
            peak_flops_bf16: f64::NAN,
            command: "runner bench --workload tp".into(),
        };
        let text = markdown(&machine, 1, &results);
        // 256 windows of 64 tokens per epoch: 16384 tokens in 1 s against 1.5 s.
        assert!(
            text.contains(
                "| 2 | data 1 × tensor 2 | 1 | 16384 | 10923 | 1.50 | 300 / 310 | 400 / 390 | 0.78 | 2.5e-6 |"
            ),
            "{text}"
        );
        assert!(text.contains("- ✓ tp ws 2: throughput 1.50× DTensor's (target ≥ 1.2×)"), "{text}");
        assert!(text.contains("- ✓ tp ws 2: largest per-rank peak memory 0.78× DTensor's (target ≤ 1×)"), "{text}");
        assert!(
            text.contains("- ✓ tp ws 2: per-epoch losses within 2.5e-6 relative of DTensor's (target ≤ 1e-4)"),
            "{text}"
        );
        assert!(text.contains("### Targets: 3 of 3 met"), "{text}");
        assert!(!text.contains("The cost of reproducible numerics"), "{text}");
    }
}
