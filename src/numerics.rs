//! The numerical path of a run: the settings that make libtorch's CPU kernels give the same bits
//! on any x86-64 CPU, and the CPU that made a result.
//!
//! libtorch's float32 matrix products go to oneMKL (linked into libtorch_cpu.so), which picks its
//! kernels by the CPU it runs on (AVX-512 on one Xeon, AVX2 on an EPYC): the sums come out in
//! another order and the last bits differ. Runs use those kernels by default (`run.numerics =
//! "native"`, as PyTorch does): the same bits on the same CPU model. MKL's conditional numerical
//! reproducibility (`MKL_CBWR`, `run.numerics = "portable"`) pins one code path on every CPU, at
//! about 2.4× the time of compute-bound work: for tables committed and checked elsewhere. [`fix`]
//! sets it first thing in `main`, in every process (the launcher, each rank, whatever started
//! them); a value the environment already gives is kept. The value in effect is recorded in
//! manifest.json and sweep.json, and `runner sweep --check` reruns under the stored one.
use serde::{Deserialize, Serialize};

use crate::config::schema::CpuNumerics;

/// The `MKL_CBWR` the runner sets for `run.numerics = "portable"` when the environment sets none.
/// `COMPATIBLE` is the one branch MKL honours on every x86-64 CPU: on an AMD EPYC, MKL ignores
/// `AVX2`, `AVX`, `SSE4_2` (its verbose log says `CNR:AUTO`; they are Intel-only), so only this
/// one gives the same code path on Intel and AMD machines.
pub const MKL_CBWR: &str = "COMPATIBLE";

/// The `MKL_CBWR` of a `run.numerics`: for "native" the empty string, which MKL takes as unset
/// (`MKL_VERBOSE` says `CNR:OFF`) and which the runner's children keep as the environment's value.
pub fn mkl_cbwr(mode: CpuNumerics) -> &'static str {
    match mode {
        CpuNumerics::Portable => MKL_CBWR,
        CpuNumerics::Native => "",
    }
}

/// What a result was computed under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Numerics {
    /// `MKL_CBWR` in effect ("" when unset: MKL chose by the CPU).
    pub mkl_cbwr: String,
    /// The CPU's model name (/proc/cpuinfo).
    pub cpu: String,
}

/// Sets `MKL_CBWR` to the value of `mode` unless the environment sets it, for this process and
/// the ones it starts. Call it in `main` before anything computes. Children read the variable
/// when they load libtorch; this process loaded it before `main` (setting the variable alone
/// changes nothing here: `MKL_VERBOSE=1` says `CNR:AUTO`), so MKL is told directly
/// ([`crate::dist::mkl`]). Where MKL cannot be told, the process runs itself again with the
/// variable set, once (that costs a second start of libtorch, about 0.25 s); should that exec
/// fail, the variable is unset again, so that the manifest records what MKL really used. An
/// environment's value that MKL does not know is refused: MKL would ignore it, and the manifest
/// would record a path the run never took.
pub fn fix(mode: CpuNumerics) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    if let Some(value) = std::env::var_os("MKL_CBWR") {
        let value = value.to_string_lossy();
        return check(&value, "in the environment")
            .map(|warning| warning.into_iter().for_each(|w| crate::say_err!("{w}")));
    }
    let value = mkl_cbwr(mode);
    std::env::set_var("MKL_CBWR", value);
    // Native is MKL's own choice, what it does with the variable unset.
    if mode == CpuNumerics::Native || crate::dist::mkl::set_compatible() {
        return Ok(());
    }
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_default();
    let err = std::process::Command::new("/proc/self/exe").arg0(argv0).args(args).exec();
    std::env::remove_var("MKL_CBWR");
    crate::say_err!("warning: cannot run runner again with MKL_CBWR={value} ({err}): results may differ on other CPUs");
    Ok(())
}

/// MKL's code branches (oneMKL developer guide, "Specifying code branches"; the names libtorch's
/// MKL parses). All but AUTO and COMPATIBLE are Intel's: elsewhere MKL ignores them.
const BRANCHES: &[&str] = &[
    "AUTO",
    "COMPATIBLE",
    "SSE2",
    "SSE3",
    "SSSE3",
    "SSE4_1",
    "SSE4_2",
    "AVX",
    "AVX2",
    "AVX512",
    "AVX512_E1",
    "AVX512_E2",
    "AVX512_E3",
    "AVX512_E4",
    "AVX512_E5",
    "AVX512_MIC",
    "AVX512_MIC_E1",
];

/// Whether MKL takes `value` as `MKL_CBWR` (`[BRANCH=]<branch>[,STRICT]`, or "": unset), with a
/// warning where it names an Intel branch on another CPU; `origin` says where the value is from.
pub fn check(value: &str, origin: &str) -> Result<Option<String>, String> {
    if value.is_empty() {
        return Ok(None);
    }
    let branch = branch(value);
    if !BRANCHES.contains(&branch) {
        return Err(format!(
            "MKL_CBWR={value:?} {origin} is not a value MKL knows: MKL would ignore it and choose its kernels by \
             the CPU, and the run would record a setting it did not compute under. Unset MKL_CBWR to let \
             run.numerics choose (\"native\" or \"portable\"), or set one of MKL's branches: {} \
             (optionally BRANCH=<branch> and ,STRICT)",
            BRANCHES.join(", ")
        ));
    }
    let intel = std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|t| t.contains("GenuineIntel"));
    Ok((!intel && !matches!(branch, "AUTO" | "COMPATIBLE")).then(|| {
        format!(
            "warning: MKL_CBWR={value} {origin} names an Intel code branch, which MKL ignores on {}: it chooses \
             its kernels by the CPU (AUTO); COMPATIBLE is the branch that gives the same bits on any x86-64 CPU",
            cpu_model()
        )
    }))
}

/// The branch an `MKL_CBWR` value names.
fn branch(value: &str) -> &str {
    let branch = value.strip_prefix("BRANCH=").unwrap_or(value);
    branch.strip_suffix(",STRICT").unwrap_or(branch)
}

/// Refuses an `MKL_CBWR` in the environment that MKL does not know ([`check`]), for commands
/// that read a plan without computing under it (their process set no numerics of its own).
pub fn check_environment() -> Result<(), String> {
    match std::env::var("MKL_CBWR") {
        Ok(value) => check(&value, "in the environment").map(|_| ()),
        Err(_) => Ok(()),
    }
}

/// What a process of a plan with `mode` computes under: the environment's `MKL_CBWR` where it
/// sets one (it wins, as in [`fix`]), else the mode's.
pub fn of_plan(mode: CpuNumerics) -> Numerics {
    let mkl_cbwr = std::env::var("MKL_CBWR").unwrap_or_else(|_| mkl_cbwr(mode).to_owned());
    Numerics { mkl_cbwr, cpu: cpu_model() }
}

/// The settings in effect in this process and the CPU it runs on.
pub fn current() -> Numerics {
    Numerics { mkl_cbwr: std::env::var("MKL_CBWR").unwrap_or_default(), cpu: cpu_model() }
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
    /// Whether MKL computed on its branch that gives the same bits on any x86-64 CPU.
    pub fn is_portable(&self) -> bool {
        branch(&self.mkl_cbwr) == MKL_CBWR
    }
}

impl std::fmt::Display for Numerics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cbwr = if self.mkl_cbwr.is_empty() { "unset" } else { &self.mkl_cbwr };
        write!(f, "{} (MKL_CBWR={cbwr})", self.cpu)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cpu_is_named() {
        assert!(!super::cpu_model().is_empty());
    }
}
