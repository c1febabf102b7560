// Sharded data parallelism: FSDP2's design (torch/distributed/fsdp/_fully_shard/) over c10d, for
// the runner's layers. See bridge.h for the contract.
//
// A unit's state machine: sharded (its parameters' storage resized to 0 bytes; the rank holds
// only `flat`, its rows of every parameter) -> gathered (one all-gather of `flat` into a buffer
// of world × flat, copied out into each parameter's own padded storage) -> sharded again. The
// parameters keep their full shapes and stay leaves: the layers compute with them unchanged, and
// autograd's AccumulateGrad gives each its whole gradient, which a hook copies into the unit's
// reduce-scatter input at once and frees.
#include "bridge.h"
#include "internal.hpp"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/native/Resize.h>
#include <ATen/ops/split_with_sizes_copy.h>
#include <ATen/ops/sum.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#ifdef RUNNER_NCCL
// Declared here: ATen/native/cuda/Resize.h's inline code does not compile as C++17.
namespace at::native {
void resize_bytes_cuda(c10::StorageImpl* storage, size_t size_bytes);
}
#endif

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Param {
  // The module's own tensor: its full shape always; its storage holds world × shard_rows rows
  // while its unit is gathered (the first `rows` are the parameter), 0 bytes while sharded.
  at::Tensor param;
  // This rank's rows, a leaf tensor over part of the unit's `flat` storage.
  at::Tensor shard;
  int64_t rows = 0, shard_rows = 0, row_numel = 1;
  // Where its shard starts in the unit's flat shard.
  int64_t offset = 0;

  int64_t shard_numel() const { return shard_rows * row_numel; }
};

struct Unit {
  std::vector<Param> params;
  // This rank's shards of the unit's parameters, one after another: the all-gather's input.
  at::Tensor flat;
  bool gathered = false;
  // An all-gather in flight (a prefetch): its buffer and its work.
  at::Tensor gather_out;
  c10::intrusive_ptr<c10d::Work> gather_work;
  // The layer after whose forward it is freed (ZeRO-3), or -1: kept until its backward ends.
  int64_t free_after = -1;
  // The last layer that reads it (the forward's end, without autograd), and the first.
  int64_t last_read = -1;
  int64_t first_read = -1;
  // Parameters that are not trained (a LoRA run's base model): no gradients, no reduce-scatter;
  // gathered for the backward (the layers before need their input's gradient), freed when the
  // backward has passed every layer reading it.
  bool frozen = false;
  // This backward pass: parameters whose gradient was accumulated, and whether its reduce-scatter
  // started (`reduce_out` receives this rank's averaged rows).
  size_t grads_ready = 0;
  bool reduced = false;
  at::Tensor reduce_in, reduce_out;
  // Over gloo: what the all-to-all brings, every rank's rows of this rank's chunk.
  at::Tensor reduce_got;
  c10::intrusive_ptr<c10d::Work> reduce_work;

  int64_t chunk() const { return flat.numel(); }
};

}  // namespace

struct rn_fsdp {
  rn_pg* pg = nullptr;
  int64_t world = 1, rank = 0;
  // Whether the backend is gloo (its reduce-scatter is replaced, see start_reduce).
  bool gloo = true;
  std::vector<Unit> units;
  // Units whose parameters rn_fsdp_add_unit has sharded (the first `added`).
  size_t added = 0;
  // For each layer in forward order, the units its forward reads.
  std::vector<std::vector<size_t>> layers;
  // Units whose reduce-scatter is in flight (one at most), in the order started (the same on
  // every rank).
  std::vector<size_t> in_flight;
  int64_t gathered_bytes = 0;
  rn_fsdp_stats stats{};

  ~rn_fsdp();

  int64_t elt() const { return added == 0 ? 4 : units[0].flat.element_size(); }

  // Every unit sharded: what gathering, reducing and reading the shards need.
  void check_complete() const {
    TORCH_CHECK(added == units.size(), "the sharding holds ", added, " of its ", units.size(), " units");
  }

  void note_gathered(int64_t delta) {
    gathered_bytes += delta;
    stats.peak_gathered_bytes = std::max(stats.peak_gathered_bytes, gathered_bytes);
  }

