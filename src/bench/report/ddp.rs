//! The table of a workload against PyTorch DDP.
use std::fmt::Write as _;

use super::{epoch, loss_difference, median, peak_fraction, scaled, spread, throughput, wall, Machine, Target};
use crate::bench::workload::Workload;
use crate::bench::{Cell, Measure, WorkloadResult};

/// A workload against PyTorch DDP: wall and epoch times, throughput, the matmul peak's share and
/// the losses, per world size.
pub(super) fn section(s: &mut String, machine: &Machine, r: &WorkloadResult, targets: &mut Vec<Target>) {
    let w = &r.workload;
    let _ = writeln!(s, "### {}: {}\n", w.name, w.describe());
    let _ = writeln!(s, "{}", header(w));
    for c in &r.cells {
        let row = Row::of(machine, w, c);
        row.write(s, w, c);
        row.targets(w, c, targets);
    }
    let _ = writeln!(s);
}

/// The table's head and rule: the throughput columns are the workload's units, the peak's share
/// only where the workload is compute-bound.
fn header(w: &Workload) -> String {
    let mut head = "| world size | threads per rank | wall s runner | wall s PyTorch | wall ratio | epoch s runner | epoch s PyTorch |".to_string();
    let mut rule = "|---:|---:|---:|---:|---:|---:|---:|".to_string();
    for (unit, _) in &w.kind.throughput_units() {
        let _ = write!(head, " {unit} runner | {unit} PyTorch |");
        rule.push_str("---:|---:|");
    }
    head.push_str(" throughput ratio |");
    rule.push_str("---:|");
    if w.compute_bound {
        head.push_str(" peak runner | peak PyTorch |");
        rule.push_str("---:|---:|");
    }
    head.push_str(" loss rel. difference |");
    rule.push_str("---:|");
    format!("{head}\n{rule}")
}

/// One world size's ratios and each side's share of the matmul peak (percent, per run).
struct Row {
    wall_ratio: f64,
    throughput_ratio: f64,
    fraction_runner: Vec<f64>,
    fraction_torch: Vec<f64>,
    loss_diff: f64,
}

impl Row {
    fn of(machine: &Machine, w: &Workload, c: &Cell) -> Row {
        let flops = w.train_flops_per_sample();
        let fraction = |m: &[Measure]| -> Vec<f64> {
            m.iter().map(|m| 100.0 * peak_fraction(m, flops, machine.peak(w.bf16))).collect()
        };
        Row {
            wall_ratio: median(&wall(&c.runner)) / median(&wall(&c.torch)),
            throughput_ratio: median(&throughput(&c.runner)) / median(&throughput(&c.torch)),
            fraction_runner: fraction(&c.runner),
            fraction_torch: fraction(&c.torch),
            loss_diff: loss_difference(&c.runner, &c.torch),
        }
    }

    fn write(&self, s: &mut String, w: &Workload, c: &Cell) {
        let _ = write!(
            s,
            "| {} | {} | {} | {} | {:.3} | {} | {} |",
            c.world_size,
            c.threads,
            spread(&wall(&c.runner), 2),
            spread(&wall(&c.torch), 2),
            self.wall_ratio,
            spread(&epoch(&c.runner), 3),
            spread(&epoch(&c.torch), 3),
        );
        for (_, per_sample) in &w.kind.throughput_units() {
            let (runner, torch) =
                (scaled(throughput(&c.runner), *per_sample), scaled(throughput(&c.torch), *per_sample));
            let _ = write!(s, " {} | {} |", spread(&runner, 0), spread(&torch, 0));
        }
        let _ = write!(s, " {:.2} |", self.throughput_ratio);
        if w.compute_bound {
            let _ = write!(s, " {}% | {}% |", spread(&self.fraction_runner, 1), spread(&self.fraction_torch, 1));
        }
        let _ = writeln!(s, " {:.1e} |", self.loss_diff);
    }

    /// Throughput (and wall time where set) up to the targets' largest world size, the matmul
    /// peak's share at world size 1, the losses everywhere.
    fn targets(&self, w: &Workload, c: &Cell, targets: &mut Vec<Target>) {
        let (ws, t, label) = (c.world_size, &w.targets, w.label());
        let (tp_ratio, wall_ratio, diff) = (self.throughput_ratio, self.wall_ratio, self.loss_diff);
        let target = if ws == 1 { t.throughput_ws1.unwrap_or(t.throughput) } else { t.throughput };
        if t.world_sizes.is_none_or(|up_to| ws <= up_to) {
            targets.push(Target {
                what: format!("{label} ws {ws}: throughput {tp_ratio:.2}× PyTorch's (target ≥ {target}×)"),
                met: tp_ratio >= target,
            });
            if let Some(wall) = t.wall {
                targets.push(Target {
                    what: format!(
                        "{label} ws {ws}: end-to-end wall time {wall_ratio:.3}× torchrun's (target ≤ {wall}×)"
                    ),
                    met: wall_ratio <= wall,
                });
            }
        }
        if let (Some(peak), 1) = (t.peak, ws) {
            let (f, torch) = (median(&self.fraction_runner), median(&self.fraction_torch));
            targets.push(Target {
                what: format!("{label} ws 1: {f:.1}% of the matmul peak (target ≥ {peak}%; PyTorch: {torch:.1}%)"),
                met: f >= peak,
            });
        }
        targets.push(Target {
            what: format!(
                "{label} ws {ws}: per-epoch losses within {diff:.1e} relative of PyTorch's (target ≤ {:.0e})",
                t.loss
            ),
            met: diff <= t.loss,
        });
    }
}
