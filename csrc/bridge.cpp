// The C++ half of runner's bridge to c10d; see bridge.h for the contract.
#include "bridge.h"
#include "internal.hpp"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_addcdiv.h>
#include <ATen/ops/_foreach_addcmul.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_lerp.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sqrt.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/Context.h>
#include <ATen/Version.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#ifdef RUNNER_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

struct rn_store {
  // What every call goes through: the TCPStore itself, or a PrefixStore over it.
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::TCPStore> tcp;
};

struct rn_ddp {
  std::shared_ptr<c10d::Reducer> reducer;
  std::shared_ptr<c10d::Logger> logger;
  // The parameters in the order given, to name the Reducer's buckets by index.
  std::vector<at::Tensor> params;
};

using rn::copy_message;
using rn::protect;
using rn::tensor;
using rn::tensors;

namespace {

// libtorch's own output stays off the user's terminal: every failure reaches the runner as an
// exception, which the bridge returns as one line that the runner says in its own words.
// - c10d logs what it retries on and what times out (store connects, socket timeouts) with the
//   exception's full what(): "Exception raised from ... (most recent call first)" and ~20 C++
//   frames per retry. Exceptions record no backtrace (cheaper, too), and
// - c10's log lines ([c10d] ..., and libtorch's warnings) are shown only when the user asks for
//   them with TORCH_CPP_LOG_LEVEL, as libtorch reads it; otherwise only fatal ones.
const bool quiet_libtorch = [] {
  c10::SetStackTraceFetcher([]() -> std::string { return ""; });
  const char* level = std::getenv("TORCH_CPP_LOG_LEVEL");
  if (level == nullptr || *level == '\0') FLAGS_caffe2_log_level = 3;  // c10::GLOG_FATAL
  return true;
}();

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case RN_SUM:
    case RN_AVG:  // gloo has no AVG: sum, then divide.
      return c10d::ReduceOp::SUM;
    case RN_MIN:
      return c10d::ReduceOp::MIN;
    case RN_MAX:
      return c10d::ReduceOp::MAX;
  }
  throw std::invalid_argument("unknown reduce op " + std::to_string(op));
}

void set_backend(rn_pg* out, c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                 c10::intrusive_ptr<c10d::Backend> backend, std::initializer_list<c10::DeviceType> devices,
                 c10d::ProcessGroup::BackendType type) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setDefaultBackend(type);
  backend->setGroupUid("runner");
  auto counted = c10::make_intrusive<rn::Counted>(backend);
  // Collectives dispatch by device, to the counting wrapper. The real backend stays registered
  // under its own type: DDP's Logger looks it up by type and casts it to ProcessGroupGloo (or
  // NCCL) to read its settings, which the wrapper is not.
  for (auto device : devices) {
    pg->setBackend(device, type, backend);
    pg->setBackend(device, c10d::ProcessGroup::BackendType::CUSTOM, counted);
  }
  out->pg = pg;
  out->backend = counted;
  out->counted = counted;
}

}  // namespace

extern "C" {

void rn_free_string(char* s) { std::free(s); }
void rn_free_bytes(uint8_t* b) { std::free(b); }

char* rn_store_new(const char* host, uint16_t port, int is_server, int listen_fd, int num_workers,
                   int64_t timeout_ms, rn_store** out) {
  return protect([&] {
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_server != 0;
    if (num_workers > 0) opts.numWorkers = static_cast<size_t>(num_workers);
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    if (listen_fd >= 0) opts.masterListenFd = listen_fd;
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    *out = new rn_store{store, store};
  });
}

void rn_store_free(rn_store* s) {
  (void)protect([&] { delete s; });
}

char* rn_store_set(rn_store* s, const char* key, const uint8_t* value, size_t len) {
  return protect([&] { s->store->set(key, std::vector<uint8_t>(value, value + len)); });
}

char* rn_store_get(rn_store* s, const char* key, uint8_t** value, size_t* len) {
  return protect([&] {
    auto v = s->store->get(key);
    auto* buf = static_cast<uint8_t*>(std::malloc(v.empty() ? 1 : v.size()));
    if (buf == nullptr) throw std::bad_alloc();
    if (!v.empty()) std::memcpy(buf, v.data(), v.size());
    *value = buf;
    *len = v.size();
  });
}

char* rn_store_add(rn_store* s, const char* key, int64_t delta, int64_t* out) {
  return protect([&] { *out = s->store->add(key, delta); });
}

char* rn_store_check(rn_store* s, const char* key, int* present) {
  return protect([&] { *present = s->store->check({std::string(key)}) ? 1 : 0; });
}

char* rn_store_port(rn_store* s, uint16_t* out) {
  return protect([&] { *out = s->tcp->getPort(); });
}

char* rn_store_prefixed(rn_store* s, const char* prefix, rn_store** out) {
  return protect([&] {
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), s->store);
    *out = new rn_store{store, s->tcp};
  });
}

