// CUDA events that time a step's phases where the device runs them, so that no phase boundary
// waits for the device: an event is recorded on the rank's stream as the host queues the work,
// and read (cudaEventElapsedTime) once it has passed, at the interval's end or earlier if it
// already has. See bridge.h for the contract, src/device/clock.rs for their use.
#include "bridge.h"
#include "internal.hpp"

#ifdef RUNNER_NCCL
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <memory>

using rn::copy_message;
using rn::protect;

namespace {
constexpr const char* kWithoutCuda = "CUDA events need runner built with `--features cuda`";
}

extern "C" {

char* rn_cuda_event_record(int index, void** event) {
#ifdef RUNNER_NCCL
  return protect([&] {
    // cudaEventDefault: timing on (at::cuda::CUDAEvent's own default turns it off).
    auto e = std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault);
    e->record(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)));
    *event = e.release();
  });
#else
  (void)index, (void)event;
  return copy_message(kWithoutCuda);
#endif
}

char* rn_cuda_event_done(void* event, int* done) {
#ifdef RUNNER_NCCL
  return protect([&] { *done = static_cast<at::cuda::CUDAEvent*>(event)->query() ? 1 : 0; });
#else
  (void)event, (void)done;
  return copy_message(kWithoutCuda);
#endif
}

char* rn_cuda_event_elapsed(void* from, void* to, double* ms) {
#ifdef RUNNER_NCCL
  return protect([&] {
    auto* end = static_cast<at::cuda::CUDAEvent*>(to);
    end->synchronize();
    *ms = static_cast<at::cuda::CUDAEvent*>(from)->elapsed_time(*end);
  });
#else
  (void)from, (void)to, (void)ms;
  return copy_message(kWithoutCuda);
#endif
}

void rn_cuda_event_free(void* event) {
#ifdef RUNNER_NCCL
  delete static_cast<at::cuda::CUDAEvent*>(event);
#else
  (void)event;
#endif
}

}  // extern "C"
