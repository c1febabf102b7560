//! PyTorch's collective engine, c10d, from Rust: the only module with `unsafe` code.
//!
//! - [`Store`]: the TCPStore rendezvous (a server on a socket the caller bound, or a client);
//! - [`ProcessGroup`]: Gloo (or NCCL) collectives on `tch` tensors, each bounded by a timeout;
//! - [`Ddp`]: c10d's Reducer, DistributedDataParallel's bucketed gradient averaging;
//! - [`Sharded`]: a model's parameters sharded across the ranks (FSDP2's design);
//! - [`checkpoint`]: a segment recomputed in the backward pass (activation checkpointing);
//! - [`Script`]: a TorchScript module with its parameters and buffers (tch lists no buffers);
//! - [`adam`], [`sgd`], [`set_autocast_dtype`]: libtorch functions that tch does not expose;
//! - [`memory`]: the allocator of a rank's tensors, which reuses freed memory as it is;
//! - [`mkl`]: MKL's code branch in this process (`run.numerics`).
//!
//! Failures come back as [`Error`], naming the operation and, where known, the peer that left.
//!
//! ```no_run
//! use std::{net::TcpListener, sync::Arc, time::Duration};
//! use runner::dist::{Backend, ProcessGroup, ReduceOp, Store};
//! # fn main() -> runner::dist::Result<()> {
//! let timeout = Duration::from_secs(30);
//! // Rank 0 of 1: the server takes a loopback socket with an OS-chosen port.
//! let listener = TcpListener::bind("127.0.0.1:0").unwrap();
//! let store = Arc::new(Store::serve(listener, 1, timeout)?);
//! let pg = ProcessGroup::new(Backend::Gloo, store, 0, 1, "127.0.0.1", timeout)?;
//! let mut t = tch::Tensor::from_slice(&[1.0f32, 2.0]);
//! pg.all_reduce(&mut t, ReduceOp::Sum)?;
//! # Ok(()) }
//! ```
mod checkpoint;
mod cuda;
mod ddp;
mod error;
mod ffi;
mod fsdp;
mod kernels;
pub mod memory;
pub mod mkl;
mod process_group;
mod script;
mod store;

pub use checkpoint::{checkpoint, checkpoint_linear, recompute_time};
pub use cuda::{cuda_device, cuda_peak_memory, use_side_stream, CudaDevice, CudaEvent, CudaGraph, CudaPeak};
pub use ddp::{Ddp, ReducerTimes};
pub use error::{Error, PeerExit, Result};
pub use fsdp::{ShardStats, Sharded, Units};
pub use kernels::{
    adam, clear_grads, cpu_kernels, set_autocast_dtype, sgd, AdamConfig, AutocastBf16, CpuKernels, SgdConfig,
};
pub use process_group::{record_exit, Backend, Pending, ProcessGroup, ReduceOp, Sent};
pub use script::Script;
pub use store::Store;

/// This process's peak resident memory so far, in bytes (getrusage's ru_maxrss; 0 where it
/// cannot be read).
pub fn peak_resident_bytes() -> u64 {
    let mut usage = std::mem::MaybeUninit::<nix::libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole rusage into the pointer given, which has room for one.
    let ok = unsafe { nix::libc::getrusage(nix::libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0;
    if !ok {
        return 0;
    }
    // SAFETY: initialised by the successful call above (and zeroed before it).
    let usage = unsafe { usage.assume_init() };
    // Linux counts it in KiB.
    usage.ru_maxrss.max(0) as u64 * 1024
}

/// Ends the process with `code` once stdout and stderr are flushed, skipping static destructors:
/// libtorch's deregister every operator one by one, about 0.1 s per process spent on nothing.
/// Call it only when everything the process writes is written (files are closed by then).
pub fn exit_now(code: u8) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process; every file this program writes is complete before this.
    unsafe { nix::libc::_exit(code as i32) }
}

/// Turns a bridge return value (NULL or a malloc'd message) into a `Result`.
fn check(op: &str, err: *mut std::ffi::c_char) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-NULL return is a NUL-terminated string from the bridge's malloc.
    let message = unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned();
    // SAFETY: freed once, by the allocator that made it.
    unsafe { ffi::rn_free_string(err) };
    Err(Error::new(op, message))
}