char* rn_pg_new_gloo(rn_store* s, int rank, int size, const char* device_host, int64_t timeout_ms,
                     rn_pg** out) {
  return rn_pg_new_gloo_group(s, "runner/pg", rank, size, device_host, timeout_ms, out);
}

char* rn_pg_new_gloo_group(rn_store* s, const char* prefix, int rank, int size, const char* device_host,
                           int64_t timeout_ms, rn_pg** out) {
  return protect([&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, s->store);
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(device_host));
    auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
    auto pg = std::make_unique<rn_pg>();
    // Gloo serves CUDA tensors too (through host memory), as init_process_group("gloo")
    // registers it: the Reducer of ranks that share a GPU asks the group for CUDA's backend.
    set_backend(pg.get(), store, rank, size, backend, {c10::DeviceType::CPU, c10::DeviceType::CUDA},
                c10d::ProcessGroup::BackendType::GLOO);
    *out = pg.release();
  });
}

char* rn_pg_new_nccl(rn_store* s, int rank, int size, int device_index, int64_t timeout_ms, rn_pg** out) {
#ifdef RUNNER_NCCL
  return protect([&] {
    // As torch.cuda.set_device(local_rank) then init_process_group(device_id=...): NCCL's
    // communicator, its streams and barrier() use this rank's own GPU.
    int count = c10::cuda::device_count();
    if (device_index < 0 || device_index >= count) {
      throw std::invalid_argument("cuda:" + std::to_string(device_index) + " does not exist: " +
                                  std::to_string(count) + " CUDA device(s) visible");
    }
    auto device = at::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
    c10::cuda::set_device(device.index());
    auto store = c10::make_intrusive<c10d::PrefixStore>("runner/pg", s->store);
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::milliseconds(timeout_ms);
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
    backend->setBoundDeviceId(device);
    auto pg = std::make_unique<rn_pg>();
    set_backend(pg.get(), store, rank, size, backend, {c10::DeviceType::CUDA},
                c10d::ProcessGroup::BackendType::NCCL);
    pg->pg->setBoundDeviceId(device);
    pg->coalesce_p2p = true;
    *out = pg.release();
  });
#else
  (void)s, (void)rank, (void)size, (void)device_index, (void)timeout_ms, (void)out;
  return copy_message("the nccl backend needs runner built with `--features cuda`");
#endif
}

void rn_pg_free(rn_pg* pg) {
  (void)protect([&] { delete pg; });
}

char* rn_pg_all_reduce(rn_pg* pg, void* t, int op) {
  return protect([&] {
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    pg->backend->allreduce(ts, opts)->wait();
    if (op == RN_AVG) {
      torch::NoGradGuard no_grad;
      tensor(t).div_(pg->pg->getSize());
    }
  });
}

struct rn_work {
  c10::intrusive_ptr<c10d::Work> work;
};

char* rn_pg_all_reduce_start(rn_pg* pg, void* t, int op, rn_work** out) {
  return protect([&] {
    if (op == RN_AVG) throw std::invalid_argument("an all-reduce in flight cannot average");
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    *out = new rn_work{pg->backend->allreduce(ts, opts)};
  });
}

char* rn_work_wait(rn_work* w) {
  return protect([&] { w->work->wait(); });
}

void rn_work_free(rn_work* w) { delete w; }

char* rn_pg_broadcast(rn_pg* pg, void* t, int root) {
  return protect([&] {
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    pg->backend->broadcast(ts, opts)->wait();
  });
}