  // The gradient bytes held now: the shards' gradients, the reduce-scatter buffers, and
  // `arriving` (a parameter's whole gradient, before it is copied into its unit's buffer).
  int64_t grad_bytes(int64_t arriving = 0) const {
    int64_t bytes = arriving;
    for (const auto& u : units) {
      if (u.reduce_in.defined()) bytes += u.reduce_in.numel() * elt();
      if (u.reduce_got.defined()) bytes += u.reduce_got.numel() * elt();
      if (u.reduce_out.defined()) bytes += u.reduce_out.numel() * elt();
      for (const auto& p : u.params) {
        const auto& g = p.shard.grad();
        // A gradient of the reduce-scatter's output in flight is counted there.
        if (g.defined() && !(u.reduce_out.defined() && g.is_alias_of(u.reduce_out))) bytes += g.numel() * elt();
      }
    }
    return bytes;
  }

  void note_grads(int64_t arriving = 0) {
    stats.peak_grad_bytes = std::max(stats.peak_grad_bytes, grad_bytes(arriving));
  }

  void start_gather(Unit& u);
  void gather(Unit& u);
  void gather_for(size_t layer, int64_t next);
  void free(Unit& u);
  void pre_backward(size_t layer);
  void grad_ready(size_t unit, size_t param);
  void reduce_input(Unit& u);
  void take_grad(Unit& u, Param& p);
  void start_reduce(size_t unit);
  void finish_reduce(size_t unit);
  void finish_in_flight();
  void finish_backward();
};

namespace {

// Gives `t`'s storage `bytes` bytes (its contents are not kept): how FSDP2 frees a gathered
// parameter (storage.resize_(0)), so every view of it, autograd's saved ones included, lets the
// memory go, and gets it back in place before the next use.
void resize_storage(const at::Tensor& t, size_t bytes) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  if (t.is_cpu()) {
    at::native::resize_bytes_cpu(storage, bytes);
    return;
  }
#ifdef RUNNER_NCCL
  if (t.is_cuda()) {
    at::native::resize_bytes_cuda(storage, bytes);
    return;
  }
#endif
  TORCH_CHECK(false, "sharding is not built for tensors on ", t.device());
}

// A tensor of `sizes` over `storage` from element `offset`: an alias with its own version
// counter, so writing through it is invisible to autograd's checks on the parameter.
at::Tensor alias(const at::Tensor& of, int64_t offset, at::IntArrayRef sizes) {
  at::NoGradGuard no_grad;
  auto strides = c10::contiguous_strides(sizes);
  return at::empty({0}, of.options().requires_grad(false)).set_(of.storage(), offset, sizes, strides);
}

int64_t padded_bytes(const Param& p, int64_t world) { return world * p.shard_numel() * p.param.element_size(); }

// After AccumulateGrad stored a parameter's gradient: hands it to its unit.
struct GradReady : public torch::autograd::PostAccumulateGradHook {
  rn_fsdp* fsdp;
  size_t unit, param;
  GradReady(rn_fsdp* f, size_t u, size_t p) : fsdp(f), unit(u), param(p) {}
  void operator()(const torch::autograd::Variable&) override { fsdp->grad_ready(unit, param); }
};

}  // namespace

rn_fsdp::~rn_fsdp() {
  for (auto& u : units) {
    if (u.frozen) continue;
    for (auto& p : u.params) torch::autograd::impl::set_post_acc_grad_hooks(p.param, nullptr);
  }
  // Work in flight writes into buffers we hold: let it end first.
  for (size_t u : in_flight) {
    try {
      units[u].reduce_work->wait();
    } catch (...) {
    }
  }
  for (auto& u : units) {
    try {
      if (u.gather_work) u.gather_work->wait();
    } catch (...) {
    }
  }
}

// Starts the unit's all-gather (its shards into one buffer of world × flat) and returns at once.
void rn_fsdp::start_gather(Unit& u) {
  if (u.gathered || u.gather_out.defined()) return;
  at::NoGradGuard no_grad;
  u.gather_out = at::empty({world * u.chunk()}, u.flat.options().requires_grad(false));
  note_gathered(world * u.chunk() * elt());
  if (world == 1) {
    u.gather_out.copy_(u.flat);
  } else {
    u.gather_work = pg->backend->_allgather_base(u.gather_out, u.flat);
  }
  stats.gathers += 1;
}

