//! `ProcessGroup`: c10d's collectives (Gloo on CPU, NCCL with the `cuda` feature) on tch tensors.
//!
//! Each backend is handed tensors where it can move them: NCCL moves GPU memory only, so a CPU
//! tensor (the per-epoch metrics, a checkpoint's gather) is copied to the group's GPU and back;
//! torch's gloo has no GPU send/recv, so a CUDA tensor sent or received over gloo goes through
//! host memory (its all-reduce, broadcast and all-gather take CUDA tensors themselves).
use std::ffi::{c_int, c_void, CString};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::Tensor;

use super::error::{Error, PeerExit, Result};
use super::{check, ffi, Store};

/// Which c10d backend carries the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Gloo,
    /// NCCL on the GPU `cuda:device` (a rank's LOCAL_RANK), which becomes the current CUDA device.
    /// Only in a build with `--features cuda`; elsewhere creating the group fails.
    Nccl {
        device: usize,
    },
}

impl Backend {
    /// Where the backend's collectives run.
    pub fn device(self) -> tch::Device {
        match self {
            Backend::Gloo => tch::Device::Cpu,
            Backend::Nccl { device } => tch::Device::Cuda(device),
        }
    }
}

/// Bytes one rank handed to a group, counted by the bridge's backend as each call starts
/// (csrc/traffic.hpp), whoever made the call: this API, FSDP's sharding or DDP's Reducer. A
/// collective counts the tensors this rank contributes (an all-reduce's tensor, an all-gather's
/// input, a reduce-scatter's or all-to-all's whole input, a broadcast's tensor on its root); a
/// send its tensor; a receive nothing; a group of one rank nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sent {
    pub collective: u64,
    pub point_to_point: u64,
}

impl std::ops::Sub for Sent {
    type Output = Sent;
    fn sub(self, before: Sent) -> Sent {
        Sent {
            collective: self.collective - before.collective,
            point_to_point: self.point_to_point - before.point_to_point,
        }
    }
}

/// How `all_reduce` combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Min,
    Max,
}

fn exit_key(rank: usize) -> String {
    format!("runner/exit/{rank}")
}

/// Records in the store that `rank` left the group and how (by itself, or by its launcher when
/// it died), numbered in the order departures happen: the first is the root cause.
pub fn record_exit(store: &Store, rank: usize, how: &str) -> Result<()> {
    let seq = store.add("runner/exit-seq", 1)?;
    store.set(&exit_key(rank), format!("{seq}|{how}").as_bytes())
}

/// The departure recorded for `rank`: its order and how.
fn recorded_exit(store: &Store, rank: usize) -> Option<(i64, String)> {
    if !store.contains(&exit_key(rank)).ok()? {
        return None;
    }
    let value = String::from_utf8_lossy(&store.get(&exit_key(rank)).ok()?).into_owned();
    let (seq, how) = value.split_once('|')?;
    Some((seq.parse().ok()?, how.to_owned()))
}

/// The ranks `0..size` of one job, joined through a [`Store`]; or some of them (a subgroup).
pub struct ProcessGroup {
    raw: NonNull<ffi::RnPg>,
    store: Arc<Store>,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// The job's rank of each member (`0..size` for the whole job): departures are recorded by them.
    members: Vec<usize>,
    /// Made by [`ProcessGroup::subgroup`]: its end is not the rank's departure from the job.
    subgroup: bool,
    device_host: String,
    backend: Backend,
}

// SAFETY: c10d backends enqueue work behind their own locks and may be called from any thread.
unsafe impl Send for ProcessGroup {}
// SAFETY: as above.
unsafe impl Sync for ProcessGroup {}

