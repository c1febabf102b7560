//! `[run]`: the run's name, seed, world size, device, numerics, timeouts and supervision.
use super::*;

/// `[run]`: the processes, their seed, time limits and numerics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Run {
    /// Names the run directory: results/<name>/<run-id>/.
    pub name: String,
    /// Seeds data generation, shuffling and initial weights.
    pub seed: u64,
    /// Number of ranks (processes).
    pub world_size: usize,
    /// The collective engine: "gloo" (CPU, and CUDA tensors through host memory) or "nccl"
    /// (GPUs; the CUDA build only).
    pub backend: Backend,
    /// Where a rank computes: "cpu", or "cuda" (rank r on cuda:LOCAL_RANK; the CUDA build only).
    pub device: Device,
    /// Intra-op threads per rank; default: cores / world_size, at least 1, or 1 under
    /// `run.numerics = "portable"` (the thread count splits sums, so the machine must not choose it).
    pub threads_per_rank: Option<usize>,
    /// Seconds any collective or rendezvous may take before the run fails.
    pub timeout_s: f64,
    /// Seconds the launcher lets the other ranks wind down after one fails, before killing them.
    pub abort_after_s: f64,
    /// Seconds a rank may take over one training step before the launcher ends the run, naming
    /// the rank and the step; absent: 10 × the slowest step so far, and at least `timeout_s`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_timeout_s: Option<f64>,
    /// MiB of memory one rank may use: the plan's whole-process estimate, its training state
    /// (parameters, their gradients and the optimizer's state, as the strategy holds them: whole
    /// under DDP, a stage's under a pipeline, shards plus the layers gathered at once under FSDP)
    /// and what it needs besides (activations, data, libtorch), checked on the plan, which names
    /// the strategies and world sizes that fit; `wrap.strategy = "auto"` chooses by it. Where a
    /// transformer's rank does not fit and wrap.activation_checkpointing is left out, the plan
    /// turns checkpointing on (the fewest blocks that fit) before any other way, and says so.
    /// Absent: unchecked (the plan still checks the whole estimate against this machine's memory).
    pub memory_per_rank_mb: Option<f64>,
    /// The peak matrix-product rate of one rank's device, in TFLOP/s, over which a transformer's
    /// model FLOPs utilisation (MFU: its training FLOPs per second over this peak) is reported in
    /// the trace and the progress line. Absent: on CPU, measured when the rank starts (square
    /// matrix products on the rank's threads in the run's precision, about 0.25 s); on CUDA, the
    /// dense rate of the GPU's model from the runner's table (H100, H200, B200, A100, L40S, L4),
    /// no MFU for a GPU it does not list. Between 0.001 and 1000000. Changes no result: the run id
    /// leaves it out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
    /// Replays each training step's forward and backward passes as one CUDA graph, as
    /// torch.compile's mode = "reduce-overhead" does: three eager steps warm up, the fourth is
    /// captured, and every later step is one replay of it (its kernels launched at once, no host
    /// work between them); the optimizer step runs after it, as without. CUDA only; refused on the
    /// plan where a step cannot be replayed (collectives in the step, dropout, varying batch
    /// shapes, gradient accumulation, activation checkpointing). Changes no result: the run id
    /// leaves it out.
    #[serde(skip_serializing_if = "is_default")]
    pub cuda_graphs: bool,
    /// The signal that preempts the run: every rank finishes its step, a checkpoint is written
    /// at that step, the manifest says `preempted`, and under Slurm the job requeues itself and
    /// resumes there. `#SBATCH --signal=USR1@90` sends SIGUSR1 90 s before the time limit;
    /// submitit uses USR2.
    #[serde(skip_serializing_if = "is_default")]
    pub preempt_signal: PreemptSignal,
    /// Times the launcher starts every rank again after a rank fails (a non-zero exit, a signal,
    /// a stalled step, a lost peer), each time from the newest checkpoint (from the start when
    /// there is none yet). A failure that repeats at the same step with the same cause is not
    /// retried. 0 (the default, as torchrun's --max-restarts): a failure ends the run.
    #[serde(skip_serializing_if = "is_default")]
    pub max_restarts: usize,
    /// With `--nnodes MIN:MAX`: seconds the nodes left wait for a lost node to come back before
    /// they go on without it (at least MIN nodes), from the newest checkpoint at the smaller
    /// world size.
    #[serde(skip_serializing_if = "is_default_rejoin")]
    pub rejoin_timeout_s: f64,
    /// The numerical path of libtorch's CPU kernels: "native" (the default: this CPU's own
    /// kernels, as PyTorch runs; the same bits on the same CPU model) or "portable" (the same bits
    /// on any x86-64 CPU with AVX2: MKL_CBWR=COMPATIBLE, ATen's AVX2 kernels, oneDNN and NNPACK
    /// off, 1 thread per rank unless run.threads_per_rank says; about 2x slower on compute-bound
    /// runs; for results committed and checked on other machines). An MKL_CBWR set in the
    /// environment wins; ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA are overridden under portable.
    // Stored configurations (plan.json, the bytes of the run id) leave "portable" out, as they did
    // while it was the default: runs made then keep their ids and their plan.json still reads as
    // portable. A pipeline file without the key resolves to native (config::resolve's defaults).
    #[serde(default = "CpuNumerics::stored", skip_serializing_if = "CpuNumerics::leaves_out")]
    #[schemars(default = "CpuNumerics::default")]
    pub numerics: CpuNumerics,
}

