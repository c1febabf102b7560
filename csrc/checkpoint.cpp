// Activation checkpointing: torch.utils.checkpoint's reentrant variant, which libtorch's C++ lacks.
// See bridge.h for the contract.
//
// One autograd node per checkpointed segment (a transformer block, an MLP layer). Its forward runs
// the segment under no_grad (custom functions' forward always does), so autograd keeps nothing of
// the segment but its input. Its backward restores the state the forward ran under (the default
// generators' states, so dropout draws the same masks; autocast's flags), runs the segment again
// with grad on a detached copy of the input, differentiates the new outputs with
// torch::autograd::grad, restores the states it found, and hands the gradients of the input and of
// the parameters to the outer graph, whose AccumulateGrad nodes (and DDP's and FSDP's hooks on
// them) see them as if the segment had been recorded.
#include "bridge.h"
#include "internal.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <vector>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/custom_class.h>

namespace {

// The Rust closure and how to call and free it; freed with the node that holds it.
struct Segment : torch::CustomClassHolder {
  rn_segment_fn call = nullptr;
  rn_segment_drop drop = nullptr;
  void* closure = nullptr;
  Segment(rn_segment_fn c, rn_segment_drop d, void* cl) : call(c), drop(d), closure(cl) {}
  ~Segment() override {
    if (closure != nullptr) drop(closure);
  }

  at::Tensor run(const at::Tensor& x) const {
    void* out = nullptr;
    char* err = call(closure, new at::Tensor(x), &out);
    if (err != nullptr) {
      std::string msg(err);
      std::free(err);
      TORCH_CHECK(false, "recomputing a checkpointed segment: ", msg);
    }
    std::unique_ptr<at::Tensor> owned(static_cast<at::Tensor*>(out));
    TORCH_CHECK(owned && owned->defined(), "a checkpointed segment returned no tensor");
    return *owned;
  }
};

// The default generator of each device the segment draws from: CPU's always, and the input's
// device's where it is not the CPU.
std::vector<at::Generator> generators(const at::Tensor& x) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  if (!x.is_cpu()) gens.push_back(at::globalContext().defaultGenerator(x.device()));
  return gens;
}

std::vector<at::Tensor> rng_states(std::vector<at::Generator> gens) {
  std::vector<at::Tensor> states;
  for (auto& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.push_back(g.get_state());
  }
  return states;
}

void set_rng_states(std::vector<at::Generator> gens, const std::vector<at::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    auto& g = gens[i];
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(states[i]);
  }
}

constexpr at::DeviceType kAutocastDevices[] = {at::kCPU, at::kCUDA};

struct AutocastState {
  bool enabled[2] = {false, false};
  at::ScalarType dtype[2] = {at::kBFloat16, at::kBFloat16};

  static AutocastState now() {
    AutocastState s;
    for (int i = 0; i < 2; ++i) {
      s.enabled[i] = at::autocast::is_autocast_enabled(kAutocastDevices[i]);
      s.dtype[i] = at::autocast::get_autocast_dtype(kAutocastDevices[i]);
    }
    return s;
  }
  void apply() const {
    for (int i = 0; i < 2; ++i) {
      at::autocast::set_autocast_dtype(kAutocastDevices[i], dtype[i]);
      at::autocast::set_autocast_enabled(kAutocastDevices[i], enabled[i]);
    }
  }
  bool any() const { return enabled[0] || enabled[1]; }
};

