//! `Sharded`: a model's parameters sharded across a process group, FSDP2's design (see
//! csrc/fsdp.cpp). Each rank keeps a dim-0 shard of every parameter (rows padded to a multiple of
//! the world size) and of its gradient; the parameters themselves keep their shapes but hold no
//! memory except while their unit is gathered, around its layers' forward and backward passes.
use std::ffi::c_void;
use std::ptr::NonNull;
use std::time::Duration;

use tch::Tensor;

use super::error::Result;
use super::{check, ffi, ProcessGroup};

/// How a model's parameters group into units and which units each layer reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Units {
    /// Parameters per unit, in module order: unit 0 holds the first `sizes[0]`, and so on.
    pub sizes: Vec<usize>,
    /// For each layer, in forward order, the units its forward reads: its own, and another's
    /// where it shares a parameter (a tied output head reads the embedding's).
    pub layers: Vec<Vec<usize>>,
}

/// What a rank's sharding holds and has spent, since the counters were last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShardStats {
    /// This rank's shards of every parameter, padding included, and of their gradients now.
    pub shard_bytes: u64,
    pub shard_grad_bytes: u64,
    /// The most bytes of gathered parameters (and their all-gather buffer) held at once.
    pub peak_gathered_bytes: u64,
    /// The most bytes of gradients held at once: the shards', the reduce-scatter buffers, and a
    /// parameter's whole gradient while it is copied in.
    pub peak_grad_bytes: u64,
    /// Time blocked waiting for all-gathers and for reduce-scatters, and spent copying.
    pub gather_wait: Duration,
    pub reduce_wait: Duration,
    pub copy: Duration,
    pub gathers: u64,
    pub reduces: u64,
}

/// The sharded parameters of one model on one rank. Every rank of the group makes it from the
/// same shapes and calls its methods in the same order (they run collectives).
///
/// Each training step: for each layer `pre_forward(l)`, the layer's forward, `post_forward(l,
/// output)`; then the loss's backward (which gathers the layers again and reduce-scatters each
/// unit's gradients as they complete), then `finish_backward()`, after which every shard's
/// `.grad` holds its rows of the gradient averaged over the ranks.
pub struct Sharded<'pg> {
    raw: NonNull<ffi::RnFsdp>,
    pg: &'pg ProcessGroup,
    params: usize,
}

// SAFETY: the sharding's state is used by one thread at a time: the rank's own, and the autograd
// engine while that thread waits in backward(). Its collectives are c10d's, callable from any thread.
unsafe impl Send for Sharded<'_> {}
// SAFETY: as above: no two threads call into it at once.
unsafe impl Sync for Sharded<'_> {}

