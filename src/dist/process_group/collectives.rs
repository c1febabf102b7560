//! The collectives and point-to-point operations of a [`ProcessGroup`], each checked for the
//! group's timeout and explained on failure (which rank, what it was doing).
use std::ffi::{c_int, c_void};
use std::ptr::NonNull;

use tch::Tensor;

use super::{ProcessGroup, ReduceOp};
use crate::dist::error::{Error, Result};
use crate::dist::{check, ffi};

impl ProcessGroup {
    /// Reduces `t` across ranks, in place, on every rank.
    pub fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        let code = match op {
            ReduceOp::Sum => ffi::RN_SUM,
            ReduceOp::Avg => ffi::RN_AVG,
            ReduceOp::Min => ffi::RN_MIN,
            ReduceOp::Max => ffi::RN_MAX,
        };
        let name = format!("all_reduce({op:?})");
        self.contiguous(&name, t)?;
        self.in_place(t, false, |t| {
            // SAFETY: `t` is a live, contiguous tensor for the duration of the blocking call.
            let err = unsafe { ffi::rn_pg_all_reduce(self.raw(), t.as_mut_ptr() as *mut c_void, code) };
            self.result(&name, err)
        })
    }

    /// Starts reducing `t` across ranks (Sum, Min or Max) and returns at once: the reduction runs
    /// on the backend's threads while this one goes on; [`Pending::wait`] hands `t` back reduced.
    /// Every rank must start its reductions in the same order, as with the blocking ones.
    pub fn all_reduce_start(&self, t: Tensor, op: ReduceOp) -> Result<Pending<'_>> {
        let name = format!("all_reduce({op:?})");
        let code = match op {
            ReduceOp::Sum => ffi::RN_SUM,
            ReduceOp::Min => ffi::RN_MIN,
            ReduceOp::Max => ffi::RN_MAX,
            ReduceOp::Avg => return Err(Error::new(&name, "an all-reduce in flight cannot average (use Sum)")),
        };
        self.contiguous(&name, &t)?;
        let mut work = std::ptr::null_mut();
        // SAFETY: `t` is live and contiguous; the Pending returned owns it (and the work) until the
        // work is waited for, so the backend never writes into a freed tensor.
        let err = unsafe { ffi::rn_pg_all_reduce_start(self.raw(), t.as_ptr() as *mut c_void, code, &mut work) };
        self.result(&name, err)?;
        let work = NonNull::new(work).ok_or_else(|| Error::new(&name, "the backend started no work"))?;
        Ok(Pending { pg: self, work: Some(work), tensor: t, name })
    }

    /// The sum of `t` over every rank, as a new tensor autograd differentiates: its backward pass
    /// all-reduces the gradient (every rank's loss depends on every rank's `t`). SyncBatchNorm's
    /// statistics go through it.
    pub fn all_reduce_sum_autograd(&self, t: &Tensor) -> Result<Tensor> {
        self.sum_autograd("all_reduce_sum_autograd", t, true, true)
    }

    /// `t` as it is, as a new tensor whose gradient autograd sums over the ranks: the input of a
    /// column-parallel layer, each rank's slice of whose outputs depends on all of `t`
    /// (Megatron's copy into the tensor-parallel region).
    pub fn copy_to_ranks_autograd(&self, t: &Tensor) -> Result<Tensor> {
        self.sum_autograd("copy_to_ranks_autograd", t, false, true)
    }

    /// The sum of the ranks' partial `t` (a row-parallel layer's outputs), as a new tensor whose
    /// gradient passes back as it is: every rank holds the whole gradient of the sum already
    /// (Megatron's reduce out of the tensor-parallel region).
    pub fn sum_from_ranks_autograd(&self, t: &Tensor) -> Result<Tensor> {
        self.sum_autograd("sum_from_ranks_autograd", t, true, false)
    }

    /// `t` summed over the ranks in the forward pass, its gradient in the backward pass, where asked.
    fn sum_autograd(&self, name: &str, t: &Tensor, in_forward: bool, in_backward: bool) -> Result<Tensor> {
        let t = t.contiguous();
        let mut out = std::ptr::null_mut();
        // SAFETY: `t` is live for the blocking call; on success `out` is a new at::Tensor that the
        // returned Tensor owns (tch frees it).
        let err = unsafe {
            ffi::rn_all_reduce_sum_autograd(
                self.raw(),
                t.as_ptr() as *mut c_void,
                in_forward.into(),
                in_backward.into(),
                &mut out,
            )
        };
        self.result(name, err)?;
        // SAFETY: the bridge allocated `out` with `new at::Tensor`, what tch's handles are.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }

    /// The sum of the ranks' partial `t` (a row-parallel layer's outputs), of which this rank keeps
    /// its part along `dim` (reduce-scatter), as a new tensor whose gradient autograd gathers
    /// along `dim`: sequence parallelism's exit from a tensor-parallel region.
    pub fn scatter_sum_autograd(&self, t: &Tensor, dim: i64) -> Result<Tensor> {
        self.along_dim("scatter_sum_autograd", t, dim, ffi::RN_SCATTER_SUM)
    }

    /// Every rank's `t` concatenated along `dim` in rank order (all-gather), as a new tensor whose
    /// gradient autograd reduce-scatters along `dim` (`sum_back`: the ranks each hold a partial
    /// gradient of the whole, as a column-parallel layer's input has), or of which it keeps this
    /// rank's part (every rank computed the same gradient of the whole).
    pub fn gather_autograd(&self, t: &Tensor, dim: i64, sum_back: bool) -> Result<Tensor> {
        let mode = if sum_back { ffi::RN_GATHER_SUM_BACK } else { ffi::RN_GATHER_PART_BACK };
        self.along_dim("gather_autograd", t, dim, mode)
    }

    fn along_dim(&self, name: &str, t: &Tensor, dim: i64, mode: c_int) -> Result<Tensor> {
        let t = t.contiguous();
        let mut out = std::ptr::null_mut();
        // SAFETY: `t` is live for the blocking call; on success `out` is a new at::Tensor that the
        // returned Tensor owns (tch frees it).
        let err = unsafe { ffi::rn_along_dim_autograd(self.raw(), t.as_ptr() as *mut c_void, dim, mode, &mut out) };
        self.result(name, err)?;
        // SAFETY: the bridge allocated `out` with `new at::Tensor`, what tch's handles are.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }

    /// Copies `root`'s `t` into every other rank's `t`.
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()> {
        let name = format!("broadcast(root {root})");
        self.peer(&name, root)?;
        self.contiguous(&name, t)?;
        self.in_place(t, false, |t| {
            // SAFETY: as in all_reduce.
            let err = unsafe { ffi::rn_pg_broadcast(self.raw(), t.as_mut_ptr() as *mut c_void, root as i32) };
            self.result(&name, err)
        })
    }

    /// Every rank's `t`, in rank order.
    pub fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        self.contiguous("all_gather", t)?;
        let staged = self.staged(t, false);
        let input = staged.as_ref().unwrap_or(t);
        let outputs: Vec<Tensor> = (0..self.size).map(|_| input.empty_like()).collect();
        let ptrs: Vec<*mut c_void> = outputs.iter().map(|o| o.as_ptr() as *mut c_void).collect();
        // SAFETY: `ptrs` holds `size` live tensors shaped like `input`; all outlive the blocking call.
        let err =
            unsafe { ffi::rn_pg_all_gather(self.raw(), ptrs.as_ptr(), ptrs.len(), input.as_ptr() as *mut c_void) };
        self.result("all_gather", err)?;
        Ok(match staged {
            Some(_) => outputs.iter().map(|o| o.to_device(t.device())).collect(),
            None => outputs,
        })
    }

    /// Sends `t` to rank `dst`, which must `recv` with the same `tag`.
    pub fn send(&self, t: &Tensor, dst: usize, tag: i32) -> Result<()> {
        let name = format!("send(to rank {dst}, tag {tag})");
        self.peer(&name, dst)?;
        self.contiguous(&name, t)?;
        let staged = self.staged(t, true);
        let t = staged.as_ref().unwrap_or(t);
        // SAFETY: `t` is live and contiguous for the blocking call.
        let err = unsafe { ffi::rn_pg_send(self.raw(), t.as_ptr() as *mut c_void, dst as i32, tag) };
        self.result(&name, err)
    }

    /// Receives into `t` (already shaped) what rank `src` sends with `tag`.
    pub fn recv(&self, t: &mut Tensor, src: usize, tag: i32) -> Result<()> {
        let name = format!("recv(from rank {src}, tag {tag})");
        self.peer(&name, src)?;
        self.contiguous(&name, t)?;
        self.in_place(t, true, |t| {
            // SAFETY: `t` is live and contiguous for the blocking call.
            let err = unsafe { ffi::rn_pg_recv(self.raw(), t.as_mut_ptr() as *mut c_void, src as i32, tag) };
            self.result(&name, err)
        })
    }

    /// Sends `send` to `dst` (tag `send_tag`) while receiving into `recv` from `src` (tag
    /// `recv_tag`): both in flight at once, so two ranks may exchange with each other this way
    /// without either waiting for the other's send to finish.
    pub fn send_recv(
        &self,
        send: &Tensor,
        dst: usize,
        send_tag: i32,
        recv: &mut Tensor,
        src: usize,
        recv_tag: i32,
    ) -> Result<()> {
        let name = format!("send_recv(to rank {dst}, tag {send_tag}; from rank {src}, tag {recv_tag})");
        self.peer(&name, dst)?;
        self.peer(&name, src)?;
        self.contiguous(&name, send)?;
        self.contiguous(&name, recv)?;
        let staged = self.staged(send, true);
        let send = staged.as_ref().unwrap_or(send);
        self.in_place(recv, true, |recv| {
            // SAFETY: both tensors are live and contiguous for the blocking call.
            let err = unsafe {
                ffi::rn_pg_send_recv(
                    self.raw(),
                    send.as_ptr() as *mut c_void,
                    dst as i32,
                    send_tag,
                    recv.as_mut_ptr() as *mut c_void,
                    src as i32,
                    recv_tag,
                )
            };
            self.result(&name, err)
        })
    }
}

