//! The memory of a rank's tensors (csrc/memory.cpp). A training step allocates and frees the
//! same tensors every time; how the freed memory is kept decides what a rank holds:
//!
//! - handed back to the kernel on free (glibc's default above 128 KiB), the pages fault in and
//!   are zeroed again every step: on this VM, a 25M-parameter transformer's FSDP step took twice
//!   as long with a 1 MiB mmap threshold;
//! - kept in glibc's heap (an mmap threshold of 32 MiB and a trim threshold of 1 GiB, the
//!   runner's setting until now), the heap fragments: freed blocks lie between long-lived ones
//!   and new requests do not fit them, so the heap grows past what is in use. Measured with
//!   `mallinfo2` on `pipelines/large_model_fsdp.toml` (100M parameters, FSDP at 4 ranks): 1.15 to
//!   1.5 GiB of heap for 440 MiB in use, after building the model one unit at a time; on a
//!   25M-parameter transformer at 2 ranks, 550 MiB of heap for at most 320 MiB in use;
//! - cached by size and reused as they are ([`install`]): the same 100M run holds at most 570
//!   MiB of tensor blocks for 543 MiB in use at its peak, and its peak resident size falls from
//!   1.45-1.6 GiB to 780 MiB, at the same step time.
//!
//! The loop marks its phases ([`phase`]): a phase's first requests may take back what an earlier
//! phase left (blocks of sizes the training step does not use).
use super::{check, ffi};

/// Makes this process's tensors of 1 MiB or more come from a cache of blocks reused by size
/// (blocks a phase has not used go back to the kernel when the phase needs new ones), and sets
/// glibc for the smaller ones: an mmap threshold of 32 MiB and a trim threshold of 1 GiB, so
/// that they too are reused rather than faulted in again every step (about a thousand page
/// faults per step of the baby GPT, 2% of its samples under perf, with glibc's default). Call
/// it before the tensors it should serve are made.
pub fn install() -> super::Result<()> {
    // SAFETY: mallopt only sets glibc's allocator parameters, under the allocator's own lock;
    // the values are in the ranges glibc documents (a rejected value leaves the default).
    unsafe {
        nix::libc::mallopt(nix::libc::M_MMAP_THRESHOLD, 32 << 20);
        nix::libc::mallopt(nix::libc::M_TRIM_THRESHOLD, 1 << 30);
        nix::libc::mallopt(nix::libc::M_TOP_PAD, 64 << 20);
    }
    // SAFETY: no arguments; the bridge catches any exception.
    check("memory.install", unsafe { ffi::rn_memory_install() })
}

/// Marks the start of a phase of the run: a training step, a validation, a checkpoint.
pub fn phase() {
    // SAFETY: no arguments; it only increments a counter under the cache's lock.
    unsafe { ffi::rn_memory_phase() }
}

/// The cache's counters, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// In tensors now, cached for reuse, mapped (the two together).
    pub used: u64,
    pub cached: u64,
    pub mapped: u64,
    /// The most in tensors, and mapped, at once.
    pub peak_used: u64,
    pub peak_mapped: u64,
    /// Blocks mapped and given back so far.
    pub maps: u64,
    pub unmaps: u64,
}

pub fn stats() -> super::Result<Stats> {
    let mut s = ffi::RnMemoryStats::default();
    // SAFETY: a valid out-pointer.
    check("memory.stats", unsafe { ffi::rn_memory_read_stats(&mut s) })?;
    let n = |v: i64| v.max(0) as u64;
    Ok(Stats {
        used: n(s.used_bytes),
        cached: n(s.cached_bytes),
        mapped: n(s.mapped_bytes),
        peak_used: n(s.peak_used_bytes),
        peak_mapped: n(s.peak_mapped_bytes),
        maps: n(s.maps),
        unmaps: n(s.unmaps),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn freed_blocks_are_reused_as_they_are_and_a_new_phase_gives_back_what_it_does_not_use() {
        // The cache is this test process's from here on (other tests may allocate at the same
        // time: only what this test's own sizes show is asserted).
        install().unwrap();
        let mib = |n: i64| Tensor::zeros([n * 262_144 + 7], (Kind::Float, tch::Device::Cpu));
        let a = mib(37);
        let at = a.data_ptr();
        drop(a);
        // The next request of the size takes the block the first one freed.
        let b = mib(37);
        assert_eq!(b.data_ptr(), at);
        drop(b);
        // A new phase: a request of another size first gives back blocks the phase has not used.
        let before = stats().unwrap();
        phase();
        let c = mib(41);
        let after = stats().unwrap();
        assert!(after.unmaps > before.unmaps && after.maps > before.maps, "{before:?} {after:?}");
        assert!(after.peak_mapped >= after.mapped && after.mapped >= after.used, "{after:?}");
        drop(c);
    }
}