impl ProcessGroup {
    /// Joins the group as `rank` of `size`. Every collective fails after `timeout` rather than
    /// hang. `device_host` is the address the gloo transport binds (127.0.0.1 on one node).
    pub fn new(
        backend: Backend,
        store: Arc<Store>,
        rank: usize,
        size: usize,
        device_host: &str,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        if rank >= size {
            return Err(Error::new("process_group.new", format!("rank {rank} is not below world size {size}")));
        }
        let host = CString::new(device_host)
            .map_err(|_| Error::new("process_group.new", "device host contains a NUL byte"))?;
        let timeout_ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
        let op = format!("process_group.new({backend:?}, rank {rank} of {size})");
        let raw = match backend {
            // gloo's rendezvous reads the store (up to the timeout for the peers' addresses), then
            // connects to every peer (up to the timeout again): bounded like the store's calls.
            Backend::Gloo => {
                let (call_store, call_op) = (Arc::clone(&store), op.clone());
                super::store::bounded(&op, 2 * timeout, move || {
                    let mut raw = std::ptr::null_mut();
                    // SAFETY: the store is live for the call (this thread holds its Arc); `raw` is
                    // written only on success.
                    let err = unsafe {
                        ffi::rn_pg_new_gloo(
                            call_store.raw(),
                            rank as i32,
                            size as i32,
                            host.as_ptr(),
                            timeout_ms,
                            &mut raw,
                        )
                    };
                    check(&call_op, err)?;
                    // An address, to cross threads; owned by the group made of it below.
                    Ok(raw as usize)
                })?
            }
            // On this thread: the group's GPU becomes this thread's current device.
            Backend::Nccl { device } => {
                let mut raw = std::ptr::null_mut();
                // SAFETY: the store is live for the call; `raw` is written only on success.
                let err = unsafe {
                    ffi::rn_pg_new_nccl(store.raw(), rank as i32, size as i32, device as i32, timeout_ms, &mut raw)
                };
                check(&op, err)?;
                raw as usize
            }
        };
        let raw = NonNull::new(raw as *mut ffi::RnPg).expect("rn_pg_new succeeded");
        let members = (0..size).collect();
        Ok(ProcessGroup {
            raw,
            store,
            rank,
            size,
            timeout,
            members,
            subgroup: false,
            device_host: device_host.to_owned(),
            backend,
        })
    }

    /// A gloo group of the job's ranks `members` (this rank among them), for collectives among
    /// them alone. Every member must call this with the same `name` and `members`; groups with
    /// different names may be created at the same time.
    pub fn subgroup(&self, name: &str, members: &[usize]) -> Result<ProcessGroup> {
        let op = format!("process_group.subgroup({name}, ranks {members:?})");
        let rank = members
            .iter()
            .position(|&m| m == self.global_rank())
            .ok_or_else(|| Error::new(&op, format!("rank {} is not a member", self.global_rank())))?;
        let prefix = CString::new(format!("runner/group/{name}")).map_err(|_| Error::new(&op, "NUL in the name"))?;
        let host = CString::new(self.device_host.as_str()).map_err(|_| Error::new(&op, "NUL in the host"))?;
        let timeout_ms = i64::try_from(self.timeout.as_millis()).unwrap_or(i64::MAX);
        let mut raw = std::ptr::null_mut();
        // SAFETY: the store and both strings are live for the call; `raw` is written only on success.
        let err = unsafe {
            ffi::rn_pg_new_gloo_group(
                self.store.raw(),
                prefix.as_ptr(),
                rank as i32,
                members.len() as i32,
                host.as_ptr(),
                timeout_ms,
                &mut raw,
            )
        };
        self.result(&op, err)?;
        let raw = NonNull::new(raw).expect("rn_pg_new_gloo_group succeeded");
        Ok(ProcessGroup {
            raw,
            store: self.store.clone(),
            rank,
            size: members.len(),
            timeout: self.timeout,
            members: members.to_vec(),
            subgroup: true,
            device_host: self.device_host.clone(),
            backend: Backend::Gloo,
        })
    }