/// An all-reduce in flight ([`ProcessGroup::all_reduce_start`]). Dropped unwaited, it still
/// waits for the work (the backend writes into its tensor until then).
pub struct Pending<'pg> {
    pg: &'pg ProcessGroup,
    work: Option<NonNull<ffi::RnWork>>,
    tensor: Tensor,
    name: String,
}

impl Pending<'_> {
    /// Waits for the reduction and returns the reduced tensor.
    pub fn wait(mut self) -> Result<Tensor> {
        let work = self.work.take().expect("a pending work");
        // SAFETY: `work` came from rn_pg_all_reduce_start and is waited for and freed once, here.
        let err = unsafe { ffi::rn_work_wait(work.as_ptr()) };
        // SAFETY: as above; nothing uses `work` after this.
        unsafe { ffi::rn_work_free(work.as_ptr()) };
        self.pg.result(&self.name, err)?;
        Ok(std::mem::replace(&mut self.tensor, Tensor::new()))
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(work) = self.work.take() {
            // SAFETY: `work` is live and not yet waited for; the tensor it writes is still ours.
            let err = unsafe { ffi::rn_work_wait(work.as_ptr()) };
            let _ = check(&self.name, err);
            // SAFETY: waited for above; freed once.
            unsafe { ffi::rn_work_free(work.as_ptr()) };
        }
    }
}