char* rn_pg_all_gather(rn_pg* pg, void** outputs, size_t n_outputs, void* input) {
  return protect([&] {
    std::vector<std::vector<at::Tensor>> outs{tensors(outputs, n_outputs)};
    std::vector<at::Tensor> in{tensor(input)};
    pg->backend->allgather(outs, in)->wait();
  });
}

char* rn_pg_send(rn_pg* pg, void* t, int dst, int tag) {
  return protect([&] {
    std::vector<at::Tensor> ts{tensor(t)};
    pg->backend->send(ts, dst, tag)->wait();
  });
}

char* rn_pg_recv(rn_pg* pg, void* t, int src, int tag) {
  return protect([&] {
    std::vector<at::Tensor> ts{tensor(t)};
    pg->backend->recv(ts, src, tag)->wait();
  });
}

char* rn_pg_send_recv(rn_pg* pg, void* send_t, int dst, int send_tag, void* recv_t, int src, int recv_tag) {
  return protect([&] {
    std::vector<at::Tensor> out{tensor(send_t)};
    std::vector<at::Tensor> in{tensor(recv_t)};
    if (pg->coalesce_p2p) {
      // NCCL runs a pair's receive and send in one group; posted one after the other on the
      // same stream, each peer's receive would wait for a send queued behind its own.
      pg->backend->startCoalescing();
      try {
        pg->backend->recv(in, src, recv_tag);
        pg->backend->send(out, dst, send_tag);
      } catch (...) {
        try {
          (void)pg->backend->endCoalescing();
        } catch (...) {
        }
        throw;
      }
      pg->backend->endCoalescing()->wait();
      return;
    }
    // Both are posted before either is waited on: gloo's sends wait for the matching receive, so
    // two peers sending to each other first would otherwise wait forever.
    auto recv = pg->backend->recv(in, src, recv_tag);
    auto send = pg->backend->send(out, dst, send_tag);
    std::exception_ptr failed;
    try {
      send->wait();
    } catch (...) {
      failed = std::current_exception();
    }
    // Waited for even after a failed send: the receive must not outlive its work.
    try {
      recv->wait();
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
    if (failed) std::rethrow_exception(failed);
  });
}

void rn_pg_sent(rn_pg* pg, uint64_t* collective, uint64_t* p2p) {
  *collective = pg->counted->collective_bytes();
  *p2p = pg->counted->p2p_bytes();
}

char* rn_pg_barrier(rn_pg* pg) {
  return protect([&] { pg->backend->barrier()->wait(); });
}

char* rn_ddp_new(rn_pg* pg, void** params_ptr, size_t n_params, int64_t bucket_cap_bytes,
                 int64_t stats_every, const size_t* layout, const size_t* bucket_sizes, size_t n_buckets,
                 rn_ddp** out) {
  return protect([&] {
    auto params = tensors(params_ptr, n_params);
    {
      // Replicas start identical whatever each rank's seed: rank 0's values win.
      torch::NoGradGuard no_grad;
      c10d::broadcast_coalesced(pg->pg, params, 250 * 1024 * 1024, 0);
    }
    // The bucket layouts of torch.nn.parallel.DistributedDataParallel (find_unused_parameters =
    // False), so that gradients are summed in the same order as torch's: the first iteration has
    // every parameter in one bucket, in parameter order; before the second, rebuild_buckets()
    // lays them out in the order their gradients became ready, a 1 MiB first bucket (so
    // communication starts early in the backward pass) then bucket_cap_bytes each.
    const int64_t first_bucket_cap = 1024 * 1024;
    std::vector<bool> sparse(n_params, false);
    std::vector<std::vector<size_t>> buckets(1, std::vector<size_t>(n_params));
    std::iota(buckets[0].begin(), buckets[0].end(), 0);
    if (n_buckets > 0) {
      // A resumed run starts from the layout the interrupted one had rebuilt (recorded in its
      // checkpoint), so it sums gradients exactly as an uninterrupted run does.
      std::vector<bool> seen(n_params, false);
      buckets.assign(n_buckets, {});
      size_t at = 0;
      for (size_t b = 0; b < n_buckets; ++b) {
        for (size_t k = 0; k < bucket_sizes[b]; ++k, ++at) {
          TORCH_CHECK(at < n_params, "the recorded bucket layout holds more than the model's ", n_params,
                      " parameters");
          size_t index = layout[at];
          TORCH_CHECK(index < n_params && !seen[index],
                      "the recorded bucket layout does not match the model's ", n_params, " parameters");
          seen[index] = true;
          buckets[b].push_back(index);
        }
      }
      TORCH_CHECK(at == n_params, "the recorded bucket layout holds ", at, " parameters, the model ", n_params);
    }
    // gradient_as_bucket_view: after the all-reduce each gradient is a view of its bucket, not a
    // copy back out of it (one copy of the model's gradients less per step; the same sums).
    auto reducer = std::make_shared<c10d::Reducer>(
        params, buckets, pg->pg, sparse, bucket_cap_bytes, /*find_unused_parameters=*/false,
        /*gradient_as_bucket_view=*/true, std::unordered_map<size_t, std::string>{},
        first_bucket_cap, /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
        /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
    auto logger = std::make_shared<c10d::Logger>(reducer);
    reducer->set_logger(logger);
    logger->set_construction_data_and_log("runner", {}, -1, false, false, false);
    reducer->set_ddp_runtime_logging_sample_rate(static_cast<int>(std::max<int64_t>(stats_every, 1)));
    *out = new rn_ddp{reducer, logger, params};
  });
}

void rn_ddp_free(rn_ddp* d) {
  (void)protect([&] { delete d; });
}

char* rn_ddp_prepare_forward(rn_ddp* d) {
  return protect([&] {
    d->reducer->prepare_for_forward();
    // As torch's forward: once, after the first iteration (a no-op afterwards).
    d->reducer->rebuild_buckets();
  });
}

char* rn_ddp_prepare_backward(rn_ddp* d, void** outputs, size_t n_outputs) {
  return protect([&] { d->reducer->prepare_for_backward(tensors(outputs, n_outputs)); });
}

char* rn_ddp_record_stats(rn_ddp* d, rn_ddp_stats* out) {
  return protect([&] {
    d->logger->set_runtime_stats_and_log();
    auto data = d->logger->get_ddp_logging_data();
    auto get = [&](const char* k) -> int64_t {
      auto it = data.ints_map.find(k);
      return it == data.ints_map.end() ? -1 : it->second;
    };
    out->forward_compute_ns = get("forward_compute_time");
    out->backward_compute_ns = get("backward_compute_time");
    out->backward_comm_ns = get("backward_comm_time");
    out->backward_compute_comm_overlap_ns = get("backward_compute_comm_overlap_time");
    out->iteration = get("iteration");
  });
}

char* rn_ddp_bucket_count(rn_ddp* d, size_t* out) {
  return protect([&] { *out = d->reducer->get_grad_buckets(/*return_zero_tensors=*/true).size(); });
}

char* rn_clear_grads(void** params, size_t n) {
  return protect([&] {
    for (size_t i = 0; i < n; ++i) tensor(params[i]).mutable_grad().reset();
  });
}

namespace {

// torch.optim.Adam(foreach=True)'s update (_multi_tensor_adam, not capturable): the same formula
// as the fused kernel in a few multi-tensor passes, each over every parameter at once.
void foreach_adam(std::vector<at::Tensor>& p, std::vector<at::Tensor> g, std::vector<at::Tensor>& m,
                  std::vector<at::Tensor>& v, double step, double lr, double beta1, double beta2,
                  double weight_decay, double eps, bool decoupled) {
  if (weight_decay != 0.0) {
    if (decoupled) {
      at::_foreach_mul_(p, 1.0 - lr * weight_decay);
    } else {
      g = at::_foreach_add(g, p, weight_decay);
    }
  }
  at::_foreach_lerp_(m, g, 1.0 - beta1);
  at::_foreach_mul_(v, beta2);
  at::_foreach_addcmul_(v, g, g, 1.0 - beta2);
  double bias_correction1 = 1.0 - std::pow(beta1, step);
  double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(beta2, step));
  std::vector<at::Scalar> step_size(p.size(), at::Scalar(-(lr / bias_correction1)));
  std::vector<at::Scalar> root(p.size(), at::Scalar(bias_correction2_sqrt));
  auto denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, root);
  at::_foreach_add_(denom, eps);
  at::_foreach_addcdiv_(p, m, denom, step_size);
}

}  // namespace

