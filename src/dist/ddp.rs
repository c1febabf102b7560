//! `Ddp`: c10d's Reducer, the engine of torch's DistributedDataParallel, over a model's parameters.
use std::ffi::c_void;
use std::ptr::NonNull;
use std::time::Duration;

use tch::Tensor;

use super::error::Result;
use super::{check, ffi, ProcessGroup};

/// Times c10d's Reducer measured for one sampled training iteration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReducerTimes {
    pub iteration: i64,
    pub forward: Duration,
    pub backward_compute: Duration,
    /// From the first bucket's all-reduce start to the last one's end.
    pub backward_comm: Duration,
    /// The part of communication that ran while backward was still computing.
    pub overlap: Duration,
}

/// Keeps the replicas of a model identical: parameters are broadcast from rank 0 when built,
/// and gradients are averaged across ranks in buckets while the backward pass runs.
///
/// Each step: [`Ddp::prepare_forward`], the forward pass, [`Ddp::prepare_backward`], then
/// `loss.backward()`, which returns with averaged gradients. With `sync = false` (the `no_sync`
/// of torch) gradients only accumulate locally, to be averaged with the next synchronised step.
pub struct Ddp<'pg> {
    raw: NonNull<ffi::RnDdp>,
    pg: &'pg ProcessGroup,
    sync: bool,
    /// How many parameters it averages.
    params: usize,
}

impl<'pg> Ddp<'pg> {
    /// `params` in the same order on every rank. `stats_every`: the Reducer samples its timers
    /// every that many iterations (and on the first ten).
    ///
    /// Buckets are laid out as torch's DistributedDataParallel lays them out, so gradients are
    /// summed in the same order: all in one bucket for the first iteration, then rebuilt in the
    /// order gradients became ready. With `layout` (the [`Ddp::bucket_layout`] a checkpoint
    /// recorded) they start out as that, so a resumed run sums exactly as an uninterrupted one.
    ///
    /// After a synchronised backward pass each gradient is a view of its bucket (torch's
    /// `gradient_as_bucket_view=True`): drop them between steps with [`super::clear_grads`]
    /// (torch's `zero_grad(set_to_none=True)`); libtorch refuses to detach a view in place, as
    /// tch's `Optimizer::zero_grad` would.
    pub fn new(
        pg: &'pg ProcessGroup,
        params: &[Tensor],
        bucket_cap_mb: f64,
        stats_every: usize,
        layout: Option<&[Vec<usize>]>,
    ) -> Result<Ddp<'pg>> {
        let ptrs: Vec<*mut c_void> = params.iter().map(|p| p.as_ptr() as *mut c_void).collect();
        let cap = (bucket_cap_mb * 1024.0 * 1024.0) as i64;
        let flat: Vec<usize> = layout.into_iter().flatten().flatten().copied().collect();
        let sizes: Vec<usize> = layout.into_iter().flatten().map(Vec::len).collect();
        let mut raw = std::ptr::null_mut();
        // SAFETY: `ptrs` are live tensors for the call; the Reducer keeps its own references.
        // `flat` and `sizes` are read only for the call, with their lengths checked on the C++ side.
        let err = unsafe {
            ffi::rn_ddp_new(
                pg.raw(),
                ptrs.as_ptr(),
                ptrs.len(),
                cap,
                stats_every as i64,
                flat.as_ptr(),
                sizes.as_ptr(),
                sizes.len(),
                &mut raw,
            )
        };
        check("ddp.new", err).map_err(|e| pg.explain(e))?;
        let raw = NonNull::new(raw).expect("rn_ddp_new succeeded");
        Ok(Ddp { raw, pg, sync: true, params: params.len() })
    }

    /// The parameter indices of each bucket, as the Reducer has them now (rebuilt after the
    /// first iteration in the order gradients became ready): a checkpoint records it.
    pub fn bucket_layout(&self) -> Result<Vec<Vec<usize>>> {
        let (mut flat, mut sizes, mut n) = (vec![0usize; self.params], vec![0usize; self.params], 0usize);
        // SAFETY: the reducer is live; both buffers hold one entry per parameter, the most the
        // bridge writes.
        let err =
            unsafe { ffi::rn_ddp_bucket_layout(self.raw.as_ptr(), flat.as_mut_ptr(), sizes.as_mut_ptr(), &mut n) };
        check("ddp.bucket_layout", err)?;
        let mut at = 0;
        Ok(sizes[..n]
            .iter()
            .map(|&k| {
                at += k;
                flat[at - k..at].to_vec()
            })
            .collect())
    }

    /// Whether the next backward pass averages gradients (torch's `no_sync` is `false`).
    pub fn set_sync(&mut self, sync: bool) {
        self.sync = sync;
    }

    /// Number of gradient buckets now (one until the buckets are rebuilt).
    pub fn buckets(&self) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: the reducer is live; valid out-pointer.
        check("ddp.buckets", unsafe { ffi::rn_ddp_bucket_count(self.raw.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// Call before the forward pass.
    pub fn prepare_forward(&mut self) -> Result<()> {
        if !self.sync {
            return Ok(());
        }
        // SAFETY: the reducer is live.
        let err = unsafe { ffi::rn_ddp_prepare_forward(self.raw.as_ptr()) };
        check("ddp.prepare_forward", err).map_err(|e| self.pg.explain(e))
    }

    /// Call after the forward pass, before `backward()`.
    pub fn prepare_backward(&mut self) -> Result<()> {
        if !self.sync {
            return Ok(());
        }
        // SAFETY: the reducer is live; no outputs are passed (all parameters are used).
        let err = unsafe { ffi::rn_ddp_prepare_backward(self.raw.as_ptr(), std::ptr::null(), 0) };
        check("ddp.prepare_backward", err)
    }

    /// The Reducer's timers for the iteration that just finished its backward pass, when it was
    /// a sampled one.
    pub fn reducer_times(&mut self, iteration: i64) -> Result<Option<ReducerTimes>> {
        let mut s = ffi::RnDdpStats::default();
        // SAFETY: the reducer is live; valid out-pointer.
        check("ddp.stats", unsafe { ffi::rn_ddp_record_stats(self.raw.as_ptr(), &mut s) })?;
        if s.iteration != iteration || s.forward_compute_ns < 0 {
            return Ok(None);
        }
        let d = |ns: i64| Duration::from_nanos(ns.max(0) as u64);
        Ok(Some(ReducerTimes {
            iteration: s.iteration,
            forward: d(s.forward_compute_ns),
            backward_compute: d(s.backward_compute_ns),
            backward_comm: d(s.backward_comm_ns),
            overlap: d(s.backward_compute_comm_overlap_ns),
        }))
    }
}

impl Drop for Ddp<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle is live and dropped exactly once.
        unsafe { ffi::rn_ddp_free(self.raw.as_ptr()) }
    }
}
