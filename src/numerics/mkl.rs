//! MKL's conditional numerical reproducibility (`MKL_CBWR`): the values MKL knows, and how a
//! process is put on the COMPATIBLE branch.
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

/// Sets `MKL_CBWR` to the value of `mode` unless the environment sets it (a value MKL knows: it
/// wins, and is what the manifest records), for this process and the ones it starts. This
/// process loaded MKL before `main` (setting the variable alone changes nothing here:
/// `MKL_VERBOSE=1` says `CNR:AUTO`), so MKL is told directly ([`crate::dist::mkl`]). Where MKL
/// cannot be told, the process runs itself again with the variable set, once (a second start of
/// libtorch, about 0.25 s); should that exec fail, the variable is unset again, so that the
/// manifest records what MKL really used.
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
            super::cpu_model()
        )
    }))
}

/// The branch an `MKL_CBWR` value names.
pub fn branch(value: &str) -> &str {
    let branch = value.strip_prefix("BRANCH=").unwrap_or(value);
    branch.strip_suffix(",STRICT").unwrap_or(branch)
}
