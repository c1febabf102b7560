//! The benchmark's tables and targets, as markdown, and their place in benches/RESULTS.md.
mod tp;

use std::fmt::Write as _;
use std::path::Path;

use super::workload::Peer;
use super::{Measure, WorkloadResult};

const BEGIN: &str = "<!-- runner bench: begin (this part is rewritten by `runner bench`) -->";
const END: &str = "<!-- runner bench: end -->";

pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    /// The float32 matmul peak, FLOP/s.
    pub peak_flops: f64,
    /// The bfloat16 one: on a CPU without fast bfloat16 units it is below the float32 peak.
    pub peak_flops_bf16: f64,
    /// The command line that made the tables.
    pub command: String,
}

impl Machine {
    pub fn this(cores: usize, peak_flops: f64, peak_flops_bf16: f64) -> Machine {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let command = format!("runner {}", args.join(" "));
        Machine { cpu: crate::numerics::cpu_model(), cores, peak_flops, peak_flops_bf16, command }
    }

    /// The matmul peak in the workload's precision.
    fn peak(&self, bf16: bool) -> f64 {
        if bf16 {
            self.peak_flops_bf16
        } else {
            self.peak_flops
        }
    }
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// "1.23 (1.20–1.31)", or the bare median for one value.
fn spread(v: &[f64], digits: usize) -> String {
    let (lo, hi) = v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
    if v.len() < 2 {
        format!("{:.digits$}", median(v))
    } else {
        format!("{:.digits$} ({lo:.digits$}–{hi:.digits$})", median(v))
    }
}

fn wall(m: &[Measure]) -> Vec<f64> {
    m.iter().map(|m| m.wall_s).collect()
}
fn epoch(m: &[Measure]) -> Vec<f64> {
    m.iter().map(|m| m.epoch_s).collect()
}
fn throughput(m: &[Measure]) -> Vec<f64> {
    m.iter().map(|m| m.samples / m.epoch_s).collect()
}
fn scaled(v: Vec<f64>, by: f64) -> Vec<f64> {
    v.into_iter().map(|x| x * by).collect()
}

/// Largest relative difference between two series' per-epoch losses, over every run.
fn loss_difference(a: &[Measure], b: &[Measure]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(r, t)| r.losses.iter().zip(&t.losses).map(|(a, b)| (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)))
        .chain(a.iter().zip(b).filter(|(r, t)| r.losses.len() != t.losses.len()).map(|_| f64::INFINITY))
        .fold(0.0, f64::max)
}

/// Fraction of the matmul peak: the model's training FLOPs per sample (3 × its forward pass, counted
/// from its shapes) × samples per epoch, over the epoch time.
fn peak_fraction(m: &Measure, flops_per_sample: f64, peak: f64) -> f64 {
    flops_per_sample * m.samples / m.epoch_s / peak
}

struct Target {
    what: String,
    met: bool,
}