// The unit's parameters whole in their own storage: its all-gather (started here, or before as a
// prefetch) waited for and copied out.
void rn_fsdp::gather(Unit& u) {
  if (u.gathered) return;
  at::NoGradGuard no_grad;
  start_gather(u);
  int64_t t0 = now_ns();
  if (u.gather_work) u.gather_work->wait();
  int64_t t1 = now_ns();
  stats.gather_wait_ns += t1 - t0;
  std::vector<at::Tensor> targets;
  std::vector<int64_t> sizes;
  for (auto& p : u.params) {
    resize_storage(p.param, padded_bytes(p, world));
    note_gathered(padded_bytes(p, world));
    targets.push_back(alias(p.param, 0, {world, p.shard_numel()}));
    sizes.push_back(p.shard_numel());
  }
  // Rank r's rows of parameter p sit at [r][offset_p, offset_p + numel_p) of the gathered
  // buffer; the padded storage of p wants them at [r][0, numel_p): one copy of the whole unit.
  at::split_with_sizes_copy_out(targets, u.gather_out.view({world, u.chunk()}), sizes, 1);
  stats.copy_ns += now_ns() - t1;
  u.gather_out = at::Tensor();
  u.gather_work.reset();
  note_gathered(-world * u.chunk() * elt());
  u.gathered = true;
}

// Gathers what layer `layer` reads, then starts gathering what layer `next` reads (a layer
// index, or -1 for none): its all-gather runs while `layer` computes (FSDP2's prefetch, one
// layer ahead, forward and backward).
void rn_fsdp::gather_for(size_t layer, int64_t next) {
  for (size_t u : layers.at(layer)) gather(units[u]);
  if (next >= 0 && next < static_cast<int64_t>(layers.size())) {
    for (size_t u : layers[next]) start_gather(units[u]);
  }
}

void rn_fsdp::free(Unit& u) {
  if (!u.gathered) return;
  for (auto& p : u.params) {
    resize_storage(p.param, 0);
    note_gathered(-padded_bytes(p, world));
  }
  u.gathered = false;
}

void rn_fsdp::pre_backward(size_t layer) {
  // The backward has passed every layer after `layer`: a frozen unit read by none of the layers
  // up to `layer` is done (a trained one is freed when its gradients are reduced).
  for (auto& u : units) {
    if (u.frozen && u.first_read > static_cast<int64_t>(layer)) free(u);
  }
  gather_for(layer, static_cast<int64_t>(layer) - 1);
}

void rn_fsdp::grad_ready(size_t index, size_t param) {
  Unit& u = units.at(index);
  take_grad(u, u.params.at(param));
  u.grads_ready += 1;
  if (u.grads_ready == u.params.size() && !u.reduced) start_reduce(index);
}

// The unit's reduce-scatter input, zeros until its gradients are copied in.
void rn_fsdp::reduce_input(Unit& u) {
  if (u.reduce_in.defined()) return;
  // The reduce-scatter started before has had this unit's backward so far to run in: it ends
  // here, so that a rank holds one unit's gradient buffers at a time, not two.
  finish_in_flight();
  u.reduce_in = at::zeros({world * u.chunk()}, u.flat.options().requires_grad(false));
}

// Copies a parameter's whole gradient into its unit's reduce-scatter input and frees it: rank r's
// rows go to chunk r at the parameter's offset, as the shards lie in `flat` (zeros pad them).
void rn_fsdp::take_grad(Unit& u, Param& p) {
  at::NoGradGuard no_grad;
  int64_t t0 = now_ns();
  const int64_t chunk = u.chunk();
  reduce_input(u);
  at::Tensor grad = p.param.grad();
  note_grads(grad.defined() ? grad.numel() * grad.element_size() : 0);
  if (grad.defined()) {
    auto in = u.reduce_in.view({world, chunk});
    auto flat_grad = grad.reshape({-1});
    for (int64_t r = 0; r < world; ++r) {
      int64_t valid = std::clamp<int64_t>(p.rows - r * p.shard_rows, 0, p.shard_rows) * p.row_numel;
      if (valid == 0) break;
      in[r].narrow(0, p.offset, valid).copy_(flat_grad.narrow(0, r * p.shard_numel(), valid));
    }
  }
  p.param.mutable_grad().reset();
  stats.copy_ns += now_ns() - t0;
}

