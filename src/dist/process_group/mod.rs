//! `ProcessGroup`: c10d's collectives (Gloo on CPU, NCCL with the `cuda` feature) on tch tensors.
//!
//! Each backend is handed tensors where it can move them: NCCL moves GPU memory only, so a CPU
//! tensor (the per-epoch metrics, a checkpoint's gather) is copied to the group's GPU and back;
//! torch's gloo has no GPU send/recv, so a CUDA tensor sent or received over gloo goes through
//! host memory (its all-reduce, broadcast and all-gather take CUDA tensors themselves).
mod collectives;

pub use collectives::Pending;

use std::ffi::CString;
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