pub fn markdown(machine: &Machine, repetitions: usize, results: &[WorkloadResult]) -> String {
    let mut s = String::new();
    let build = if cfg!(debug_assertions) { "debug build: timings are not representative" } else { "release build" };
    let _ = writeln!(s, "## Latest run: {}\n", chrono::Local::now().format("%Y-%m-%d %H:%M"));
    let _ = writeln!(s, "Command: `{}`\n", machine.command);
    let bf16 = if machine.peak_flops_bf16.is_nan() {
        String::from(" (bfloat16 not measured: no workload ran in it)")
    } else {
        format!(
            ", {:.1} GFLOP/s in bfloat16 ({:.2}× float32: the most bf16 can gain here)",
            machine.peak_flops_bf16 / 1e9,
            machine.peak_flops_bf16 / machine.peak_flops
        )
    };
    let _ = writeln!(
        s,
        "Machine: {}, {} cores. runner {} ({build}, its default numerics: MKL's kernels for this CPU), PyTorch \
         2.13.0 under torchrun as it runs by default, both on gloo. \
         {repetitions} repetition(s) per cell, runner and PyTorch alternating. \
         Matmul peak (square products up to 2048², a probe of about a second, {} threads, best of the \
         measurements before each workload and at the end): {:.1} GFLOP/s in float32{bf16}.\n",
        machine.cpu,
        machine.cores,
        env!("CARGO_PKG_VERSION"),
        machine.cores,
        machine.peak_flops / 1e9,
    );
    let _ = writeln!(
        s,
        "Each cell: median (min–max) over the repetitions. Epoch time: the slowest rank's, median over \
         the epochs of a run. Samples/s: training samples of all ranks per epoch time (images/s for the CNN, \
         whose sample is one image; tokens/s for the transformer: samples × seq_len). Ratios: runner / PyTorch \
         of the medians. Peak: training FLOPs (3 × the forward pass's matrix products and convolutions, \
         counted from the model's shapes) per second, over the matmul peak of the run's precision.\n"
    );
    let mut targets = Vec::new();
    for r in results {
        match r.workload.peer {
            Peer::TorchDdp => ddp_section(&mut s, machine, r, &mut targets),
            Peer::TorchFsdp2 { memory, ddp_step } => fsdp_section(&mut s, r, memory, ddp_step, &mut targets),
            Peer::TorchTp { tensor, memory } => tp::section(&mut s, r, tensor, memory, &mut targets),
        }
    }
    numerics_cost(&mut s, results);
    precision_comparison(&mut s, results, &mut targets);
    let met = targets.iter().filter(|t| t.met).count();
    let _ = writeln!(s, "### Targets: {met} of {} met\n", targets.len());
    for t in &targets {
        let _ = writeln!(s, "- {} {}", if t.met { "✓" } else { "✗ missed:" }, t.what);
    }
    s
}