// Averages the unit's gradients (each scaled by 1/world, as DDP's Reducer scales them, then
// summed), frees its gathered parameters, and starts the reduce-scatter.
void rn_fsdp::start_reduce(size_t index) {
  Unit& u = units[index];
  at::NoGradGuard no_grad;
  // Gradients the hooks did not hand over (a parameter without one this pass counts as zeros).
  for (auto& p : u.params) {
    if (p.param.grad().defined()) take_grad(u, p);
  }
  reduce_input(u);
  const int64_t chunk = u.chunk();
  u.reduce_out = at::empty({chunk}, u.flat.options().requires_grad(false));
  note_grads();
  if (world > 1) u.reduce_in.mul_(1.0 / static_cast<double>(world));
  free(u);
  if (world == 1) {
    u.reduce_out.copy_(u.reduce_in);
    u.reduce_work.reset();
  } else if (gloo) {
    // gloo's reduce-scatter all-reduces the whole input and keeps a slice: twice the bytes of a
    // ring. One all-to-all moves what a ring moves (each rank's chunk r to rank r), and the
    // sum of the chunks that arrive is done when the unit's reduction is waited for.
    // (benches/reference/reduce_scatter.py measures the three.)
    u.reduce_got = at::empty_like(u.reduce_in);
    std::vector<int64_t> even;
    u.reduce_work = pg->backend->alltoall_base(u.reduce_got, u.reduce_in, even, even);
    note_grads();
  } else {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    u.reduce_work = pg->backend->_reduce_scatter_base(u.reduce_out, u.reduce_in, opts);
  }
  u.reduced = true;
  in_flight.push_back(index);
  stats.reduces += 1;
}

void rn_fsdp::finish_in_flight() {
  std::vector<size_t> started;
  started.swap(in_flight);
  for (size_t index : started) finish_reduce(index);
}

// Waits for the unit's reduce-scatter and adds its averaged rows to the shards' gradients.
void rn_fsdp::finish_reduce(size_t index) {
  Unit& u = units[index];
  at::NoGradGuard no_grad;
  int64_t t0 = now_ns();
  if (u.reduce_work) u.reduce_work->wait();
  stats.reduce_wait_ns += now_ns() - t0;
  if (u.reduce_got.defined()) {
    int64_t t1 = now_ns();
    // Every rank's rows of this rank's chunk, summed in rank order.
    at::sum_out(u.reduce_out, u.reduce_got.view({world, u.chunk()}), 0);
    u.reduce_got = at::Tensor();
    stats.copy_ns += now_ns() - t1;
  }
  for (auto& p : u.params) {
    auto g = u.reduce_out.narrow(0, p.offset, p.shard_numel()).view(p.shard.sizes());
    at::Tensor& grad = p.shard.mutable_grad();
    if (grad.defined()) {
      grad.add_(g);
    } else {
      grad = g;
    }
  }
  u.reduce_in = at::Tensor();
  u.reduce_out = at::Tensor();
  u.reduce_work.reset();
}

void rn_fsdp::finish_backward() {
  // Units the hooks did not start (a parameter that got no gradient counts as zeros), in unit
  // order: every rank reduce-scatters the same units in the same order.
  for (size_t i = 0; i < units.size(); ++i) {
    if (!units[i].reduced && !units[i].frozen) start_reduce(i);
  }
  finish_in_flight();
  for (auto& u : units) {
    // A prefetch no layer asked for (none is started past the first layer): waited for, dropped.
    if (u.gather_out.defined()) {
      if (u.gather_work) u.gather_work->wait();
      note_gathered(-u.gather_out.numel() * elt());
      u.gather_out = at::Tensor();
      u.gather_work.reset();
    }
    free(u);
    u.reduced = false;
    u.grads_ready = 0;
  }
}

