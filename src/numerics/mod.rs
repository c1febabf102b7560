//! The numerical path of a run: the settings that make libtorch's CPU kernels give the same bits
//! on any x86-64 CPU, and the CPU that made a result.
//!
//! Three families of kernels choose their code by the CPU they run on, and each changes the last
//! bits of a result (docs/reproducibility.md has the measurements):
//! - oneMKL (matrix products), by the CPU's vector width and vendor: `MKL_CBWR` ([`mkl`]);
//! - ATen's own vectorised kernels (softmax, layer norm, GELU's tanh form, SiLU, sigmoid, batch
//!   norm, attention's softmax, the optimizers' fused updates), by ATen's CPU capability: AVX2
//!   kernels use fused multiply-adds and Sleef's vector maths where the default ones do not;
//! - oneDNN (convolutions, GELU) and NNPACK (convolutions), by their own JIT instruction sets.
//!
//! Runs use the CPU's own kernels by default (`run.numerics = "native"`, as PyTorch does): the
//! same bits on the same CPU model. `run.numerics = "portable"` pins every family: MKL's
//! COMPATIBLE branch, ATen's AVX2 kernels (every x86-64 server CPU of the last decade has AVX2
//! and FMA; an AVX-512 CPU runs them too), oneDNN and NNPACK off (convolutions then run ATen's
//! im2col and MKL's products), and a thread count that does not depend on the machine (a sum
//! split over another number of threads rounds differently). [`fix`] sets it first thing in
//! `main`, in every process that computes under a plan (the launcher, each rank, whatever started
//! them). The settings in effect are recorded in manifest.json and sweep.json, and `runner sweep
//! --check` reruns under the stored ones.
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::config::schema::CpuNumerics;

pub mod mkl;

pub use mkl::{check, MKL_CBWR};

/// ATen's CPU capability under portable numerics, as `ATEN_CPU_CAPABILITY` names it, and as
/// libtorch reports it once in effect.
pub const CAPABILITY: (&str, &str) = ("avx2", "AVX2");

/// The environment variables that choose libtorch's kernels, with the values portable numerics
/// give them: ATen's capability, and oneDNN's instruction set for anything that still reaches
/// oneDNN with its convolutions off.
const PINNED: [(&str, &str); 2] = [("ATEN_CPU_CAPABILITY", CAPABILITY.0), ("ONEDNN_MAX_CPU_ISA", "AVX2")];

/// What the environment asked for and portable numerics overrode in this process ("VAR=value").
static OVERRIDDEN: OnceLock<Vec<String>> = OnceLock::new();

/// Puts this process (and the ones it starts) on `mode`'s kernels. Call it in `main` before
/// anything computes. Under portable numerics an environment that asks for other kernels
/// (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`) is overridden, and the plan says so; a CPU
/// without AVX2 and FMA cannot run the portable kernels and is refused. `MKL_CBWR` from the
/// environment wins, as [`mkl::fix`] says.
pub fn fix(mode: CpuNumerics) -> Result<(), String> {
    if mode == CpuNumerics::Portable {
        pin_environment()?;
    }
    mkl::fix(mode)?;
    if mode == CpuNumerics::Portable {
        let kernels = crate::dist::cpu_kernels(true).map_err(|e| format!("cannot pin libtorch's CPU kernels: {e}"))?;
        if kernels.capability != CAPABILITY.1 || kernels.onednn || kernels.nnpack {
            return Err(format!(
                "run.numerics = \"portable\" asked libtorch for its {} kernels with oneDNN and NNPACK off, and it \
                 reports {kernels:?}: something computed before the runner could set it; use run.numerics = \"native\"",
                CAPABILITY.1
            ));
        }
    }
    Ok(())
}

/// Sets [`PINNED`] in the environment, noting the values it replaces; refuses a CPU that cannot
/// run ATen's AVX2 kernels (libtorch would stop on an illegal instruction).
fn pin_environment() -> Result<(), String> {
    if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
        return Err(format!(
            "run.numerics = \"portable\" computes with ATen's AVX2 kernels, which give the same bits on every x86-64 \
             CPU with AVX2 and FMA (every server CPU since about 2015); {} has no AVX2: use run.numerics = \"native\" \
             (this CPU's own kernels)",
            cpu_model()
        ));
    }
    let mut overridden = Vec::new();
    for (var, value) in PINNED {
        match std::env::var(var) {
            Ok(v) if v.eq_ignore_ascii_case(value) => {}
            Ok(v) => overridden.push(format!("{var}={v}")),
            Err(_) => {}
        }
        std::env::set_var(var, value);
    }
    let _ = OVERRIDDEN.set(overridden);
    Ok(())
}

