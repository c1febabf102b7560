// CUDA graphs of a training step's forward and backward passes (run.cuda_graphs): the kernels
// the step launches are recorded once and replayed as one launch, as torch.cuda.graph and
// torch.compile(mode="reduce-overhead") do. See bridge.h for the contract, src/stages/graph.rs
// for when the runner captures and what it replays.
#include "bridge.h"
#include "internal.hpp"

#ifdef RUNNER_NCCL
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

using rn::copy_message;
using rn::protect;

namespace {
constexpr const char* kWithoutCuda = "CUDA graphs need runner built with `--features cuda`";
}

#ifdef RUNNER_NCCL
struct rn_graph {
  at::cuda::CUDAGraph graph;
};
#else
struct rn_graph {};
#endif

extern "C" {

char* rn_cuda_side_stream(int index) {
#ifdef RUNNER_NCCL
  return protect([&] {
    // A capture cannot run on the legacy default stream; every step, eager or captured, runs on
    // this one, so the eager steps before the capture warm up what the capture replays (cuBLAS's
    // workspace of this stream, the autograd engine's device thread).
    auto device = static_cast<c10::DeviceIndex>(index);
    c10::cuda::set_device(device);
    c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, device));
  });
#else
  (void)index;
  return copy_message(kWithoutCuda);
#endif
}

char* rn_cuda_graph_begin(rn_graph** out) {
#ifdef RUNNER_NCCL
  return protect([&] {
    auto graph = std::make_unique<rn_graph>();
    graph->graph.capture_begin();
    *out = graph.release();
  });
#else
  (void)out;
  return copy_message(kWithoutCuda);
#endif
}

char* rn_cuda_graph_end(rn_graph* graph) {
#ifdef RUNNER_NCCL
  return protect([&] { graph->graph.capture_end(); });
#else
  (void)graph;
  return copy_message(kWithoutCuda);
#endif
}

char* rn_cuda_graph_replay(rn_graph* graph) {
#ifdef RUNNER_NCCL
  return protect([&] { graph->graph.replay(); });
#else
  (void)graph;
  return copy_message(kWithoutCuda);
#endif
}

void rn_cuda_graph_free(rn_graph* graph) { delete graph; }

}  // extern "C"
