//! Where a rank's tensors live: `run.device` and `run.backend` checked against this build and this
//! machine (on the plan, before any rank starts), the device of each rank (`cuda:LOCAL_RANK`),
//! and the clock of a training step's phases ([`clock`]: CUDA events on a GPU, never a wait).
//!
//! What torch does with the mixed pairs, and what the runner does with them:
//! - `backend = "nccl"` with `device = "cpu"`: torch creates the group and fails its first
//!   collective ("Tensors must be CUDA and dense"); the runner refuses it on the plan, with that
//!   reason.
//! - `backend = "gloo"` with `device = "cuda"`: torch runs it (gloo's all-reduce, broadcast and
//!   all-gather take CUDA tensors, through host memory); so does the runner, whose process group
//!   also sends and receives CUDA tensors over gloo through host memory (torch's gloo has no GPU
//!   send/recv).
use std::time::Instant;

pub mod clock;
pub use clock::{Mark, Pending, Span};

use crate::config::schema::{Backend, Device};

/// How to build the runner with CUDA, for the messages that need it.
pub const BUILD_CUDA: &str = "./scripts/setup.sh --cuda && LIBTORCH=$PWD/.deps/libtorch-cuda \
                              cargo build --release --features cuda --target-dir target/cuda";

/// Problems with the pair `run.device` and `run.backend` on any machine, as (key, message).
pub fn refusals(backend: Backend, device: Device) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if backend == Backend::Nccl && device == Device::Cpu {
        out.push((
            "run.backend",
            "nccl moves GPU memory only (torch fails its first collective on CPU tensors: \"Tensors must be \
             CUDA and dense\"); use \"gloo\" with device = \"cpu\", or device = \"cuda\""
                .to_string(),
        ));
    }
    out
}

/// Problems with `run.device` and `run.backend` in this build on this machine (a plan for another
/// machine, `runner validate --device`, leaves them to that machine), as (key, message).
pub fn refusals_here(backend: Backend, device: Device) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if !cfg!(feature = "cuda") {
        let without = "this runner was built without CUDA";
        if device == Device::Cuda {
            out.push(("run.device", format!("{without}; build the CUDA version ({BUILD_CUDA}), or use \"cpu\"")));
        }
        if backend == Backend::Nccl && device == Device::Cuda {
            out.push(("run.backend", format!("{without}, so without NCCL; build the CUDA version ({BUILD_CUDA})")));
        }
    } else if device == Device::Cuda {
        let found = cuda_device_count();
        if found == 0 {
            out.push((
                "run.device",
                "\"cuda\" was asked, but libtorch sees 0 CUDA devices on this machine; run on a machine with \
                 an NVIDIA GPU and its driver (nvidia-smi lists the GPUs; CUDA_VISIBLE_DEVICES must not hide \
                 them), or use \"cpu\""
                    .to_string(),
            ));
        }
    }
    out
}

/// The CUDA devices libtorch sees (0 in a build without CUDA).
pub fn cuda_device_count() -> usize {
    tch::Cuda::device_count().max(0) as usize
}

/// The device of the rank that is `local_rank` on its node: `cuda:LOCAL_RANK` on GPUs.
pub fn of_rank(device: Device, local_rank: usize) -> tch::Device {
    match device {
        Device::Cpu => tch::Device::Cpu,
        Device::Cuda => tch::Device::Cuda(local_rank),
    }
}

/// Checks, where a rank starts, that its device exists: one GPU per rank of the node.
pub fn check_rank(device: tch::Device) -> anyhow::Result<()> {
    if let tch::Device::Cuda(index) = device {
        let found = cuda_device_count();
        if index >= found {
            anyhow::bail!(
                "this rank needs cuda:{index} (one GPU per rank of the node, by LOCAL_RANK), but libtorch sees \
                 {found} CUDA device(s) here; start at most {found} rank(s) on this node"
            );
        }
    }
    Ok(())
}

/// Waits for the device's queued work (a no-op on the CPU): CUDA kernels run asynchronously, so a
/// clock read without it measures the launch, not the work.
pub fn synchronize(device: tch::Device) {
    if let tch::Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

/// The time once the device's queued work is done: what step timings read.
pub fn now(device: tch::Device) -> Instant {
    synchronize(device);
    Instant::now()
}

/// The time since `since`, once the device's queued work is done.
pub fn elapsed(device: tch::Device, since: Instant) -> std::time::Duration {
    synchronize(device);
    since.elapsed()
}

/// The clock of one training step's phases (batch, forward, loss, backward, update): its marks
/// never wait for the device ([`clock`]). `traced`: the step trace records this step's phases.
#[derive(Debug, Clone, Copy)]
pub struct StepClock {
    device: tch::Device,
    traced: bool,
}

impl StepClock {
    pub fn new(device: tch::Device, traced: bool) -> StepClock {
        StepClock { device, traced }
    }

    pub fn traced(&self) -> bool {
        self.traced
    }

    pub fn mark(&self) -> Mark {
        clock::mark(self.device)
    }

    /// The span from `since` to now.
    pub fn since(&self, since: &Mark) -> Span {
        Span::between(since, &self.mark())
    }
}

/// What libtorch sees of the GPUs, printed under the plan of a run on `cuda`: the libtorch the
/// runner loaded, then each device's name, compute capability, memory and multiprocessors
/// (torch.cuda.get_device_properties). Nothing on the CPU.
pub fn notes(device: Device) -> Vec<String> {
    if device != Device::Cuda {
        return Vec::new();
    }
    let count = cuda_device_count();
    let mut lines = vec![format!(
        "  cuda: libtorch {} sees {count} GPU(s){}",
        env!("RUNNER_LIBTORCH_VERSION"),
        if tch::Cuda::cudnn_is_available() { ", cuDNN available" } else { "" }
    )];
    for index in 0..count {
        lines.push(match crate::dist::cuda_device(index) {
            Ok(d) => format!(
                "    cuda:{index}  {}  compute capability {}.{}, {}, {} multiprocessors",
                d.name,
                d.capability.0,
                d.capability.1,
                crate::limits::size(d.total_bytes as f64),
                d.multiprocessors
            ),
            Err(e) => format!("    cuda:{index}  (its properties could not be read: {e})"),
        });
    }
    lines
}

/// Rank 0's line at the end of a run on a GPU: the most its tensors held at once and the most the
/// caching allocator reserved (torch.cuda.max_memory_allocated / max_memory_reserved), beside the
/// plan's estimate of both (`plan::device_memory`, as the plan words it). `None` on the CPU.
pub fn peak_line(device: tch::Device, estimate: Option<String>) -> Option<String> {
    let tch::Device::Cuda(index) = device else {
        return None;
    };
    let size = |b: f64| crate::limits::size(b);
    Some(match crate::dist::cuda_peak_memory(index) {
        Ok(peak) => format!(
            "  peak GPU memory on cuda:{index} (rank 0): {} allocated, {} reserved by libtorch's caching allocator{}",
            size(peak.allocated as f64),
            size(peak.reserved as f64),
            estimate.map(|e| format!("; the plan estimated {e}")).unwrap_or_default()
        ),
        Err(e) => format!("  peak GPU memory on cuda:{index}: not read ({e})"),
    })
}
