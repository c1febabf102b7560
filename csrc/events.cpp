// CUDA events that time a step's phases where the device runs them, so that no phase boundary
// waits for the device: an event is recorded on the rank's stream as the host queues the work,
// and read (cudaEventElapsedTime) once it has passed, at the interval's end or earlier if it
// already has. See bridge.h for the contract, src/device/clock.rs for their use.
#include "bridge.h"
#include "internal.hpp"

#ifdef RUNNER_NCCL
// c10::Event, not at::cuda::CUDAEvent: the latter calls the CUDA runtime inline, which this
// bridge does not link; c10::Event goes through libc10_cuda's device guard.
#include <c10/core/Event.h>
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
    // BACKEND_DEFAULT: cudaEventDefault, timing on (PyTorch's default turns it off).
    auto e = std::make_unique<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
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
  return protect([&] { *done = static_cast<c10::Event*>(event)->query() ? 1 : 0; });
#else
  (void)event, (void)done;
  return copy_message(kWithoutCuda);
#endif
}

char* rn_cuda_event_elapsed(void* from, void* to, double* ms) {
#ifdef RUNNER_NCCL
  return protect([&] {
    auto* end = static_cast<c10::Event*>(to);
    end->synchronize();
    *ms = static_cast<c10::Event*>(from)->elapsedTime(*end);
  });
#else
  (void)from, (void)to, (void)ms;
  return copy_message(kWithoutCuda);
#endif
}

void rn_cuda_event_free(void* event) {
#ifdef RUNNER_NCCL
  delete static_cast<c10::Event*>(event);
#else
  (void)event;
#endif
}

}  // extern "C"