char* rn_adam(void** params, void** exp_avgs, void** exp_avg_sqs, size_t n, double step, double lr, double beta1,
              double beta2, double weight_decay, double eps, int decoupled, int fused) {
  return protect([&] {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> p, g, m, v;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& grad = tensor(params[i]).grad();
      if (!grad.defined()) continue;
      p.push_back(tensor(params[i]));
      g.push_back(grad);
      m.push_back(tensor(exp_avgs[i]));
      v.push_back(tensor(exp_avg_sqs[i]));
    }
    if (p.empty()) return;
    if (!fused) {
      foreach_adam(p, g, m, v, step, lr, beta1, beta2, weight_decay, eps, decoupled != 0);
      return;
    }
    // The kernel reads each parameter's step from a float32 scalar on the parameters' device (as
    // torch.optim.Adam(fused=True) keeps it); one serves them all.
    auto on = p[0].device();
    std::vector<at::Tensor> steps(p.size(), at::scalar_tensor(step, at::TensorOptions().dtype(at::kFloat).device(on)));
    if (decoupled) {
      at::_fused_adamw_(p, g, m, v, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false);
    } else {
      at::_fused_adam_(p, g, m, v, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false);
    }
  });
}

char* rn_sgd(void** params, void** bufs, size_t n, int first, double lr, double momentum, double weight_decay) {
  return protect([&] {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < n; ++i) {
      at::Tensor& p = tensor(params[i]);
      at::Tensor d = p.grad();
      if (!d.defined()) continue;
      if (weight_decay != 0.0) d = d.add(p, weight_decay);
      if (momentum != 0.0) {
        at::Tensor& buf = tensor(bufs[i]);
        if (first) {
          buf.copy_(d);
        } else {
          buf.mul_(momentum).add_(d);
        }
        d = buf;
      }
      p.add_(d, -lr);
    }
  });
}

