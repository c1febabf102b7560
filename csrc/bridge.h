// Plain C interface over PyTorch's c10d (TCPStore, ProcessGroupGloo or ProcessGroupNCCL, Reducer).
//
// Every function that can fail returns NULL on success or an error message allocated with malloc,
// which the caller frees with rn_free_string. No C++ exception crosses this boundary.
// Tensors are passed as `at::Tensor*` (what tch's `Tensor::as_ptr()` points at), typed void* here.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rn_store rn_store;
typedef struct rn_pg rn_pg;
typedef struct rn_ddp rn_ddp;
typedef struct rn_work rn_work;

enum rn_reduce_op { RN_SUM = 0, RN_AVG = 1, RN_MIN = 2, RN_MAX = 3 };

typedef struct rn_ddp_stats {
  // Nanoseconds, for the iteration most recently sampled; -1 when not recorded.
  int64_t forward_compute_ns;
  int64_t backward_compute_ns;
  int64_t backward_comm_ns;
  int64_t backward_compute_comm_overlap_ns;
  int64_t iteration;
} rn_ddp_stats;

void rn_free_string(char* s);
void rn_free_bytes(uint8_t* b);

// listen_fd >= 0: a server that takes over this bound, listening socket (closed by the store).
char* rn_store_new(const char* host, uint16_t port, int is_server, int listen_fd, int num_workers,
                   int64_t timeout_ms, rn_store** out);
void rn_store_free(rn_store* s);
char* rn_store_set(rn_store* s, const char* key, const uint8_t* value, size_t len);
char* rn_store_get(rn_store* s, const char* key, uint8_t** value, size_t* len);
char* rn_store_add(rn_store* s, const char* key, int64_t delta, int64_t* out);
char* rn_store_check(rn_store* s, const char* key, int* present);
char* rn_store_port(rn_store* s, uint16_t* out);
// A store whose keys all go under `prefix` in `s` (c10d's PrefixStore); freed on its own.
char* rn_store_prefixed(rn_store* s, const char* prefix, rn_store** out);

// device_host: address the gloo transport binds to (its peers connect to it).
char* rn_pg_new_gloo(rn_store* s, int rank, int size, const char* device_host, int64_t timeout_ms,
                     rn_pg** out);
// A group of some of the ranks, rendezvousing under its own store prefix; rank and size are within
// the group, and every member must create it with the same prefix.
char* rn_pg_new_gloo_group(rn_store* s, const char* prefix, int rank, int size, const char* device_host,
                           int64_t timeout_ms, rn_pg** out);
// NCCL on the GPU cuda:device_index (made the current device). Fails, with a message, in a build
// without the cuda feature.
char* rn_pg_new_nccl(rn_store* s, int rank, int size, int device_index, int64_t timeout_ms, rn_pg** out);
void rn_pg_free(rn_pg* pg);
char* rn_pg_all_reduce(rn_pg* pg, void* tensor, int op);
// Starts an in-place all-reduce (RN_SUM, RN_MIN or RN_MAX) and returns at once; rn_work_wait
// finishes it. The tensor must stay alive and untouched until then; rn_work_free after the wait.
char* rn_pg_all_reduce_start(rn_pg* pg, void* tensor, int op, rn_work** out);
char* rn_work_wait(rn_work* w);
void rn_work_free(rn_work* w);
char* rn_pg_broadcast(rn_pg* pg, void* tensor, int root);
// outputs: `size` tensors shaped like input.
char* rn_pg_all_gather(rn_pg* pg, void** outputs, size_t n_outputs, void* input);
char* rn_pg_send(rn_pg* pg, void* tensor, int dst, int tag);
char* rn_pg_recv(rn_pg* pg, void* tensor, int src, int tag);
// Sends send_tensor to dst and receives recv_tensor from src, both in flight at once.
char* rn_pg_send_recv(rn_pg* pg, void* send_tensor, int dst, int send_tag, void* recv_tensor, int src,
                      int recv_tag);