/// The kernels a result was computed with, beside MKL's branch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kernels {
    /// ATen's CPU capability ("DEFAULT", "AVX2", "AVX512").
    pub aten: String,
    /// Whether oneDNN and NNPACK computed (they do by default; portable numerics turn them off).
    pub onednn: bool,
    /// Intra-op threads of each rank.
    pub threads: usize,
    /// What the environment asked for and portable numerics overrode ("ATEN_CPU_CAPABILITY=default").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overridden: Vec<String>,
}

/// What a result was computed under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Numerics {
    /// `MKL_CBWR` in effect ("" when unset: MKL chose by the CPU).
    pub mkl_cbwr: String,
    /// The CPU's model name (/proc/cpuinfo).
    pub cpu: String,
    /// ATen's, oneDNN's and the threads' settings; absent in records of runners before 2026-11-26,
    /// whose portable numerics pinned MKL alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<Kernels>,
}

/// Refuses an `MKL_CBWR` in the environment that MKL does not know ([`check`]), for commands
/// that read a plan without computing under it (their process set no numerics of its own).
pub fn check_environment() -> Result<(), String> {
    match std::env::var("MKL_CBWR") {
        Ok(value) => check(&value, "in the environment").map(|_| ()),
        Err(_) => Ok(()),
    }
}

/// What a process of a plan with `mode` and `threads` per rank computes under, as seen from a
/// process that has not set it up itself (`runner sweep`): the environment's `MKL_CBWR` where it
/// sets one (it wins, as in [`fix`]), else the mode's; portable's kernels, or else the ones
/// libtorch chooses here.
pub fn of_plan(mode: CpuNumerics, threads: usize) -> Numerics {
    let mkl_cbwr = std::env::var("MKL_CBWR").unwrap_or_else(|_| mkl::mkl_cbwr(mode).to_owned());
    let kernels = match mode {
        CpuNumerics::Portable => Kernels { aten: CAPABILITY.1.into(), onednn: false, threads, overridden: Vec::new() },
        CpuNumerics::Native => native_kernels(threads),
    };
    Numerics { mkl_cbwr, cpu: cpu_model(), kernels: Some(kernels) }
}

/// The settings in effect in this process, whose ranks compute on `threads` threads each, and the
/// CPU it runs on.
pub fn current(threads: usize) -> Numerics {
    let mut kernels = native_kernels(threads);
    kernels.overridden = OVERRIDDEN.get().cloned().unwrap_or_default();
    Numerics { mkl_cbwr: std::env::var("MKL_CBWR").unwrap_or_default(), cpu: cpu_model(), kernels: Some(kernels) }
}

/// libtorch's kernels in this process as they are.
fn native_kernels(threads: usize) -> Kernels {
    let (aten, onednn) = match crate::dist::cpu_kernels(false) {
        Ok(k) => (k.capability, k.onednn || k.nnpack),
        Err(_) => ("unknown".into(), true),
    };
    Kernels { aten, onednn, threads, overridden: Vec::new() }
}

/// What the plan says of the kernels beside its step row: the environment's requests that
/// portable numerics overrode in this process.
pub fn notes() -> Vec<String> {
    let overridden = OVERRIDDEN.get().map(Vec::as_slice).unwrap_or_default();
    if overridden.is_empty() {
        return Vec::new();
    }
    vec![format!(
        "note: run.numerics = \"portable\" overrides {} from the environment: the portable kernels are {}",
        overridden.join(" and "),
        PINNED.iter().map(|(var, value)| format!("{var}={value}")).collect::<Vec<_>>().join(", ")
    )]
}

/// "AMD EPYC", "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"; "unknown" where /proc says none.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

impl Numerics {
    /// Whether every kernel family was pinned: MKL's COMPATIBLE branch, ATen's portable
    /// capability, oneDNN and NNPACK off. Records of older runners, which pinned MKL alone, are not.
    pub fn is_portable(&self) -> bool {
        mkl::branch(&self.mkl_cbwr) == MKL_CBWR
            && self.kernels.as_ref().is_some_and(|k| k.aten == CAPABILITY.1 && !k.onednn)
    }
}

impl std::fmt::Display for Numerics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cbwr = if self.mkl_cbwr.is_empty() { "unset" } else { &self.mkl_cbwr };
        write!(f, "{} (MKL_CBWR={cbwr}", self.cpu)?;
        match &self.kernels {
            Some(k) => write!(
                f,
                ", ATen {}, oneDNN {}, {} thread{} per rank)",
                k.aten,
                if k.onednn { "on" } else { "off" },
                k.threads,
                if k.threads == 1 { "" } else { "s" }
            ),
            None => write!(f, "; ATen's kernels unrecorded)"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cpu_is_named() {
        assert!(!super::cpu_model().is_empty());
    }
}
