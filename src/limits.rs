//! Bounds on the values the plan accepts, so that no configuration reaches a panic, an abort or
//! an out-of-memory kill: timeouts within a sane range, sizes within what the arithmetic and
//! libtorch take, and a memory estimate of the whole run checked against the memory this
//! machine has available (`RUNNER_NO_MEMORY_CHECK=1` skips that last one).
use crate::config::schema::Config;
use crate::data::DataSpec;

/// `run.timeout_s` range: a collective needs some time; a week is beyond any real run.
pub const TIMEOUT_S: (f64, f64) = (0.1, 7.0 * 86400.0);
/// `run.abort_after_s` range.
pub const ABORT_AFTER_S: (f64, f64) = (0.0, 86400.0);
/// Widths (features, hidden layers, classes): products of two stay far from overflow.
pub const MAX_WIDTH: usize = 1 << 24;
pub const MAX_LAYERS: usize = 4096;
pub const MAX_ROWS: usize = 1 << 40;
pub const MAX_WORLD_SIZE: usize = 1 << 16;
pub const MAX_EPOCHS: usize = 1 << 24;
/// `run.max_restarts`: a run that fails this often is not going to finish.
pub const MAX_RESTARTS: usize = 1000;
/// The environment variable that turns the memory estimate off.
pub const NO_MEMORY_CHECK: &str = "RUNNER_NO_MEMORY_CHECK";

/// Timeouts, world size, epochs, threads.
pub fn run_values(c: &Config, bad: &mut impl FnMut(&str, String)) {
    let r = &c.run;
    for (key, v, (lo, hi)) in [
        ("run.timeout_s", r.timeout_s, TIMEOUT_S),
        ("run.abort_after_s", r.abort_after_s, ABORT_AFTER_S),
        ("run.rejoin_timeout_s", r.rejoin_timeout_s, TIMEOUT_S),
    ] {
        if !(v >= lo && v <= hi) {
            bad(key, format!("must be between {lo} and {hi} seconds, got {v}"));
        }
    }
    if let Some(v) = r.step_timeout_s.filter(|v| !(*v >= TIMEOUT_S.0 && *v <= TIMEOUT_S.1)) {
        bad("run.step_timeout_s", format!("must be between {} and {} seconds, got {v}", TIMEOUT_S.0, TIMEOUT_S.1));
    }
    if r.world_size > MAX_WORLD_SIZE {
        bad("run.world_size", format!("must be at most {MAX_WORLD_SIZE}, got {}", r.world_size));
    }
    if r.max_restarts > MAX_RESTARTS {
        bad("run.max_restarts", format!("must be at most {MAX_RESTARTS}, got {}", r.max_restarts));
    }
    if r.threads_per_rank.is_some_and(|t| t > 1024) {
        bad("run.threads_per_rank", format!("must be at most 1024, got {}", r.threads_per_rank.unwrap_or(0)));
    }
    if c.train.epochs > MAX_EPOCHS {
        bad("train.epochs", format!("must be at most {MAX_EPOCHS}, got {}", c.train.epochs));
    }
    if !c.wrap.bucket_cap_mb.is_finite() || c.wrap.bucket_cap_mb > 1e6 {
        bad("wrap.bucket_cap_mb", format!("must be at most 1000000 MiB, got {}", c.wrap.bucket_cap_mb));
    }
    if !c.load.noise.is_finite() {
        bad("load.noise", format!("must be finite, got {}", c.load.noise));
    }
}

/// Whether the data's and the model's sizes are within the bounds (each out of bounds is
/// reported); the plan computes no shape from sizes that are not.
pub fn sizes(c: &Config, d: &DataSpec, bad: &mut impl FnMut(&str, String)) -> bool {
    let mut ok = true;
    let mut check = |key: &str, v: usize, max: usize| {
        if v > max {
            bad(key, format!("{v} is more than the {max} the runner takes"));
            ok = false;
        }
    };
    check("load.rows", d.rows, MAX_ROWS);
    check("load.validation_rows", d.validation_rows, MAX_ROWS);
    check("load.features", d.input.iter().fold(1usize, |a, &x| a.saturating_mul(x)), MAX_WIDTH);
    check("load.classes", d.task.outputs(), MAX_WIDTH);
    check("train.batch_size", c.train.batch_size, MAX_ROWS);
    ok
}

/// Bytes one rank needs, by part: an estimate, not a measurement.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Estimate {
    /// The training state: parameters, gradients and optimizer state as the strategy holds them.
    pub model: f64,
    pub activations: f64,
    pub data: f64,
    /// libtorch, gloo and the runner themselves.
    pub base: f64,
}

/// The resident memory of a rank that holds no model and no data: libtorch's and the runner's
/// code and their allocators' pools. Measured with a release build on x86-64 Linux: 140 MiB, and
/// on rank 0, once it has written the trace (polars' parquet writer), 157 MiB. (A debug build's
/// own code adds about 28 MiB: the tests allow for it.)
pub const BASE_BYTES: f64 = 150.0 * 1048576.0;

/// CUDA's libraries and context in a rank's resident host memory: the GPT-2-sized run on an H200
/// peaked at 1.71 GiB on the host, libtorch's code and the data about 0.2 GiB of it (docs/gpus.md).
pub const CUDA_HOST_BYTES: f64 = 1.5 * 1073741824.0;

impl Estimate {
    pub fn per_rank(&self) -> f64 {
        self.model + self.activations + self.data + self.base
    }

