//! `extern "C"` declarations for csrc/bridge.h. Nothing but declarations: the safe API is in
//! the sibling modules. Every `*mut c_char` returned is NULL on success or a malloc'd message.
use std::ffi::{c_char, c_int, c_void};

#[repr(C)]
pub struct RnStore {
    _private: [u8; 0],
}
#[repr(C)]
pub struct RnPg {
    _private: [u8; 0],
}
#[repr(C)]
pub struct RnGraph {
    _private: [u8; 0],
}
#[repr(C)]
pub struct RnDdp {
    _private: [u8; 0],
}
#[repr(C)]
pub struct RnWork {
    _private: [u8; 0],
}

/// A checkpointed segment's body: `(closure, input, &output) -> NULL or a malloc'd message`.
pub type SegmentFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut *mut c_void) -> *mut c_char;
/// Frees a segment's closure.
pub type SegmentDrop = unsafe extern "C" fn(*mut c_void);

#[repr(C)]
pub struct RnFsdp {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct RnFsdpStats {
    pub shard_bytes: i64,
    pub shard_grad_bytes: i64,
    pub peak_gathered_bytes: i64,
    pub peak_grad_bytes: i64,
    pub gather_wait_ns: i64,
    pub reduce_wait_ns: i64,
    pub copy_ns: i64,
    pub gathers: i64,
    pub reduces: i64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct RnMemoryStats {
    pub used_bytes: i64,
    pub cached_bytes: i64,
    pub mapped_bytes: i64,
    pub peak_used_bytes: i64,
    pub peak_mapped_bytes: i64,
    pub maps: i64,
    pub unmaps: i64,
}

#[repr(C)]
pub struct RnScript {
    _private: [u8; 0],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct RnDdpStats {
    pub forward_compute_ns: i64,
    pub backward_compute_ns: i64,
    pub backward_comm_ns: i64,
    pub backward_compute_comm_overlap_ns: i64,
    pub iteration: i64,
}

/// rn_along_dim_autograd's modes (bridge.h).
pub const RN_SCATTER_SUM: c_int = 0;
pub const RN_GATHER_SUM_BACK: c_int = 1;
pub const RN_GATHER_PART_BACK: c_int = 2;
pub const RN_SUM: c_int = 0;
pub const RN_AVG: c_int = 1;
pub const RN_MIN: c_int = 2;
pub const RN_MAX: c_int = 3;

extern "C" {
    pub fn rn_free_string(s: *mut c_char);
    pub fn rn_free_bytes(b: *mut u8);

    pub fn rn_store_new(
        host: *const c_char,
        port: u16,
        is_server: c_int,
        listen_fd: c_int,
        num_workers: c_int,
        timeout_ms: i64,
        out: *mut *mut RnStore,
    ) -> *mut c_char;
    pub fn rn_store_free(s: *mut RnStore);
    pub fn rn_store_set(s: *mut RnStore, key: *const c_char, value: *const u8, len: usize) -> *mut c_char;
    pub fn rn_store_get(s: *mut RnStore, key: *const c_char, value: *mut *mut u8, len: *mut usize) -> *mut c_char;
    pub fn rn_store_add(s: *mut RnStore, key: *const c_char, delta: i64, out: *mut i64) -> *mut c_char;
    pub fn rn_store_check(s: *mut RnStore, key: *const c_char, present: *mut c_int) -> *mut c_char;
    pub fn rn_store_port(s: *mut RnStore, out: *mut u16) -> *mut c_char;
    pub fn rn_store_prefixed(s: *mut RnStore, prefix: *const c_char, out: *mut *mut RnStore) -> *mut c_char;

    pub fn rn_pg_new_gloo(
        s: *mut RnStore,
        rank: c_int,
        size: c_int,
        device_host: *const c_char,
        timeout_ms: i64,
        out: *mut *mut RnPg,
    ) -> *mut c_char;
    pub fn rn_pg_new_gloo_group(
        s: *mut RnStore,
        prefix: *const c_char,
        rank: c_int,
        size: c_int,
        device_host: *const c_char,
        timeout_ms: i64,
        out: *mut *mut RnPg,
    ) -> *mut c_char;
    pub fn rn_pg_new_nccl(
        s: *mut RnStore,
        rank: c_int,
        size: c_int,
        device_index: c_int,
        timeout_ms: i64,
        out: *mut *mut RnPg,
    ) -> *mut c_char;
    pub fn rn_pg_free(pg: *mut RnPg);
    pub fn rn_pg_all_reduce(pg: *mut RnPg, tensor: *mut c_void, op: c_int) -> *mut c_char;
    pub fn rn_pg_all_reduce_start(pg: *mut RnPg, tensor: *mut c_void, op: c_int, out: *mut *mut RnWork) -> *mut c_char;
    pub fn rn_work_wait(w: *mut RnWork) -> *mut c_char;
    pub fn rn_work_free(w: *mut RnWork);
    pub fn rn_pg_broadcast(pg: *mut RnPg, tensor: *mut c_void, root: c_int) -> *mut c_char;
    pub fn rn_pg_all_gather(
        pg: *mut RnPg,
        outputs: *const *mut c_void,
        n_outputs: usize,
        input: *mut c_void,
    ) -> *mut c_char;
    pub fn rn_pg_send(pg: *mut RnPg, tensor: *mut c_void, dst: c_int, tag: c_int) -> *mut c_char;
    pub fn rn_pg_recv(pg: *mut RnPg, tensor: *mut c_void, src: c_int, tag: c_int) -> *mut c_char;
    pub fn rn_pg_send_recv(
        pg: *mut RnPg,
        send_tensor: *mut c_void,
        dst: c_int,
        send_tag: c_int,
        recv_tensor: *mut c_void,
        src: c_int,
        recv_tag: c_int,
    ) -> *mut c_char;
    pub fn rn_pg_sent(pg: *mut RnPg, collective: *mut u64, p2p: *mut u64);
    pub fn rn_pg_barrier(pg: *mut RnPg) -> *mut c_char;

    pub fn rn_ddp_new(
        pg: *mut RnPg,
        params: *const *mut c_void,
        n_params: usize,
        bucket_cap_bytes: i64,
        stats_every: i64,
        layout: *const usize,
        bucket_sizes: *const usize,
        n_buckets: usize,
        out: *mut *mut RnDdp,
    ) -> *mut c_char;
    pub fn rn_ddp_free(d: *mut RnDdp);
    pub fn rn_ddp_prepare_forward(d: *mut RnDdp) -> *mut c_char;
    pub fn rn_ddp_prepare_backward(d: *mut RnDdp, outputs: *const *mut c_void, n_outputs: usize) -> *mut c_char;
    pub fn rn_ddp_record_stats(d: *mut RnDdp, out: *mut RnDdpStats) -> *mut c_char;
    pub fn rn_ddp_bucket_count(d: *mut RnDdp, out: *mut usize) -> *mut c_char;
    pub fn rn_ddp_bucket_layout(
        d: *mut RnDdp,
        layout: *mut usize,
        bucket_sizes: *mut usize,
        n_buckets: *mut usize,
    ) -> *mut c_char;

    pub fn rn_set_autocast_dtype(device_type: c_int, scalar_type: c_int) -> *mut c_char;

    pub fn rn_clear_grads(params: *const *mut c_void, n: usize) -> *mut c_char;
    pub fn rn_adam(
        params: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        n: usize,
        step: f64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        decoupled: c_int,
        fused: c_int,
    ) -> *mut c_char;
    pub fn rn_sgd(
        params: *const *mut c_void,
        bufs: *const *mut c_void,
        n: usize,
        first: c_int,
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    ) -> *mut c_char;
    pub fn rn_autocast_bf16(enabled: c_int) -> *mut c_char;
    pub fn rn_checkpoint(
        input: *mut c_void,
        params: *const *mut c_void,
        n_params: usize,
        call: SegmentFn,
        drop: SegmentDrop,
        closure: *mut c_void,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    pub fn rn_checkpoint_linear(
        source: *mut c_void,
        params: *const *mut c_void,
        n_params: usize,
        n_segment: usize,
        call: SegmentFn,
        drop: SegmentDrop,
        closure: *mut c_void,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    pub fn rn_checkpoint_recompute_ns() -> i64;
    pub fn rn_cpu_kernels(
        pin: c_int,
        capability: *mut *mut c_char,
        onednn: *mut c_int,
        nnpack: *mut c_int,
    ) -> *mut c_char;
    pub fn rn_cuda_device(
        index: c_int,
        name: *mut *mut c_char,
        major: *mut c_int,
        minor: *mut c_int,
        total_bytes: *mut i64,
        processors: *mut c_int,
    ) -> *mut c_char;
    pub fn rn_cuda_peak_memory(index: c_int, allocated: *mut i64, reserved: *mut i64) -> *mut c_char;
    pub fn rn_cuda_event_record(index: c_int, event: *mut *mut c_void) -> *mut c_char;
    pub fn rn_cuda_event_done(event: *mut c_void, done: *mut c_int) -> *mut c_char;
    pub fn rn_cuda_event_elapsed(from: *mut c_void, to: *mut c_void, ms: *mut f64) -> *mut c_char;
    pub fn rn_cuda_event_free(event: *mut c_void);
    pub fn rn_cuda_side_stream(index: c_int) -> *mut c_char;
    pub fn rn_cuda_graph_begin(out: *mut *mut RnGraph) -> *mut c_char;
    pub fn rn_cuda_graph_end(graph: *mut RnGraph) -> *mut c_char;
    pub fn rn_cuda_graph_replay(graph: *mut RnGraph) -> *mut c_char;
    pub fn rn_cuda_graph_free(graph: *mut RnGraph);
    pub fn rn_all_reduce_sum_autograd(
        pg: *mut RnPg,
        input: *mut c_void,
        in_forward: c_int,
        in_backward: c_int,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    pub fn rn_along_dim_autograd(
        pg: *mut RnPg,
        input: *mut c_void,
        dim: i64,
        mode: c_int,
        out: *mut *mut c_void,
    ) -> *mut c_char;

    pub fn rn_script_load(
        path: *const c_char,
        device_type: c_int,
        device_index: c_int,
        out: *mut *mut RnScript,
    ) -> *mut c_char;
    pub fn rn_script_free(m: *mut RnScript);
    pub fn rn_script_count(m: *mut RnScript, buffers: c_int, n: *mut usize) -> *mut c_char;
    pub fn rn_script_entry(
        m: *mut RnScript,
        buffers: c_int,
        i: usize,
        name: *mut *mut c_char,
        tensor: *mut *mut c_void,
    ) -> *mut c_char;
    pub fn rn_script_train(m: *mut RnScript, training: c_int) -> *mut c_char;
    pub fn rn_script_forward(m: *mut RnScript, input: *mut c_void, out: *mut *mut c_void) -> *mut c_char;

    pub fn rn_fsdp_new(
        pg: *mut RnPg,
        n_units: usize,
        layer_units: *const usize,
        layer_counts: *const usize,
        n_layers: usize,
        zero3: c_int,
        out: *mut *mut RnFsdp,
    ) -> *mut c_char;
    pub fn rn_fsdp_add_unit(f: *mut RnFsdp, params: *const *mut c_void, n_params: usize) -> *mut c_char;
    pub fn rn_fsdp_free(f: *mut RnFsdp);
    pub fn rn_fsdp_shard(f: *mut RnFsdp, i: usize, out: *mut *mut c_void) -> *mut c_char;
    pub fn rn_fsdp_pre_forward(f: *mut RnFsdp, layer: usize) -> *mut c_char;
    pub fn rn_fsdp_post_forward(f: *mut RnFsdp, layer: usize, output: *mut c_void) -> *mut c_char;
    pub fn rn_fsdp_finish_backward(f: *mut RnFsdp) -> *mut c_char;
    pub fn rn_fsdp_full(f: *mut RnFsdp, i: usize, out: *mut *mut c_void) -> *mut c_char;
    pub fn rn_fsdp_read_stats(f: *mut RnFsdp, reset: c_int, out: *mut RnFsdpStats) -> *mut c_char;

    pub fn rn_memory_install() -> *mut c_char;
    pub fn rn_memory_phase();
    pub fn rn_memory_read_stats(out: *mut RnMemoryStats) -> *mut c_char;
}