// Bytes this rank has handed to the group's collectives, and sent point to point, since the
// group was made (csrc/traffic.hpp says what counts). Never fails.
void rn_pg_sent(rn_pg* pg, uint64_t* collective, uint64_t* p2p);
char* rn_pg_barrier(rn_pg* pg);

// Broadcasts params from rank 0, then builds a Reducer with buckets of bucket_cap_bytes.
// `resumed`: the run continues past its first iteration, so the buckets start out rebuilt.
// layout / bucket_sizes / n_buckets: a bucket layout to start from (n_buckets = 0: torch's
// first-iteration layout, rebuilt after it).
char* rn_ddp_new(rn_pg* pg, void** params, size_t n_params, int64_t bucket_cap_bytes,
                 int64_t stats_every, const size_t* layout, const size_t* bucket_sizes, size_t n_buckets,
                 rn_ddp** out);
void rn_ddp_free(rn_ddp* d);
char* rn_ddp_prepare_forward(rn_ddp* d);
char* rn_ddp_prepare_backward(rn_ddp* d, void** outputs, size_t n_outputs);
char* rn_ddp_record_stats(rn_ddp* d, rn_ddp_stats* out);
char* rn_ddp_bucket_count(rn_ddp* d, size_t* out);
// The buckets' parameter indices, bucket after bucket, into layout (n_params long); each bucket's
// size into bucket_sizes (n_params long); the number of buckets into n_buckets.
char* rn_ddp_bucket_layout(rn_ddp* d, size_t* layout, size_t* bucket_sizes, size_t* n_buckets);

// Drops the gradients of n tensors (torch's zero_grad(set_to_none=True)): the next backward pass
// then writes fresh gradients instead of adding to zeroed ones.
char* rn_clear_grads(void** params, size_t n);

// One Adam step (AdamW with decoupled = 1) over the n parameters that have a gradient: with
// fused = 1 in a single fused libtorch kernel (at::_fused_adam_ / at::_fused_adamw_, which tch does
// not expose), else in torch's multi-tensor at::_foreach_* operations. `step` counts this one.
char* rn_adam(void** params, void** exp_avgs, void** exp_avg_sqs, size_t n, double step, double lr, double beta1,
              double beta2, double weight_decay, double eps, int decoupled, int fused);

// One step of torch.optim.SGD (single-tensor, dampening 0, not Nesterov) over the n parameters that
// have a gradient, with torch's roundings: weight decay and the update are each one add with alpha
// (grad.add(p, alpha=wd), p.add_(d, alpha=-lr)), not a multiply then an add. bufs are the
// momentum buffers (ignored when momentum = 0); first = 1 copies the gradient into them, as torch
// does when a buffer is new.
char* rn_sgd(void** params, void** bufs, size_t n, int first, double lr, double momentum, double weight_decay);

// The type that autocast regions on device_type (a c10::DeviceType: 0 CPU, 1 CUDA) compute in:
// scalar_type is a c10::ScalarType (5 Half, 15 BFloat16). torch.autocast(dtype=...).
char* rn_set_autocast_dtype(int device_type, int scalar_type);

// The CPU kernels this process computes with. pin = 1 first turns libtorch's oneDNN (mkldnn) and
// NNPACK paths off (convolutions and GELU then run ATen's own kernels, whose instruction set
// ATEN_CPU_CAPABILITY fixes, and matrix products MKL's); it must come before anything computes.
// *capability is ATen's CPU capability in effect ("DEFAULT", "AVX2", "AVX512"; freed with
// rn_free_string), read after ATEN_CPU_CAPABILITY was set; *onednn and *nnpack say whether
// those paths are on.
char* rn_cpu_kernels(int pin, char** capability, int* onednn, int* nnpack);

