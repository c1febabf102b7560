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
#include <ATen/ExpandUtils.h>
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

// What the recomputation of a segment on `x` replays: the generators' states and autocast's flags
// of the forward.
void save_forward_state(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
  ctx->saved_data["rng"] = c10::List<at::Tensor>(rng_states(generators(x)));
  auto autocast = AutocastState::now();
  ctx->saved_data["autocast_cpu"] = autocast.enabled[0];
  ctx->saved_data["autocast_cuda"] = autocast.enabled[1];
  ctx->saved_data["dtype_cpu"] = static_cast<int64_t>(autocast.dtype[0]);
  ctx->saved_data["dtype_cuda"] = static_cast<int64_t>(autocast.dtype[1]);
}

// The segment run again on `input` (the forward's input, detached) with grad on, under the state
// save_forward_state saved; its time counted.
at::Tensor recompute(torch::autograd::AutogradContext* ctx, const Segment& segment, const at::Tensor& input) {
  AutocastState autocast;
  autocast.enabled[0] = ctx->saved_data["autocast_cpu"].toBool();
  autocast.enabled[1] = ctx->saved_data["autocast_cuda"].toBool();
  autocast.dtype[0] = static_cast<at::ScalarType>(ctx->saved_data["dtype_cpu"].toInt());
  autocast.dtype[1] = static_cast<at::ScalarType>(ctx->saved_data["dtype_cuda"].toInt());
  auto states = ctx->saved_data["rng"].toTensorList().vec();
  int64_t t0 = now_ns();
  at::Tensor out;
  {
    ForwardState state(generators(input), states, autocast);
    at::AutoGradMode grad(true);
    out = segment.run(input);
  }
  recompute_ns += now_ns() - t0;
  return out;
}

// Gradients of `out` (grad_out) with respect to the input and the parameters that need one, at
// their places in a backward's result (the input at 0, parameter i at i + 1).
void differentiate(const at::Tensor& out, const at::Tensor& grad_out, const at::Tensor& input,
                   const std::vector<at::Tensor>& params, torch::autograd::variable_list& result) {
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
    auto got = torch::autograd::grad({out}, wrt, {grad_out}, /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
    for (size_t k = 0; k < got.size(); ++k) result[at_index[k]] = got[k];
  }
}

struct Checkpoint : public torch::autograd::Function<Checkpoint> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                            c10::intrusive_ptr<Segment> segment) {
    save_forward_state(ctx, x);
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
    at::Tensor input = x.detach().requires_grad_(x.requires_grad());
    at::Tensor out = recompute(ctx, *segment, input);
    differentiate(out, grads[0], input, params, result);
    return result;
  }
};


// Selective checkpointing's unit: linear(segment(source), weight, bias), which keeps the source
// and not the segment's output (the product's input): the backward pass runs the segment again
// (a norm, an activation, a copy: cheap), but not the product, whose gradients it computes as
// libtorch's own backward of at::linear does, so they are the same bits. at::linear on a
// contiguous 3-D input is an addmm (with a bias) or an mm (without) of the input viewed as rows:
// AddmmBackward0 / MmBackward0 give the input grad.mm(weight), the weight grad.t().mm(input) (the
// transposed weight is column-major) and the bias sum_to(grad, bias's shape). Under autocast the
// product ran on bfloat16 copies of the input, weight and bias (the same casts here); their
// gradients return to float32 exactly.
struct RecomputedLinear : public torch::autograd::Function<RecomputedLinear> {
  // params: the segment's parameters, then the weight, then the bias where there is one.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& source, at::TensorList params,
                            int64_t n_segment, c10::intrusive_ptr<Segment> segment) {
    save_forward_state(ctx, source);
    ctx->saved_data["params"] = c10::List<at::Tensor>(params.vec());
    ctx->saved_data["n_segment"] = n_segment;
    ctx->saved_data["segment"] = c10::IValue::make_capsule(segment);
    ctx->save_for_backward({source});
    bool bias = static_cast<int64_t>(params.size()) == n_segment + 2;
    at::Tensor x = segment->run(source);
    TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "a recomputed product's input must be contiguous [B, T, features]");
    return at::linear(x, params[n_segment], bias ? std::optional<at::Tensor>(params[n_segment + 1]) : std::nullopt);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto params = ctx->saved_data["params"].toTensorList().vec();
    auto n_segment = static_cast<size_t>(ctx->saved_data["n_segment"].toInt());
    torch::autograd::variable_list result(params.size() + 3);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return result;
    at::Tensor source = ctx->get_saved_variables()[0];
    auto holder = ctx->saved_data["segment"].toCapsule();
    const auto* segment = static_cast<const Segment*>(holder.get());
    at::Tensor input = source.detach().requires_grad_(source.requires_grad());
    at::Tensor x = recompute(ctx, *segment, input);
    // The product's dtype is its output's (autocast's casts of x, the weight and the bias: the
    // values a plain linear's recorded casts gave).
    auto dtype = g.scalar_type();
    at::Tensor xc = x.scalar_type() == dtype ? x : x.to(dtype);
    const at::Tensor& w = params[n_segment];
    bool has_bias = params.size() == n_segment + 2;
    at::Tensor dx, dw, db;
    {
      at::NoGradGuard no_grad;
      at::Tensor wc = w.scalar_type() == dtype ? w : w.to(dtype);
      at::Tensor g2 = g.reshape({-1, g.size(-1)});
      at::Tensor x2 = xc.detach().reshape({-1, xc.size(-1)});
      dx = g2.mm(wc).view(xc.sizes());
      if (w.requires_grad()) dw = g2.t().mm(x2).to(w.scalar_type());
      if (has_bias && params[n_segment + 1].requires_grad()) {
        const at::Tensor& b = params[n_segment + 1];
        db = at::sum_to(g2, b.sizes()).to(b.scalar_type());
      }
    }
    std::vector<at::Tensor> segment_params(params.begin(), params.begin() + n_segment);
    // The cast of x runs here without grad (a backward pass records nothing), so x's gradient
    // goes back through it by hand, as ToCopyBackward0 does: the gradient cast to x's dtype.
    differentiate(x, dx.to(x.scalar_type()), input, segment_params, result);
    result[n_segment + 1] = dw;
    if (has_bias) result[n_segment + 2] = db;
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

char* rn_checkpoint_linear(void* source, void** params, size_t n_params, size_t n_segment, rn_segment_fn call,
                           rn_segment_drop drop, void* closure, void** out) {
  auto segment = c10::make_intrusive<Segment>(call, drop, closure);
  return rn::protect([&] {
    TORCH_CHECK(n_params == n_segment + 1 || n_params == n_segment + 2, "a recomputed product needs a weight and at most a bias");
    auto ps = rn::tensors(params, n_params);
    at::Tensor r =
        RecomputedLinear::apply(rn::tensor(source), at::TensorList(ps), static_cast<int64_t>(n_segment), segment);
    *out = new at::Tensor(std::move(r));
  });
}

int64_t rn_checkpoint_recompute_ns(void) { return recompute_ns.load(); }

}  // extern "C"