/// `run.numerics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CpuNumerics {
    /// The same bits on any x86-64 CPU with AVX2: every kernel family pinned (MKL's COMPATIBLE
    /// branch, ATen's AVX2 kernels, oneDNN and NNPACK off) and a fixed thread count.
    Portable,
    /// This CPU's own kernels: faster; the same bits on the same CPU model only.
    #[default]
    Native,
}

impl CpuNumerics {
    /// What a stored configuration without the key computed under.
    pub fn stored() -> CpuNumerics {
        CpuNumerics::Portable
    }

    fn leaves_out(&self) -> bool {
        skip(*self == CpuNumerics::stored())
    }
}

/// `run.rejoin_timeout_s`'s default: torchrun's last call for nodes of an elastic rendezvous.
pub(super) const REJOIN_TIMEOUT_S: f64 = 30.0;

fn is_default_rejoin(v: &f64) -> bool {
    skip(*v == REJOIN_TIMEOUT_S)
}

/// A signal a job scheduler sends before it stops a job (`run.preempt_signal`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PreemptSignal {
    /// SIGUSR1 (Slurm's `--signal=USR1@SECONDS`).
    #[default]
    #[serde(rename = "USR1", alias = "SIGUSR1")]
    Usr1,
    /// SIGUSR2 (submitit's choice).
    #[serde(rename = "USR2", alias = "SIGUSR2")]
    Usr2,
}

impl PreemptSignal {
    /// The signal's number.
    pub fn number(self) -> i32 {
        match self {
            PreemptSignal::Usr1 => signal_hook::consts::SIGUSR1,
            PreemptSignal::Usr2 => signal_hook::consts::SIGUSR2,
        }
    }

    /// Its name as Slurm's `--signal` takes it.
    pub fn name(self) -> &'static str {
        match self {
            PreemptSignal::Usr1 => "USR1",
            PreemptSignal::Usr2 => "USR2",
        }
    }
}

impl Default for Run {
    fn default() -> Self {
        Run {
            name: "run".into(),
            seed: 0,
            world_size: 1,
            backend: Backend::Gloo,
            device: Device::Cpu,
            threads_per_rank: None,
            timeout_s: 60.0,
            abort_after_s: 5.0,
            step_timeout_s: None,
            memory_per_rank_mb: None,
            peak_tflops: None,
            cuda_graphs: false,
            preempt_signal: PreemptSignal::Usr1,
            max_restarts: 0,
            rejoin_timeout_s: REJOIN_TIMEOUT_S,
            numerics: CpuNumerics::Native,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Gloo,
    Nccl,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Cuda,
}
