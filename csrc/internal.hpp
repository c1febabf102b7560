// What the bridge's C++ files share: the process group handle and the exception barrier.
// Not part of the C interface (bridge.h).
#pragma once
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "traffic.hpp"

struct rn_pg {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  // The counting wrapper (traffic.hpp) around the real backend: every call goes through it.
  c10::intrusive_ptr<c10d::Backend> backend;
  c10::intrusive_ptr<rn::Counted> counted;
  // NCCL: point-to-point pairs are posted as one group (ncclGroupStart/End), as torch's
  // batch_isend_irecv does; gloo has no such grouping and needs none.
  bool coalesce_p2p = false;
};

namespace rn {

inline char* copy_message(const char* msg) {
  size_t n = std::strlen(msg);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) std::memcpy(out, msg, n + 1);
  return out;
}

// Runs `body`; turns any exception into a malloc'd message. Nothing unwinds past this.
template <typename F>
char* protect(F&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return copy_message(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return copy_message(e.what());
  } catch (...) {
    return copy_message("unknown C++ exception");
  }
}

inline at::Tensor& tensor(void* t) { return *static_cast<at::Tensor*>(t); }

inline std::vector<at::Tensor> tensors(void** ts, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(tensor(ts[i]));
  return out;
}

}  // namespace rn