// While it lives: the forward's generator states and autocast flags; then those it found, even
// when the recomputation throws (the rest of the run draws as if nothing had been recomputed).
class ForwardState {
 public:
  ForwardState(std::vector<at::Generator> gens, const std::vector<at::Tensor>& states, AutocastState autocast)
      : gens_(std::move(gens)), found_(rng_states(gens_)), autocast_found_(AutocastState::now()), autocast_(autocast) {
    set_rng_states(gens_, states);
    autocast_.apply();
    if (autocast_.any()) at::autocast::increment_nesting();
  }
  ~ForwardState() {
    // Leaving the outermost region drops autocast's cache of cast weights, as torch.autocast does.
    if (autocast_.any() && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    autocast_found_.apply();
    set_rng_states(gens_, found_);
  }
  ForwardState(const ForwardState&) = delete;
  ForwardState& operator=(const ForwardState&) = delete;

 private:
  std::vector<at::Generator> gens_;
  std::vector<at::Tensor> found_;
  AutocastState autocast_found_, autocast_;
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Nanoseconds this process has spent recomputing segments (rn_checkpoint_recompute_ns).
std::atomic<int64_t> recompute_ns{0};

struct Checkpoint : public torch::autograd::Function<Checkpoint> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                            c10::intrusive_ptr<Segment> segment) {
    auto gens = generators(x);
    ctx->saved_data["rng"] = c10::List<at::Tensor>(rng_states(gens));
    auto autocast = AutocastState::now();
    ctx->saved_data["autocast_cpu"] = autocast.enabled[0];
    ctx->saved_data["autocast_cuda"] = autocast.enabled[1];
    ctx->saved_data["dtype_cpu"] = static_cast<int64_t>(autocast.dtype[0]);
    ctx->saved_data["dtype_cuda"] = static_cast<int64_t>(autocast.dtype[1]);
    ctx->saved_data["params"] = c10::List<at::Tensor>(params.vec());
    ctx->saved_data["segment"] = c10::IValue::make_capsule(segment);
    ctx->save_for_backward({x});
    return segment->run(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list result(ctx->saved_data["params"].toTensorList().size() + 2);
    if (!grads[0].defined()) return result;
    at::Tensor x = ctx->get_saved_variables()[0];
    auto params = ctx->saved_data["params"].toTensorList().vec();
    auto holder = ctx->saved_data["segment"].toCapsule();
    const auto* segment = static_cast<const Segment*>(holder.get());
    AutocastState autocast;
    autocast.enabled[0] = ctx->saved_data["autocast_cpu"].toBool();
    autocast.enabled[1] = ctx->saved_data["autocast_cuda"].toBool();
    autocast.dtype[0] = static_cast<at::ScalarType>(ctx->saved_data["dtype_cpu"].toInt());
    autocast.dtype[1] = static_cast<at::ScalarType>(ctx->saved_data["dtype_cuda"].toInt());
    auto states = ctx->saved_data["rng"].toTensorList().vec();

    at::Tensor input = x.detach().requires_grad_(x.requires_grad());
    at::Tensor out;
    {
      int64_t t0 = now_ns();
      ForwardState state(generators(x), states, autocast);
      at::AutoGradMode grad(true);
      out = segment->run(input);
      recompute_ns += now_ns() - t0;
    }
    // What to differentiate with respect to: the input where it needs a gradient, and every
    // parameter that does.
    std::vector<at::Tensor> wrt;
    std::vector<size_t> at_index;
    if (input.requires_grad()) {
      wrt.push_back(input);
      at_index.push_back(0);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].requires_grad()) {
        wrt.push_back(params[i]);
        at_index.push_back(i + 1);
      }
    }
    if (!wrt.empty() && out.requires_grad()) {
      auto got = torch::autograd::grad({out}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                       /*allow_unused=*/true);
      for (size_t k = 0; k < got.size(); ++k) result[at_index[k]] = got[k];
    }
    return result;
  }
};

}  // namespace

extern "C" {

char* rn_checkpoint(void* input, void** params, size_t n_params, rn_segment_fn call, rn_segment_drop drop,
                    void* closure, void** out) {
  // The closure is the bridge's from here on: freed with the node, or now if no node is made.
  auto segment = c10::make_intrusive<Segment>(call, drop, closure);
  return rn::protect([&] {
    auto ps = rn::tensors(params, n_params);
    at::Tensor r = Checkpoint::apply(rn::tensor(input), at::TensorList(ps), segment);
    *out = new at::Tensor(std::move(r));
  });
}

int64_t rn_checkpoint_recompute_ns(void) { return recompute_ns.load(); }

}  // extern "C"
