//! The run's own values, checked on the plan: world size, threads and thread replicas, name,
//! device and backend, timeouts and bounds, and `[track]`.
use crate::config::schema::*;

/// `[track]`'s values, checked on the plan.
pub(super) fn track_values(t: &Track, bad: &mut impl FnMut(&str, String)) {
    if let Some(url) = &t.mlflow {
        if let Err(why) = crate::trace::mlflow::check_url(url) {
            bad("track.mlflow", why);
        }
    }
    if t.experiment.as_deref().is_some_and(|e| e.trim().is_empty()) {
        bad("track.experiment", "is empty; name the MLflow experiment or leave the key out (default: run.name)".into());
    }
}

/// The run's values: world size, threads, name, device and backend, timeouts and bounds.
pub(super) fn run_values(c: &Config, machine: super::Machine, bad: &mut impl FnMut(&str, String)) {
    if c.run.world_size == 0 {
        bad("run.world_size", "must be at least 1".into());
    }
    crate::limits::run_values(c, bad);
    // `!(x > 0.0)` also refuses NaN; infinity is no limit, which leaving the key out says.
    if let Some(limit) = c.run.memory_per_rank_mb.filter(|&l| !(l > 0.0 && l.is_finite())) {
        bad(
            "run.memory_per_rank_mb",
            format!("must be a finite, positive number of MiB, got {limit} (leave it out for no limit)"),
        );
    }
    if c.run.threads_per_rank == Some(0) {
        bad("run.threads_per_rank", "must be at least 1 (or absent for cores / world_size)".into());
    }
    if c.run.name.is_empty() || c.run.name.contains(['/', '\\']) || c.run.name.starts_with('.') {
        bad("run.name", format!("{:?} cannot name a directory: use letters, digits, '-' and '_'", c.run.name));
    }
    // Below 1 GFLOP/s no device computes: such a peak reports an MFU of billions of percent.
    if let Some(peak) = c.run.peak_tflops.filter(|p| !(*p >= 1e-3 && *p <= 1e6)) {
        bad(
            "run.peak_tflops",
            format!(
                "must be between 0.001 (1 GFLOP/s) and 1000000 TFLOP/s, got {peak:?}: give the device's peak \
                 matrix-product rate in TFLOP/s (989 for an H100's dense bfloat16), or leave it out to measure it"
            ),
        );
    }
    // This build and this machine against run.device / run.backend (see crate::device); a plan
    // for another machine keeps only what no build or machine changes (nccl with the CPU).
    let here = (machine == super::Machine::This).then(|| crate::device::refusals_here(c.run.backend, c.run.device));
    for (key, msg) in crate::device::refusals(c.run.backend, c.run.device).into_iter().chain(here.into_iter().flatten())
    {
        bad(key, msg);
    }
}

/// `run.threads_per_rank`; unset, this machine's cores shared among the ranks, or one thread
/// under portable numerics (the thread count splits sums, and the machine must not choose it).
pub(super) fn threads_per_rank(c: &Config) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let shared = match c.run.numerics {
        CpuNumerics::Native => (cores / c.run.world_size.max(1)).max(1),
        CpuNumerics::Portable => 1,
    };
    c.run.threads_per_rank.unwrap_or(shared)
}

/// `wrap.threads_per_replica`: a divisor of the rank's threads, and, with several replicas per
/// rank, a model whose replicas can compute at once: nothing drawn at random in the forward pass
/// (two threads drawing from one generator would draw in a different order each run), no batch
/// norm statistics (both replicas would update them), layers the runner builds, on the CPU.
pub(super) fn thread_replicas(c: &Config, batch: usize, bad: &mut impl FnMut(&str, String)) {
    let Some(per) = c.wrap.threads_per_replica else { return };
    let key = "wrap.threads_per_replica";
    let threads = threads_per_rank(c);
    if per == 0 {
        return bad(key, "must be at least 1 (or absent: all of the rank's threads in one replica)".into());
    }
    if per > threads || !threads.is_multiple_of(per) {
        let why = if c.run.threads_per_rank.is_some() { "run.threads_per_rank" } else { "cores / world_size" };
        return bad(
            key,
            format!("{per} does not divide the rank's {threads} threads ({why}); use a divisor of {threads}"),
        );
    }
    let replicas = threads / per;
    if replicas == 1 {
        return;
    }
    let each = format!("{replicas} replicas per rank ({threads} threads / {per})");
    let dropout = match &c.wrap.model {
        Model::Mlp(m) => m.dropout,
        Model::Cnn(m) => m.conv.iter().map(|b| b.dropout).fold(m.dropout, f64::max),
        Model::Transformer(m) => m.dropout,
        Model::Torchscript(_) => 0.0,
    };
    if c.wrap.strategy == WrapStrategy::Pipeline {
        bad(key, format!("{each} are for whole replicas (wrap.strategy = \"ddp\" or \"none\"), not a pipeline's stages; remove it"));
    } else if c.wrap.strategy == WrapStrategy::Fsdp {
        bad(key, format!("{each} are for whole replicas (wrap.strategy = \"ddp\" or \"none\"), not a sharded model's layers (each replica would need the whole model gathered); remove it"));
    } else if c.run.device == crate::config::schema::Device::Cuda {
        bad(key, format!("{each} are for the CPU's threads; on a GPU remove it"));
    } else if matches!(c.wrap.model, Model::Torchscript(_)) {
        bad(key, format!("{each} need layers the runner builds; a TorchScript module cannot be copied to share its weights. Remove it"));
    } else if dropout > 0.0 {
        bad(key, format!("{each} would draw dropout's masks from one generator on two threads, in a different order each run; set the model's dropout to 0 or remove it"));
    } else if matches!(&c.wrap.model, Model::Cnn(m) if m.conv.iter().any(|b| b.batch_norm)) {
        bad(key, format!("{each} would both update batch norm's running statistics; remove it (or batch_norm from the conv blocks)"));
    } else if batch < replicas {
        bad(key, format!("{each} need at least {replicas} rows per batch to split; the rank's batch has {batch}"));
    }
}