    /// This rank in the whole job.
    fn global_rank(&self) -> usize {
        self.members[self.rank]
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    pub(crate) fn raw(&self) -> *mut ffi::RnPg {
        self.raw.as_ptr()
    }

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

    /// What this rank has sent in this group since it was made (see [`Sent`]): read before and
    /// after a piece of work, the difference is what that work sent.
    pub fn sent(&self) -> Sent {
        let (mut collective, mut point_to_point) = (0u64, 0u64);
        // SAFETY: the group is live; the bridge writes the two counters and cannot fail.
        unsafe { ffi::rn_pg_sent(self.raw(), &mut collective, &mut point_to_point) };
        Sent { collective, point_to_point }
    }

    pub fn barrier(&self) -> Result<()> {
        // SAFETY: the group is live.
        let err = unsafe { ffi::rn_pg_barrier(self.raw()) };
        self.result("barrier", err)
    }

    /// Records in the store that this rank is leaving and why, so that peers still waiting on
    /// it can name it in their error. Dropping the group records "left the group".
    pub fn leave(&self, how: &str) {
        let _ = record_exit(&self.store, self.global_rank(), how);
    }

    /// A copy of `t` on the device the backend needs it on (see the module's header), or `None`
    /// where `t` can go as it is. `p2p`: for send or receive.
    fn staged(&self, t: &Tensor, p2p: bool) -> Option<Tensor> {
        let to = match (self.backend, t.device()) {
            (Backend::Nccl { device }, d) if d != tch::Device::Cuda(device) => tch::Device::Cuda(device),
            (Backend::Gloo, tch::Device::Cuda(_)) if p2p => tch::Device::Cpu,
            _ => return None,
        };
        Some(t.to_device(to))
    }

    /// Runs `op` on `t`, or on a staged copy of it that is then copied back into `t`.
    fn in_place(&self, t: &mut Tensor, p2p: bool, op: impl FnOnce(&mut Tensor) -> Result<()>) -> Result<()> {
        match self.staged(t, p2p) {
            None => op(t),
            Some(mut copy) => {
                op(&mut copy)?;
                tch::no_grad(|| t.copy_(&copy));
                Ok(())
            }
        }
    }

    fn contiguous(&self, op: &str, t: &Tensor) -> Result<()> {
        if t.is_contiguous() {
            Ok(())
        } else {
            Err(Error::new(op, "the tensor is not contiguous (call .contiguous() first)"))
        }
    }

    fn peer(&self, op: &str, rank: usize) -> Result<()> {
        if rank < self.size {
            Ok(())
        } else {
            Err(Error::new(op, format!("rank {rank} is not below world size {}", self.size)))
        }
    }

    fn result(&self, op: &str, err: *mut std::ffi::c_char) -> Result<()> {
        check(op, err).map_err(|e| self.explain(e))
    }

    /// Names the peer behind a failed collective: the first rank whose departure is recorded in
    /// the store (by its launcher when it died, or by itself when it left), preferring root
    /// causes over ranks that only failed in turn ("failed: ..."). Waits briefly for a record,
    /// since a peer's socket closes before its launcher notices that it died.
    pub fn explain(&self, mut e: Error) -> Error {
        let deadline = Instant::now() + Duration::from_secs(2).min(self.timeout);
        loop {
            let mut exits: Vec<(i64, PeerExit)> = (self.members.iter().copied())
                .filter(|&r| r != self.global_rank())
                .filter_map(|rank| recorded_exit(&self.store, rank).map(|(seq, how)| (seq, PeerExit { rank, how })))
                .collect();
            exits.sort_by_key(|(seq, p)| (p.how.starts_with("failed"), *seq));
            if let Some((_, first)) = exits.into_iter().next() {
                if !first.how.starts_with("failed") || Instant::now() >= deadline {
                    e.peer = Some(first);
                    return e;
                }
            } else if Instant::now() >= deadline {
                return e;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // A subgroup ends before the job's group does; only the latter means leaving the job.
        if !self.subgroup && self.store.contains(&exit_key(self.rank)).is_ok_and(|recorded| !recorded) {
            self.leave("left the group");
        }
        // SAFETY: the handle is live and dropped exactly once.
        unsafe { ffi::rn_pg_free(self.raw.as_ptr()) }
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
