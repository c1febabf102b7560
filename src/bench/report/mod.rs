//! The benchmark's tables and targets, as markdown, and their place in benches/RESULTS.md.
mod ddp;
mod fsdp;
mod precision;
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
            Peer::TorchDdp => ddp::section(&mut s, machine, r, &mut targets),
            Peer::TorchFsdp2 { memory, ddp_step } => fsdp::section(&mut s, r, memory, ddp_step, &mut targets),
            Peer::TorchTp { tensor, memory } => tp::section(&mut s, r, tensor, memory, &mut targets),
        }
    }
    precision::numerics_cost(&mut s, results);
    precision::comparison(&mut s, results, &mut targets);
    let met = targets.iter().filter(|t| t.met).count();
    let _ = writeln!(s, "### Targets: {met} of {} met\n", targets.len());
    for t in &targets {
        let _ = writeln!(s, "- {} {}", if t.met { "✓" } else { "✗ missed:" }, t.what);
    }
    s
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
mod tests;