extern "C" {

char* rn_fsdp_new(rn_pg* pg, size_t n_units, const size_t* layer_units, const size_t* layer_counts, size_t n_layers,
                  int zero3, rn_fsdp** out) {
  return rn::protect([&] {
    auto f = std::make_unique<rn_fsdp>();
    f->pg = pg;
    f->world = pg->pg->getSize();
    f->rank = pg->pg->getRank();
    f->gloo = pg->backend->getBackendName() == "gloo";
    // Units are filled in place by rn_fsdp_add_unit: the vector never grows after this.
    f->units.resize(n_units);
    size_t read = 0;
    for (size_t l = 0; l < n_layers; ++l) {
      std::vector<size_t> reads(layer_units + read, layer_units + read + layer_counts[l]);
      read += layer_counts[l];
      for (size_t u : reads) {
        TORCH_CHECK(u < n_units, "layer ", l, " reads unit ", u, " of ", n_units);
        f->units[u].last_read = static_cast<int64_t>(l);
        if (f->units[u].first_read < 0) f->units[u].first_read = static_cast<int64_t>(l);
      }
      f->layers.push_back(std::move(reads));
    }
    for (auto& unit : f->units) {
      TORCH_CHECK(unit.last_read >= 0, "a unit no layer reads");
      // The last layer's backward follows its forward at once: freeing it in between would only
      // gather it again (torchtitan does not reshard the last block either).
      bool last = unit.last_read + 1 == static_cast<int64_t>(n_layers);
      unit.free_after = zero3 && !last ? unit.last_read : -1;
    }
    *out = f.release();
  });
}

char* rn_fsdp_add_unit(rn_fsdp* f, void** params_ptr, size_t n_params) {
  return rn::protect([&] {
    TORCH_CHECK(f->added < f->units.size(), "all ", f->units.size(), " units are already sharded");
    TORCH_CHECK(n_params > 0, "unit ", f->added, " holds no parameter");
    const size_t u = f->added;
    Unit& unit = f->units[u];
    auto params = rn::tensors(params_ptr, n_params);
    at::NoGradGuard no_grad;
    int64_t offset = 0;
    for (size_t k = 0; k < n_params; ++k) {
      Param p;
      p.param = params[k];
      TORCH_CHECK(p.param.dim() >= 1, "parameter ", k, " of unit ", u, " is a scalar: sharding needs a first dimension");
      TORCH_CHECK(p.param.is_leaf(), "parameter ", k, " of unit ", u, " is not a leaf");
      // A unit is trained or frozen whole: its reduce-scatter covers all of its parameters.
      if (k == 0) unit.frozen = !p.param.requires_grad();
      TORCH_CHECK(p.param.requires_grad() != unit.frozen, "parameter ", k, " of unit ", u,
                  unit.frozen ? " is trained, but the unit's first is frozen" : " is frozen, but the unit's first is trained");
      p.rows = p.param.size(0);
      p.row_numel = p.rows == 0 ? 0 : p.param.numel() / p.rows;
      p.shard_rows = (p.rows + f->world - 1) / f->world;
      p.offset = offset;
      offset += p.shard_numel();
      unit.params.push_back(std::move(p));
    }
    // Zeros: the padding rows past a parameter's last row stay zero.
    unit.flat = at::zeros({offset}, unit.params[0].param.options().requires_grad(false));
    for (size_t k = 0; k < unit.params.size(); ++k) {
      Param& p = unit.params[k];
      // This rank's rows, straight from the parameter into the unit's flat shard.
      int64_t valid = std::clamp<int64_t>(p.rows - f->rank * p.shard_rows, 0, p.shard_rows) * p.row_numel;
      if (valid > 0) {
        auto whole = p.param.detach().reshape({-1});
        unit.flat.narrow(0, p.offset, valid).copy_(whole.narrow(0, f->rank * p.shard_numel(), valid));
      }
      std::vector<int64_t> shape = p.param.sizes().vec();
      shape[0] = p.shard_rows;
      p.shard = alias(unit.flat, p.offset, shape).set_requires_grad(!unit.frozen);
      // The parameter gets storage of its own, contiguous from offset 0 and as long as its padded
      // whole (the gathered rows of every rank land in it in one copy, and it is freed and regrown
      // without touching any other tensor), then freed: its built values go now, and the storage is
      // allocated but never written before it is resized to 0, so it costs no resident memory.
      auto storage = at::empty({f->world * p.shard_numel()}, p.param.options().requires_grad(false));
      p.param.set_data(storage.narrow(0, 0, p.param.numel()).view(p.param.sizes()));
      resize_storage(p.param, 0);
      if (!unit.frozen) torch::autograd::impl::set_post_acc_grad_hooks(p.param, std::make_unique<GradReady>(f, u, k));
      f->stats.shard_bytes += p.shard_numel() * p.param.element_size();
    }
    f->added += 1;
  });
}

void rn_fsdp_free(rn_fsdp* f) {
  (void)rn::protect([&] { delete f; });
}

char* rn_fsdp_shard(rn_fsdp* f, size_t i, void** out) {
  return rn::protect([&] {
    f->check_complete();
    for (auto& u : f->units) {
      if (i < u.params.size()) {
        *out = new at::Tensor(u.params[i].shard);
        return;
      }
      i -= u.params.size();
    }
    TORCH_CHECK(false, "no parameter ", i);
  });
}

char* rn_fsdp_pre_forward(rn_fsdp* f, size_t layer) {
  return rn::protect([&] {
    TORCH_CHECK(layer < f->layers.size(), "no layer ", layer);
    f->check_complete();
    f->gather_for(layer, static_cast<int64_t>(layer) + 1);
  });
}

char* rn_fsdp_post_forward(rn_fsdp* f, size_t layer, void* output) {
  return rn::protect([&] {
    TORCH_CHECK(layer < f->layers.size(), "no layer ", layer);
    at::Tensor& out = rn::tensor(output);
    bool recorded = c10::GradMode::is_enabled() && out.requires_grad();
    if (recorded) {
      out.register_hook([f, layer](const at::TensorBase&) { f->pre_backward(layer); });
    }
    for (size_t u : f->layers[layer]) {
      Unit& unit = f->units[u];
      int64_t after = recorded ? unit.free_after : unit.last_read;
      if (after == static_cast<int64_t>(layer)) f->free(unit);
    }
  });
}

char* rn_fsdp_finish_backward(rn_fsdp* f) {
  return rn::protect([&] {
    f->check_complete();
    f->finish_backward();
  });
}

char* rn_fsdp_full(rn_fsdp* f, size_t i, void** out) {
  return rn::protect([&] {
    f->check_complete();
    for (auto& u : f->units) {
      if (i >= u.params.size()) {
        i -= u.params.size();
        continue;
      }
      at::NoGradGuard no_grad;
      Param& p = u.params[i];
      auto whole = at::empty({f->world * p.shard_numel()}, p.shard.options().requires_grad(false));
      auto shard = p.shard.detach().reshape({-1});
      if (f->world == 1) {
        whole.copy_(shard);
      } else {
        f->pg->backend->_allgather_base(whole, shard)->wait();
      }
      *out = new at::Tensor(whole.narrow(0, 0, p.param.numel()).view(p.param.sizes()).clone());
      return;
    }
    TORCH_CHECK(false, "no parameter ", i);
  });
}

char* rn_fsdp_read_stats(rn_fsdp* f, int reset, rn_fsdp_stats* out) {
  return rn::protect([&] {
    f->stats.shard_grad_bytes = 0;
    for (auto& u : f->units) {
      for (auto& p : u.params) {
        if (p.shard.grad().defined()) f->stats.shard_grad_bytes += p.shard.grad().numel() * p.shard.element_size();
      }
    }
    *out = f->stats;
    if (reset) {
      int64_t shard_bytes = f->stats.shard_bytes;
      f->stats = rn_fsdp_stats{};
      f->stats.shard_bytes = shard_bytes;
      f->stats.peak_gathered_bytes = f->gathered_bytes;
      f->stats.peak_grad_bytes = f->grad_bytes();
    }
  });
}

}  // extern "C"
