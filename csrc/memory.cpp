// The CPU allocator of a rank's tensors: blocks from 1 MiB are cached by size and reused as they
// are, smaller ones are glibc's. See bridge.h for the contract, src/dist/memory.rs for why (the
// measurements of glibc's heap against this cache).
//
// A freed block is reused as is by the next request of its size class: its pages stay resident
// and never move, so a training step, which repeats the last one's requests, neither faults pages
// in again nor fragments anything. The training loop marks its phases (each step, a validation,
// a checkpoint): a request no cached block fits first gives back to the kernel the cached blocks
// this phase has not used (what a phase that ended left), so that what a rank holds stays about
// the most its tensors ever held at once, while a step's own blocks are never given back.
#include "bridge.h"
#include "internal.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace {

// Blocks from this size are cached; smaller ones are glibc's (its bins serve them well).
constexpr size_t kLarge = 1 << 20;

// The block size serving `n` bytes: n rounded up to a quarter of its power of two (so at most a
// quarter of a block is never used; its untouched pages are not resident), and to whole pages.
size_t size_class(size_t n) {
  size_t power = size_t{1} << (63 - __builtin_clzll(n));
  size_t step = std::max<size_t>(power / 4, 4096);
  return (n + step - 1) / step * step;
}

struct Cached {
  void* ptr;
  size_t bytes;
  // The phase in which it was last handed out.
  int64_t phase;
};

struct Cache final : public c10::Allocator {
  std::mutex mutex;
  // Large blocks in use: address -> size and the phase it was handed out in.
  std::unordered_map<void*, std::pair<size_t, int64_t>> used;
  // Cached blocks in the order they were freed (the oldest first), and by size (the most recently
  // freed last: reused first).
  std::list<Cached> by_age;
  std::map<size_t, std::vector<std::list<Cached>::iterator>> cached;
  int64_t phase = 0;
  rn_memory_stats stats{};

  c10::DataPtr allocate(size_t n) override {
    void* p = n < kLarge ? c10::alloc_cpu(n) : take(size_class(n));
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // A cached block of `bytes`, or a new one. Before a new one is mapped, cached blocks that this
  // phase has not used go back to the kernel, the longest unused first, until as many bytes have
  // gone: what a phase that ended left (building the model, a validation, DDP's buckets before
  // they were rebuilt) makes room for what this one needs, while the blocks a training step
  // reuses, every step, stay.
  void* take(size_t bytes) {
    std::vector<Cached> unmap;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto at = cached.find(bytes);
      if (at != cached.end() && !at->second.empty()) {
        auto block = at->second.back();
        at->second.pop_back();
        void* p = block->ptr;
        by_age.erase(block);
        stats.cached_bytes -= bytes;
        note_used(p, bytes);
        return p;
      }
      size_t freed = 0;
      for (auto it = by_age.begin(); it != by_age.end() && freed < bytes;) {
        if (it->phase >= phase) {
          ++it;
          continue;
        }
        auto& same = cached.at(it->bytes);
        same.erase(std::find(same.begin(), same.end(), it));
        unmap.push_back(*it);
        freed += it->bytes;
        stats.cached_bytes -= it->bytes;
        stats.mapped_bytes -= it->bytes;
        stats.unmaps += 1;
        it = by_age.erase(it);
      }
    }
    for (auto& block : unmap) munmap(block.ptr, block.bytes);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      // What libtorch's own allocator says when memory runs out, with the size.
      TORCH_CHECK_WITH(OutOfMemoryError, false, "DefaultCPUAllocator: can't allocate memory: you tried to allocate ",
                       bytes, " bytes. Error code 12 (Cannot allocate memory)");
    }
    std::lock_guard<std::mutex> lock(mutex);
    stats.mapped_bytes += bytes;
    stats.maps += 1;
    stats.peak_mapped_bytes = std::max(stats.peak_mapped_bytes, stats.mapped_bytes);
    note_used(p, bytes);
    return p;
  }

  void note_used(void* p, size_t bytes) {
    used.emplace(p, std::make_pair(bytes, phase));
    stats.used_bytes += bytes;
    stats.peak_used_bytes = std::max(stats.peak_used_bytes, stats.used_bytes);
  }

  void give(void* p) {
    std::lock_guard<std::mutex> lock(mutex);
    auto at = used.find(p);
    if (at == used.end()) {
      c10::free_cpu(p);
      return;
    }
    auto [bytes, handed] = at->second;
    used.erase(at);
    cached[bytes].push_back(by_age.insert(by_age.end(), Cached{p, bytes, handed}));
    stats.used_bytes -= bytes;
    stats.cached_bytes += bytes;
  }

  static void release(void* p);
};

Cache& cache() {
  // Never destroyed: tensors may be freed by static destructors after main returns.
  static Cache* c = new Cache();
  return *c;
}

void Cache::release(void* p) { cache().give(p); }

}  // namespace

extern "C" {

char* rn_memory_install() {
  return rn::protect([&] { c10::SetCPUAllocator(&cache(), /*priority=*/100); });
}

void rn_memory_phase(void) {
  std::lock_guard<std::mutex> lock(cache().mutex);
  cache().phase += 1;
}

char* rn_memory_read_stats(rn_memory_stats* out) {
  return rn::protect([&] {
    std::lock_guard<std::mutex> lock(cache().mutex);
    *out = cache().stats;
  });
}

}  // extern "C"