char* rn_set_autocast_dtype(int device_type, int scalar_type) {
  return protect([&] {
    at::autocast::set_autocast_dtype(static_cast<at::DeviceType>(device_type),
                                     static_cast<at::ScalarType>(scalar_type));
  });
}

char* rn_cpu_kernels(int pin, char** capability, int* onednn, int* nnpack) {
  return protect([&] {
    auto& context = at::globalContext();
    if (pin) {
      context.setUserEnabledMkldnn(false);
      context.setUserEnabledNNPACK(false);
    }
    *capability = copy_message(at::get_cpu_capability().c_str());
    *onednn = context.userEnabledMkldnn() ? 1 : 0;
    *nnpack = context.userEnabledNNPACK() ? 1 : 0;
  });
}

char* rn_cuda_device(int index, char** name, int* major, int* minor, int64_t* total_bytes, int* processors) {
#ifdef RUNNER_NCCL
  return protect([&] {
    int count = c10::cuda::device_count();
    if (index < 0 || index >= count) {
      throw std::invalid_argument("cuda:" + std::to_string(index) + " does not exist: " + std::to_string(count) +
                                  " CUDA device(s) visible");
    }
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
    *name = copy_message(p->name);
    *major = p->major;
    *minor = p->minor;
    *total_bytes = static_cast<int64_t>(p->totalGlobalMem);
    *processors = p->multiProcessorCount;
  });
#else
  (void)index, (void)name, (void)major, (void)minor, (void)total_bytes, (void)processors;
  return copy_message("CUDA devices need runner built with `--features cuda`");
#endif
}

char* rn_cuda_peak_memory(int index, int64_t* allocated, int64_t* reserved) {
#ifdef RUNNER_NCCL
  return protect([&] {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    auto device = static_cast<c10::DeviceIndex>(index);
    // Index 0 of the stat arrays is the aggregate over small and large pools, as
    // torch.cuda.max_memory_allocated() reads it.
    auto stats = alloc::getDeviceStats(device);
    *allocated = stats.allocated_bytes[0].peak;
    *reserved = stats.reserved_bytes[0].peak;
  });
#else
  (void)index, (void)allocated, (void)reserved;
  return copy_message("CUDA memory needs runner built with `--features cuda`");
#endif
}

