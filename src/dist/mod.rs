//! PyTorch's collective engine, c10d, from Rust: the only module with `unsafe` code.
//!
//! - [`Store`]: the TCPStore rendezvous (a server on a socket the caller bound, or a client);
//! - [`ProcessGroup`]: Gloo (or NCCL) collectives on `tch` tensors, each bounded by a timeout;
//! - [`Ddp`]: c10d's Reducer, DistributedDataParallel's bucketed gradient averaging;
//! - [`fused_adam`], [`sgd`], [`set_autocast_dtype`]: libtorch functions that tch does not expose.
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
mod ddp;
mod error;
mod ffi;
mod kernels;
mod process_group;
mod store;

pub use ddp::{Ddp, ReducerTimes};
pub use error::{Error, PeerExit, Result};
pub use kernels::{clear_grads, fused_adam, set_autocast_dtype, sgd, AdamConfig, AutocastBf16, SgdConfig};
pub use process_group::{record_exit, Backend, Pending, ProcessGroup, ReduceOp};
pub use store::Store;

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