    /// The part in the host's memory: all of it on the CPU; on a GPU the data, libtorch and
    /// CUDA's libraries, while the training state and the activations are on the device
    /// (`plan::device_memory`).
    pub fn on_host(&self, device: crate::config::schema::Device) -> Estimate {
        match device {
            crate::config::schema::Device::Cpu => *self,
            crate::config::schema::Device::Cuda => {
                Estimate { model: 0.0, activations: 0.0, base: self.base + CUDA_HOST_BYTES, ..*self }
            }
        }
    }
}

/// What one rank holds: `state` bytes of training state (parameters, gradients and optimizer
/// state under its strategy: `plan::memory`), a batch of `batch` rows whose activations hold
/// `values_per_sample` values (the input and every layer's output) and `held_per_sample` more
/// inside the layers for the backward pass, and the whole data set (every rank loads it, then
/// shards).
pub fn estimate(
    c: &Config,
    d: &DataSpec,
    state: f64,
    values_per_sample: usize,
    held_per_sample: usize,
    batch: usize,
) -> Estimate {
    const F: f64 = 4.0; // float32
    let model = state;
    let widths = values_per_sample as f64;
    // Each layer's output, its pre-activation and its gradient, for a training batch and for
    // the validation rows evaluated at once; in training, what the layers keep inside them and
    // its gradient too.
    let activations =
        3.0 * F * widths * (batch as f64 + d.validation_rows as f64) + 2.0 * F * held_per_sample as f64 * batch as f64;
    // The rows as the rank holds them (in memory once, or only the labels of data read where it
    // lies), an epoch's shard gathered and normalised (rows in memory), and a csv or parquet
    // file's table while it is encoded.
    let resident = d.resident_bytes();
    let shard = match &d.source {
        crate::data::SourceSpec::Synthetic(_) | crate::data::SourceSpec::Table(_) => {
            2.0 * F * (d.rows as f64 / c.run.world_size.max(1) as f64).ceil() * (d.input_size() as f64 + 1.0)
        }
        crate::data::SourceSpec::Tensors(t) if t.train.labels.is_none() => {
            2.0 * F * (d.rows as f64 / c.run.world_size.max(1) as f64).ceil() * (d.input_size() as f64 + 1.0)
        }
        _ => 0.0,
    };
    let file = d.file().and_then(|f| std::fs::metadata(&f.path).ok()).map_or(0.0, |m| m.len() as f64);
    Estimate { model, activations, data: resident + shard + file, base: BASE_BYTES }
}

impl std::fmt::Display for Estimate {
    /// "1.02 GiB per rank (model, gradients and optimizer state 480 MiB, activations 410 MiB, ...)".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} per rank (parameters, gradients and optimizer state {}, activations {}, data {}, libtorch {})",
            size(self.per_rank()),
            size(self.model),
            size(self.activations),
            size(self.data),
            size(self.base)
        )
    }
}

/// Bytes in GiB from 1 GiB up, in MiB below.
pub fn size(bytes: f64) -> String {
    let mib = bytes / (1u64 << 20) as f64;
    if mib >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else if mib >= 10.0 {
        format!("{mib:.0} MiB")
    } else {
        format!("{mib:.1} MiB")
    }
}

fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

/// Bytes of memory available on this machine (MemAvailable), when it can be read.
pub fn available_memory() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0)
}

/// Why `ranks` ranks of `e` do not fit in `available` bytes.
pub fn memory(e: &Estimate, ranks: usize, available: f64) -> Option<String> {
    let total = e.per_rank() * ranks as f64;
    if total <= available {
        return None;
    }
    Some(format!(
        "the run needs about {:.1} GiB ({ranks} ranks × {}) but this machine has {:.1} GiB available; use a \
         smaller model or data set, fewer ranks, or set {NO_MEMORY_CHECK}=1 to run anyway",
        gib(total),
        e,
        gib(available)
    ))
}

/// The memory check as the plan runs it: skipped when turned off or unknowable.
/// `model_key`: the key that sizes the model (`wrap.model.hidden` for an MLP).
pub fn check_memory(e: &Estimate, ranks: usize, model_key: &str, bad: &mut impl FnMut(&str, String)) {
    if std::env::var(NO_MEMORY_CHECK).is_ok_and(|v| v == "1") {
        return;
    }
    if let Some(msg) = available_memory().and_then(|a| memory(e, ranks, a)) {
        // The key of the largest part.
        let key = if e.model >= e.data.max(e.activations) {
            model_key
        } else if e.data >= e.activations {
            "load.rows"
        } else {
            "train.batch_size"
        };
        bad(key, msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_counts_every_part_and_refuses_what_does_not_fit() {
        let e = Estimate { model: 1e9, activations: 1e8, data: 2e8, base: 1e8 };
        assert_eq!(e.per_rank(), 1.4e9);
        assert!(memory(&e, 2, 3e9).is_none());
        let msg = memory(&e, 4, 3e9).unwrap();
        assert!(msg.contains("4 ranks") && msg.contains("2.8 GiB available"), "{msg}");
    }

    #[test]
    fn on_a_gpu_the_host_holds_neither_the_training_state_nor_the_activations() {
        use crate::config::schema::Device;
        let e = Estimate { model: 2e9, activations: 8.6e10, data: 2e8, base: 1.5e8 };
        assert_eq!(e.on_host(Device::Cpu), e);
        let host = e.on_host(Device::Cuda);
        assert_eq!(host.per_rank(), 2e8 + 1.5e8 + CUDA_HOST_BYTES);
        // 88 GiB of a GPU run at batch 64 does not refuse it on a host with 64 GiB available.
        assert!(memory(&e, 1, 64.0 * 1073741824.0).is_some());
        assert!(memory(&host, 1, 64.0 * 1073741824.0).is_none());
    }
}