impl<'pg> Sharded<'pg> {
    /// A sharding of `units.sizes.len()` units over `pg`, none sharded yet: [`Sharded::add_unit`]
    /// shards each in turn, so that a model is built and sharded one unit at a time. `zero3`:
    /// free a unit after the forward of the last layer reading it and gather it again for its
    /// backward (ZeRO-3); otherwise keep it gathered from its forward to the end of its backward
    /// (ZeRO-2).
    pub fn new(pg: &'pg ProcessGroup, units: &Units, zero3: bool) -> Result<Sharded<'pg>> {
        let flat: Vec<usize> = units.layers.iter().flatten().copied().collect();
        let counts: Vec<usize> = units.layers.iter().map(Vec::len).collect();
        let mut raw = std::ptr::null_mut();
        // SAFETY: every pointer and length describes a live slice for the call.
        let err = unsafe {
            ffi::rn_fsdp_new(
                pg.raw(),
                units.sizes.len(),
                flat.as_ptr(),
                counts.as_ptr(),
                counts.len(),
                zero3 as i32,
                &mut raw,
            )
        };
        check("fsdp.new", err).map_err(|e| pg.explain(e))?;
        let raw = NonNull::new(raw).expect("rn_fsdp_new succeeded");
        Ok(Sharded { raw, pg, params: 0 })
    }

    /// Shards the next unit, `params` (its parameters in module order, leaves all trainable or all
    /// frozen: a frozen unit gets no gradients and no reduce-scatter):
    /// this rank keeps its rows of each, and the parameters' own memory is freed (they keep
    /// their shapes, and hold memory again only while their unit is gathered).
    pub fn add_unit(&mut self, params: &[Tensor]) -> Result<()> {
        let ptrs: Vec<*mut c_void> = params.iter().map(|p| p.as_ptr() as *mut c_void).collect();
        // SAFETY: the sharding is live; the pointers describe live tensors for the call, and the
        // bridge keeps its own references to them.
        let err = unsafe { ffi::rn_fsdp_add_unit(self.raw(), ptrs.as_ptr(), ptrs.len()) };
        self.result("fsdp.add_unit", err)?;
        self.params += params.len();
        Ok(())
    }

    /// This rank's shard of each parameter, in module order: leaf tensors of the parameter's
    /// shape with `ceil(rows / world)` rows, which the optimizer updates in place.
    pub fn shards(&self) -> Result<Vec<Tensor>> {
        (0..self.params)
            .map(|i| {
                // SAFETY: the sharding is live; the bridge checks `i` and writes `out` on success.
                self.tensor("fsdp.shard", |out| unsafe { ffi::rn_fsdp_shard(self.raw(), i, out) })
            })
            .collect()
    }

    /// Gathers layer `layer`'s units before its forward.
    pub fn pre_forward(&self, layer: usize) -> Result<()> {
        // SAFETY: the sharding is live; the bridge checks the index.
        let err = unsafe { ffi::rn_fsdp_pre_forward(self.raw(), layer) };
        self.result("fsdp.pre_forward (all-gather)", err)
    }

    /// After layer `layer`'s forward produced `output`: hooks its backward, frees what is done.
    pub fn post_forward(&self, layer: usize, output: &Tensor) -> Result<()> {
        // SAFETY: the sharding and `output` are live for the call; the hook the bridge registers
        // holds its own reference to the sharding, which outlives every backward pass (the model
        // owns both).
        let err = unsafe { ffi::rn_fsdp_post_forward(self.raw(), layer, output.as_ptr() as *mut c_void) };
        self.result("fsdp.post_forward", err)
    }

    /// After a backward pass: every unit's averaged gradient rows in its shards' `.grad`.
    pub fn finish_backward(&self) -> Result<()> {
        // SAFETY: the sharding is live.
        let err = unsafe { ffi::rn_fsdp_finish_backward(self.raw()) };
        self.result("fsdp.finish_backward (reduce-scatter)", err)
    }

    /// Parameter `i` (module order) whole, all-gathered from the shards, on every rank.
    pub fn full(&self, i: usize) -> Result<Tensor> {
        // SAFETY: the sharding is live; the bridge checks `i` and writes `out` on success.
        self.tensor("fsdp.full (all-gather)", |out| unsafe { ffi::rn_fsdp_full(self.raw(), i, out) })
    }

    /// The counters; `reset` restarts the peaks (from what is held now) and the times.
    pub fn stats(&self, reset: bool) -> Result<ShardStats> {
        let mut s = ffi::RnFsdpStats::default();
        // SAFETY: the sharding is live; valid out-pointer.
        check("fsdp.stats", unsafe { ffi::rn_fsdp_read_stats(self.raw(), reset as i32, &mut s) })?;
        let bytes = |b: i64| b.max(0) as u64;
        let time = |ns: i64| Duration::from_nanos(ns.max(0) as u64);
        Ok(ShardStats {
            shard_bytes: bytes(s.shard_bytes),
            shard_grad_bytes: bytes(s.shard_grad_bytes),
            peak_gathered_bytes: bytes(s.peak_gathered_bytes),
            peak_grad_bytes: bytes(s.peak_grad_bytes),
            gather_wait: time(s.gather_wait_ns),
            reduce_wait: time(s.reduce_wait_ns),
            copy: time(s.copy_ns),
            gathers: bytes(s.gathers),
            reduces: bytes(s.reduces),
        })
    }

    fn raw(&self) -> *mut ffi::RnFsdp {
        self.raw.as_ptr()
    }

    fn result(&self, op: &str, err: *mut std::ffi::c_char) -> Result<()> {
        check(op, err).map_err(|e| self.pg.explain(e))
    }

    /// A tensor the bridge makes through `call` (which writes a new `at::Tensor*`).
    fn tensor(&self, op: &str, call: impl FnOnce(*mut *mut c_void) -> *mut std::ffi::c_char) -> Result<Tensor> {
        let mut out = std::ptr::null_mut();
        self.result(op, call(&mut out))?;
        // SAFETY: on success the bridge allocated `out` with `new at::Tensor`, what tch's handles are.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }
}

impl Drop for Sharded<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle is live and dropped exactly once.
        unsafe { ffi::rn_fsdp_free(self.raw.as_ptr()) }
    }
}