// What libtorch sees of CUDA device `index`: its name (*name, freed with rn_free_string), compute
// capability, memory and multiprocessor count (torch.cuda.get_device_properties). An error in a
// build without CUDA, or for a device that does not exist.
char* rn_cuda_device(int index, char** name, int* major, int* minor, int64_t* total_bytes, int* processors);

// The most memory libtorch's CUDA caching allocator has handed out (*allocated) and held from the
// driver (*reserved) on device `index` since the process started, in bytes
// (torch.cuda.max_memory_allocated / max_memory_reserved).
char* rn_cuda_peak_memory(int index, int64_t* allocated, int64_t* reserved);

// CUDA events (csrc/events.cpp): *event, recorded now on the current stream of cuda:index, with
// timing on; freed with rn_cuda_event_free. *done = 1 once the device has passed it (no wait).
// *ms: the device's time from `from` to `to`, waiting for `to` to pass. Errors in a build
// without CUDA.
char* rn_cuda_event_record(int index, void** event);
char* rn_cuda_event_done(void* event, int* done);
char* rn_cuda_event_elapsed(void* from, void* to, double* ms);
void rn_cuda_event_free(void* event);

// CUDA graphs (csrc/graph.cpp). rn_cuda_side_stream makes a stream of libtorch's pool the current
// one of cuda:index on this thread (a capture needs a stream other than the default). Between
// rn_cuda_graph_begin and rn_cuda_graph_end the kernels launched on the current stream are
// recorded, not run (torch.cuda.CUDAGraph.capture_begin / capture_end); rn_cuda_graph_end fails
// where the capture did (an operation a capture cannot hold), and always ends it.
// rn_cuda_graph_replay launches them again, on the same memory. Errors in a build without CUDA.
typedef struct rn_graph rn_graph;
char* rn_cuda_side_stream(int index);
char* rn_cuda_graph_begin(rn_graph** out);
char* rn_cuda_graph_end(rn_graph* graph);
char* rn_cuda_graph_replay(rn_graph* graph);
void rn_cuda_graph_free(rn_graph* graph);

// Autocast to bfloat16 on this thread, on CPU and CUDA (torch.autocast(device, dtype=torch.bfloat16)
// for the device the tensors are on): enabled = 1 enters a region, enabled = 0 leaves it (clearing
// the cache of cast weights when the outermost region ends, as torch does, so updated weights are
// cast afresh).
char* rn_autocast_bf16(int enabled);

// A new tensor (*out, owned by the caller, freed as a tch Tensor) that autograd differentiates:
// `input` summed over every rank of pg where in_forward is non-zero (else a copy of it), its
// incoming gradient summed over the ranks where in_backward is (else passed back as it is).
// Both: the collective SyncBatchNorm runs; backward only / forward only: the two conjugate
// collectives around a tensor-parallel layer pair (Megatron's f and g).
char* rn_all_reduce_sum_autograd(rn_pg* pg, void* input, int in_forward, int in_backward, void** out);

// Sequence parallelism's collectives along dimension `dim` of `input`, as a new tensor (*out,
// owned by the caller) that autograd differentiates. RN_SCATTER_SUM: the sum over the ranks of
// pg, this rank's rank-th part along dim kept (reduce-scatter); backward, the gradient's parts
// gathered. RN_GATHER_SUM_BACK: every rank's part concatenated along dim (all-gather); backward,
// the gradient reduce-scattered. RN_GATHER_PART_BACK: the same gather; backward, this rank's part
// of the gradient kept (every rank computed the same gradient of the whole).
#define RN_SCATTER_SUM 0
#define RN_GATHER_SUM_BACK 1
#define RN_GATHER_PART_BACK 2
char* rn_along_dim_autograd(rn_pg* pg, void* input, int64_t dim, int mode, void** out);