char* rn_autocast_bf16(int enabled) {
  return protect([&] {
    // Both devices' flags: a forward pass on CUDA tensors is cast by CUDA's autocast, one on CPU
    // tensors by CPU's, and a flag for a device the pass does not touch changes nothing.
    for (auto device : {at::kCPU, at::kCUDA}) {
      if (enabled) {
        at::autocast::set_autocast_dtype(device, at::kBFloat16);
        at::autocast::set_autocast_enabled(device, true);
      } else {
        at::autocast::set_autocast_enabled(device, false);
      }
    }
    if (enabled) {
      at::autocast::increment_nesting();
    } else if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
  });
}

}  // extern "C"

namespace {
void all_reduce_sum(rn_pg* pg, at::Tensor& t) {
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  pg->backend->allreduce(ts, opts)->wait();
}

// An all-reduced sum in either direction of autograd, or both: forward and backward, the sum over
// the ranks of a value every rank's loss depends on (SyncBatchNorm's statistics); backward only,
// the identity whose input's gradient sums every rank's (Megatron's copy into the tensor-parallel
// region, before a column-parallel layer); forward only, the sum of partial results whose
// gradient each rank already holds whole (Megatron's reduce out of the region, after a
// row-parallel layer).
struct AllReduceSum : public torch::autograd::Function<AllReduceSum> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t pg,
                            bool in_forward, bool in_backward) {
    ctx->saved_data["pg"] = pg;
    ctx->saved_data["in_backward"] = in_backward;
    at::Tensor t = x.detach().clone();
    if (in_forward) all_reduce_sum(reinterpret_cast<rn_pg*>(pg), t);
    return t;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor g = grads[0].contiguous().clone();
    if (ctx->saved_data["in_backward"].toBool()) {
      all_reduce_sum(reinterpret_cast<rn_pg*>(ctx->saved_data["pg"].toInt()), g);
    }
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

extern "C" char* rn_all_reduce_sum_autograd(rn_pg* pg, void* input, int in_forward, int in_backward, void** out) {
  return protect([&] {
    at::Tensor r = AllReduceSum::apply(tensor(input), reinterpret_cast<int64_t>(pg), in_forward != 0,
                                       in_backward != 0);
    *out = new at::Tensor(std::move(r));
  });
}

namespace {
// `x`'s parts from every rank of pg, concatenated along `dim` in rank order.
at::Tensor gather_along(rn_pg* pg, const at::Tensor& x, int64_t dim) {
  // The collectives take whole rows: the dimension moved first, each rank's part contiguous.
  at::Tensor part = x.movedim(dim, 0).contiguous();
  auto sizes = part.sizes().vec();
  sizes[0] *= pg->backend->getSize();
  at::Tensor whole = at::empty(sizes, part.options());
  pg->backend->_allgather_base(whole, part)->wait();
  return whole.movedim(0, dim).contiguous();
}

// The sum of `x` over the ranks of pg, of which this rank keeps its part along `dim`.
at::Tensor reduce_scatter_along(rn_pg* pg, const at::Tensor& x, int64_t dim) {
  at::Tensor whole = x.movedim(dim, 0).contiguous();
  auto sizes = whole.sizes().vec();
  TORCH_CHECK(sizes[0] % pg->backend->getSize() == 0, "dimension ", dim, " of size ", sizes[0],
              " does not split evenly over ", pg->backend->getSize(), " ranks");
  sizes[0] /= pg->backend->getSize();
  at::Tensor part = at::empty(sizes, whole.options());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  pg->backend->_reduce_scatter_base(part, whole, opts)->wait();
  return part.movedim(0, dim).contiguous();
}

// Sequence parallelism's two collectives, along one dimension of the activations (Megatron-SP's
// g and its conjugate). Gather: every rank's part concatenated; its backward pass reduce-scatters
// the gradient (the whole is the input of a column-parallel layer, whose ranks each hold a
// partial gradient of all of it) or, where the ranks compute the same loss from the whole
// (the logits), keeps this rank's part of it. Scatter: the sum of the ranks' partial results
// (a row-parallel layer's), this rank's part kept; its backward pass gathers the gradient.
struct AlongDim : public torch::autograd::Function<AlongDim> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t pg, int64_t dim,
                            int64_t mode) {
    ctx->saved_data["pg"] = pg;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["mode"] = mode;
    auto* p = reinterpret_cast<rn_pg*>(pg);
    at::Tensor in = x.detach();
    return mode == RN_SCATTER_SUM ? reduce_scatter_along(p, in, dim) : gather_along(p, in, dim);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* p = reinterpret_cast<rn_pg*>(ctx->saved_data["pg"].toInt());
    int64_t dim = ctx->saved_data["dim"].toInt(), mode = ctx->saved_data["mode"].toInt();
    const at::Tensor& g = grads[0];
    at::Tensor out;
    if (mode == RN_SCATTER_SUM) {
      out = gather_along(p, g, dim);
    } else if (mode == RN_GATHER_SUM_BACK) {
      out = reduce_scatter_along(p, g, dim);
    } else {
      int64_t part = g.size(dim) / p->backend->getSize();
      out = g.narrow(dim, part * p->backend->getRank(), part).contiguous();
    }
    return {out, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

extern "C" char* rn_along_dim_autograd(rn_pg* pg, void* input, int64_t dim, int mode, void** out) {
  return protect([&] {
    TORCH_CHECK(mode == RN_SCATTER_SUM || mode == RN_GATHER_SUM_BACK || mode == RN_GATHER_PART_BACK,
                "unknown mode ", mode);
    at::Tensor r = AlongDim::apply(tensor(input), reinterpret_cast<int64_t>(pg), dim, static_cast<int64_t>(mode));
    *out = new at::Tensor(std::move(r));
  });
}

char* rn_ddp_bucket_layout(rn_ddp* d, size_t* layout, size_t* bucket_sizes, size_t* n_buckets) {
  return protect([&] {
    std::unordered_map<const c10::TensorImpl*, size_t> index;
    for (size_t i = 0; i < d->params.size(); ++i) index[d->params[i].unsafeGetTensorImpl()] = i;
    auto buckets = d->reducer->get_grad_buckets(/*return_zero_tensors=*/true);
    TORCH_CHECK(buckets.size() <= d->params.size(), "more buckets than parameters");
    size_t at = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      auto params = buckets[b].getParameters();
      bucket_sizes[b] = params.size();
      for (const auto& p : params) {
        auto it = index.find(p.unsafeGetTensorImpl());
        TORCH_CHECK(it != index.end() && at < d->params.size(), "a bucket holds an unknown parameter");
        layout[at++] = it->second;
      }
    }
    *n_buckets = buckets.size();
  });
}

struct rn_script {
  torch::jit::Module module;
  // Snapshots of named_parameters() and named_buffers(): the tensors alias the module's.
  std::vector<std::pair<std::string, at::Tensor>> params, buffers;
};

extern "C" {

char* rn_script_load(const char* path, int device_type, int device_index, rn_script** out) {
  return protect([&] {
    c10::Device device(static_cast<c10::DeviceType>(device_type), static_cast<c10::DeviceIndex>(device_index));
    auto m = std::make_unique<rn_script>();
    m->module = torch::jit::load(path, device);
    for (const auto& p : m->module.named_parameters()) m->params.emplace_back(p.name, p.value);
    for (const auto& b : m->module.named_buffers()) m->buffers.emplace_back(b.name, b.value);
    *out = m.release();
  });
}

void rn_script_free(rn_script* m) { delete m; }

char* rn_script_count(rn_script* m, int buffers, size_t* n) {
  return protect([&] { *n = (buffers ? m->buffers : m->params).size(); });
}

char* rn_script_entry(rn_script* m, int buffers, size_t i, char** name, void** tensor) {
  return protect([&] {
    const auto& list = buffers ? m->buffers : m->params;
    TORCH_CHECK(i < list.size(), "no entry ", i);
    *name = copy_message(list[i].first.c_str());
    *tensor = new at::Tensor(list[i].second);
  });
}

char* rn_script_train(rn_script* m, int training) {
  return protect([&] { m->module.train(training != 0); });
}

char* rn_script_forward(rn_script* m, void* input, void** out) {
  return protect([&] {
    c10::IValue r = m->module.forward({tensor(input)});
    TORCH_CHECK(r.isTensor(), "forward returned ", r.tagKind(), ", not a tensor");
    *out = new at::Tensor(r.toTensor());
  });
}

}  // extern "C"