/// A workload against PyTorch DDP: wall and epoch times, throughput, the matmul peak's share and
/// the losses, per world size.
fn ddp_section(s: &mut String, machine: &Machine, r: &WorkloadResult, targets: &mut Vec<Target>) {
    let w = &r.workload;
    let units = w.kind.throughput_units();
    let _ = writeln!(s, "### {}: {}\n", w.name, w.describe());
    let mut head = "| world size | threads per rank | wall s runner | wall s PyTorch | wall ratio | epoch s runner | epoch s PyTorch |".to_string();
    let mut rule = "|---:|---:|---:|---:|---:|---:|---:|".to_string();
    for (unit, _) in &units {
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
    let _ = writeln!(s, "{head}\n{rule}");
    for c in &r.cells {
        let wall_ratio = median(&wall(&c.runner)) / median(&wall(&c.torch));
        let tp_ratio = median(&throughput(&c.runner)) / median(&throughput(&c.torch));
        let _ = write!(
            s,
            "| {} | {} | {} | {} | {wall_ratio:.3} | {} | {} |",
            c.world_size,
            c.threads,
            spread(&wall(&c.runner), 2),
            spread(&wall(&c.torch), 2),
            spread(&epoch(&c.runner), 3),
            spread(&epoch(&c.torch), 3),
        );
        for (_, per_sample) in &units {
            let _ = write!(
                s,
                " {} | {} |",
                spread(&scaled(throughput(&c.runner), *per_sample), 0),
                spread(&scaled(throughput(&c.torch), *per_sample), 0)
            );
        }
        let _ = write!(s, " {tp_ratio:.2} |");
        let flops = w.train_flops_per_sample();
        let fraction = |m: &[Measure]| -> Vec<f64> {
            m.iter().map(|m| 100.0 * peak_fraction(m, flops, machine.peak(w.bf16))).collect()
        };
        if w.compute_bound {
            let _ = write!(s, " {}% | {}% |", spread(&fraction(&c.runner), 1), spread(&fraction(&c.torch), 1));
        }
        let diff = loss_difference(&c.runner, &c.torch);
        let _ = writeln!(s, " {diff:.1e} |");

        let ws = c.world_size;
        let t = &w.targets;
        let target = if ws == 1 { t.throughput_ws1.unwrap_or(t.throughput) } else { t.throughput };
        if t.world_sizes.is_none_or(|up_to| ws <= up_to) {
            targets.push(Target {
                what: format!("{} ws {ws}: throughput {tp_ratio:.2}× PyTorch's (target ≥ {}×)", w.label(), target),
                met: tp_ratio >= target,
            });
            if let Some(wall) = t.wall {
                targets.push(Target {
                    what: format!(
                        "{} ws {ws}: end-to-end wall time {wall_ratio:.3}× torchrun's (target ≤ {wall}×)",
                        w.label()
                    ),
                    met: wall_ratio <= wall,
                });
            }
        }
        if let (Some(peak), 1) = (t.peak, ws) {
            let f = median(&fraction(&c.runner));
            targets.push(Target {
                what: format!(
                    "{} ws 1: {f:.1}% of the matmul peak (target ≥ {peak}%; PyTorch: {:.1}%)",
                    w.label(),
                    median(&fraction(&c.torch))
                ),
                met: f >= peak,
            });
        }
        targets.push(Target {
            what: format!(
                "{} ws {ws}: per-epoch losses within {diff:.1e} relative of PyTorch's (target ≤ {:.0e})",
                w.label(),
                t.loss
            ),
            met: diff <= t.loss,
        });
    }
    let _ = writeln!(s);
}

/// A workload against PyTorch FSDP2: tokens/s, each rank's peak resident memory, the step against
/// the runner's own DDP step, and the losses, per world size.
fn fsdp_section(s: &mut String, r: &WorkloadResult, memory: f64, ddp_step: f64, targets: &mut Vec<Target>) {
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
        super::workload::FSDP_STRATEGY,
        super::memory::EVERY.as_millis()
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
        if ws == super::workload::DDP_STEP_WORLD_SIZE {
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

/// Each run's largest per-rank peak resident memory, MiB.
fn largest_peak(m: &[Measure]) -> Vec<f64> {
    m.iter().map(|m| m.peak_rss.iter().copied().max().unwrap_or(0) as f64 / MIB).collect()
}

/// "712 / 705": each rank's peak resident memory in MiB, median over the runs.
fn peaks_per_rank(m: &[Measure]) -> String {
    let ranks = m.iter().map(|m| m.peak_rss.len()).max().unwrap_or(0);
    let rank =
        |r: usize| median(&m.iter().filter_map(|m| m.peak_rss.get(r)).map(|b| *b as f64 / MIB).collect::<Vec<_>>());
    (0..ranks).map(|r| format!("{:.0}", rank(r))).collect::<Vec<_>>().join(" / ")
}

const MIB: f64 = (1u64 << 20) as f64;

/// What the same bits on every CPU cost: the runner with `run.numerics = "portable"`
/// (every kernel family pinned) against the runner as it runs by default, in epoch time, and how far
/// apart their losses end.
fn numerics_cost(s: &mut String, results: &[WorkloadResult]) {
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
fn precision_comparison(s: &mut String, results: &[WorkloadResult], targets: &mut Vec<Target>) {
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

/// Replaces the part of `path` between the markers with `text` (the rest is notes, kept).
pub fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let block = format!("{BEGIN}\n{text}{END}\n");
    let new = match (old.find(BEGIN), old.find(END)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{block}\n{}", &old[..b], old[e + END.len()..].trim_start_matches('\n'))
        }
        _ if old.is_empty() => format!("# Benchmarks: runner against PyTorch DDP\n\n{block}"),
        _ => format!("{}\n{block}", old.trim_end()),
    };
    crate::rundir::atomic_write(path, new.as_bytes())
}

#[cfg(test)]
mod tests {
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
        let results: Vec<WorkloadResult> = super::super::workload::all()
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
        assert!(
            text.contains("| epoch s PyTorch | images/s runner | images/s PyTorch | throughput ratio | peak runner |")
        );
        assert!(text.contains(
            "| samples/s runner | samples/s PyTorch | tokens/s runner | tokens/s PyTorch | throughput ratio |"
        ));
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
        let m = |epoch_s, last| Measure {
            wall_s: 2.0,
            epoch_s,
            samples: 1024.0,
            losses: vec![2.0, last],
            peak_rss: vec![],
        };
        let cell = |runner: f64, torch: f64, last| Cell {
            world_size: 1,
            threads: 2,
            runner: vec![m(runner, last)],
            torch: vec![m(torch, last)],
            runner_portable: Vec::new(),
            runner_ddp: Vec::new(),
        };
        let w = super::super::workload::all().into_iter().find(|w| w.name == "compute-bound").unwrap();
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
        let w = super::super::workload::all().into_iter().find(|w| w.name == "fsdp").unwrap();
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
}