// Activation checkpointing (csrc/checkpoint.cpp). A segment is a function of one tensor that the
// caller supplies as `call(closure, input, &output)`: it takes ownership of `input` (an
// at::Tensor*), writes a new at::Tensor* into *output and returns NULL, or returns a malloc'd
// message. rn_checkpoint runs the segment on `input` under no_grad and returns its output (*out,
// owned by the caller) as a new tensor autograd differentiates: its backward pass restores the
// default generators' states and autocast's flags of the forward, runs the segment again with grad
// on the input detached, and differentiates it with respect to the input and `params` (the
// segment's parameters). The bridge owns `closure` from the call on and frees it with
// `drop(closure)` once no backward pass can need it (at once when the call fails).
typedef char* (*rn_segment_fn)(void* closure, void* input, void** output);
typedef void (*rn_segment_drop)(void* closure);
char* rn_checkpoint(void* input, void** params, size_t n_params, rn_segment_fn call, rn_segment_drop drop,
                    void* closure, void** out);
// Selective checkpointing: linear(segment(source), weight, bias) as a tensor whose backward pass
// runs the segment again (as rn_checkpoint does) but not the product, whose gradients it computes
// as at::linear's backward does. `params`: the segment's n_segment parameters, then the weight,
// then the bias if there is one. The segment's output must be a contiguous [B, T, features].
char* rn_checkpoint_linear(void* source, void** params, size_t n_params, size_t n_segment, rn_segment_fn call,
                           rn_segment_drop drop, void* closure, void** out);
// Nanoseconds this process has spent recomputing checkpointed segments in backward passes (host
// time: on CUDA, the kernels' launches), since it started.
int64_t rn_checkpoint_recompute_ns(void);

// A TorchScript module (torch.jit.save's archive) loaded onto device (a c10::DeviceType, with
// device_index): tch's CModule lists its parameters but not its buffers, which the runner
// checkpoints, broadcasts and saves with them.
typedef struct rn_script rn_script;
char* rn_script_load(const char* path, int device_type, int device_index, rn_script** out);
void rn_script_free(rn_script* m);
// The number of parameters (buffers = 0) or buffers (buffers = 1), in named_parameters() /
// named_buffers() order (PyTorch's state_dict order within each).
char* rn_script_count(rn_script* m, int buffers, size_t* n);
// Entry i of that list: its dotted name (malloc'd, NUL-terminated, freed with rn_free_string) and
// the tensor itself (a new at::Tensor sharing the module's storage, owned by the caller).
char* rn_script_entry(rn_script* m, int buffers, size_t i, char** name, void** tensor);
// module.train(training != 0).
char* rn_script_train(rn_script* m, int training);
// module.forward(input), which must return a tensor (*out, owned by the caller).
char* rn_script_forward(rn_script* m, void* input, void** out);

// Sharded data parallelism (csrc/fsdp.cpp), FSDP2's design over a process group: every rank keeps
// a dim-0 shard of each parameter (rows padded to a multiple of the world size, as FSDP2 pads),
// gathered into the parameter's own storage just before a layer's forward and again before its
// backward, and freed after (the storage resized to 0, so autograd's saved views of the parameter
// are freed with it). Each unit's gradients are reduce-scattered, averaged, as soon as the
// backward pass has accumulated all of them, while the backward of the layers before it goes on.
typedef struct rn_fsdp rn_fsdp;

typedef struct rn_fsdp_stats {
  // Bytes: this rank's shards of every parameter (padding included); of their gradients now; the
  // most held at once since the last reset of gathered parameters (with the all-gather's buffer)
  // and of gradients (the shards', the reduce-scatter buffers, a whole gradient being copied in).
  int64_t shard_bytes;
  int64_t shard_grad_bytes;
  int64_t peak_gathered_bytes;
  int64_t peak_grad_bytes;
  // Since the last reset: nanoseconds blocked waiting for all-gathers and for reduce-scatters,
  // spent copying gradients in and parameters out, and how many of each collective ran.
  int64_t gather_wait_ns;
  int64_t reduce_wait_ns;
  int64_t copy_ns;
  int64_t gathers;
  int64_t reduces;
} rn_fsdp_stats;

// A sharding of n_units units, none sharded yet (rn_fsdp_add_unit shards each in turn).
// layer_units: for each layer (module) in forward order, the units its forward reads
// (layer_counts[l] of them, flattened): a layer reads its own unit, and a layer sharing another
// unit's parameter (a tied output head) that unit too. zero3 = 1 frees a unit after the forward of
// the last layer reading it (except the model's last layer, whose backward comes at once) and
// gathers it again before that layer's backward; zero3 = 0 keeps it from its forward to the end of
// its backward. Every rank must make the same.
char* rn_fsdp_new(rn_pg* pg, size_t n_units, const size_t* layer_units, const size_t* layer_counts, size_t n_layers,
                  int zero3, rn_fsdp** out);
// Shards the next unit: params, its parameters in module order (leaves of at least one dimension,
// all trainable, or all frozen: a frozen unit, a LoRA run's base, gets no gradients and no
// reduce-scatter, and is freed once the backward has passed every layer reading it). Copies this rank's rows of each into its shard and frees the parameters' own memory,
// so that a model built and sharded one unit at a time never holds more than one unit whole. Every
// rank must call it with the same shapes; the other calls need every unit sharded.
char* rn_fsdp_add_unit(rn_fsdp* f, void** params, size_t n_params);
void rn_fsdp_free(rn_fsdp* f);
// This rank's shard of parameter i (module order), rows [rank·k, rank·k + k) of the parameter
// padded to world_size·k rows: a new handle on the leaf tensor the optimizer updates in place,
// whose gradient rn_fsdp_finish_backward sets.
char* rn_fsdp_shard(rn_fsdp* f, size_t i, void** out);
// Before layer l's forward: its units gathered.
char* rn_fsdp_pre_forward(rn_fsdp* f, size_t layer);
// After layer l's forward, with its output: where autograd records (grad mode, an output that
// requires grad) a hook on the output gathers the layer's units again before its backward; units
// read for the last time are freed as zero3 says (always when autograd does not record).
char* rn_fsdp_post_forward(rn_fsdp* f, size_t layer, void* output);
// After a backward pass: reduce-scatters the units the hooks did not (parameters without a
// gradient count as zeros), waits for every reduce-scatter, adds the averaged gradients to the
// shards' .grad, and frees every unit still gathered.
char* rn_fsdp_finish_backward(rn_fsdp* f);
// Parameter i whole, on every rank (all-gathered from the shards): a new tensor.
char* rn_fsdp_full(rn_fsdp* f, size_t i, void** out);
// The counters; reset = 1 restarts the peaks (from what is held now) and the times.
char* rn_fsdp_read_stats(rn_fsdp* f, int reset, rn_fsdp_stats* out);

// The CPU allocator of libtorch's tensors in this process (csrc/memory.cpp): blocks from 1 MiB
// are cached by size class and reused, smaller ones are glibc's. Install it before the tensors it
// should serve are made. rn_memory_phase marks the start of a phase of the run (a training step, a
// validation, a checkpoint): a request no cached block fits first gives back to the kernel the
// cached blocks that the current phase has not used.
typedef struct rn_memory_stats {
  // Bytes of large blocks: in tensors now, cached for reuse, mapped (the two together), and the
  // most in tensors and mapped at once.
  int64_t used_bytes;
  int64_t cached_bytes;
  int64_t mapped_bytes;
  int64_t peak_used_bytes;
  int64_t peak_mapped_bytes;
  // Blocks mapped and unmapped so far.
  int64_t maps;
  int64_t unmaps;
} rn_memory_stats;

char* rn_memory_install(void);
void rn_memory_phase(void);
char* rn_memory_read_stats(rn_memory_stats* out);

#ifdef __cplusplus
}
#endif
