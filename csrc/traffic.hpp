// A c10d backend that counts what this rank hands to its group, then passes every call on to the
// real backend (gloo or NCCL). Every collective of a group goes through it: the bridge's own
// calls, FSDP's all-gathers and reductions, and those c10d's Reducer (DDP) issues through the
// ProcessGroup, which the bridge never sees. So the counts are measured where the bytes leave,
// not estimated from the model.
//
// What counts, per call, in bytes of the tensors this rank contributes: an all-reduce's or a
// reduce's tensors; an all-gather's input; a reduce-scatter's or an all-to-all's whole input; a
// broadcast's or a scatter's tensors on its root; a gather's input; a send's tensor. A receive
// and a barrier count nothing, and neither does anything in a group of one rank (nothing leaves
// the rank). Point-to-point sends are counted apart from the collectives.
#pragma once
#include <atomic>
#include <cstdint>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace rn {

class Counted : public c10d::Backend {
 public:
  explicit Counted(c10::intrusive_ptr<c10d::Backend> inner)
      : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {
    setBoundDeviceId(inner_->getBoundDeviceId());
    c10d::Backend::setGroupUid(inner_->getGroupUid());
  }

  uint64_t collective_bytes() const { return collective_.load(); }
  uint64_t p2p_bytes() const { return p2p_.load(); }

  const std::string getBackendName() const override { return inner_->getBackendName(); }
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  void startCoalescing() override { inner_->startCoalescing(); }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override { return inner_->endCoalescing(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return inner_->getBackendOptions(); }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void waitForPendingWorks() override { inner_->waitForPendingWorks(); }
  void enableCollectivesTiming() override { inner_->enableCollectivesTiming(); }
  void eagerConnectSingleDevice(at::Device device) override { inner_->eagerConnectSingleDevice(device); }
  c10d::ErrorType getError() override { return inner_->getError(); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }
  void registerOnCompletionHook(std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override {
    inner_->registerOnCompletionHook(std::move(hook));
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    if (getRank() == o.rootRank) add(collective_, ts);
    return inner_->broadcast(ts, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    add(collective_, ts);
    return inner_->allreduce(ts, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& ts,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    add(collective_, ts);
    return inner_->allreduce_coalesced(ts, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) override {
    add(collective_, ts);
    return inner_->reduce(ts, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    add(collective_, in);
    return inner_->allgather(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    add(collective_, in);
    return inner_->_allgather_base(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) override {
    add(collective_, in);
    return inner_->allgather_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::AllgatherOptions& o) override {
    add(collective_, in);
    return inner_->allgather_into_tensor_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                        const c10d::GatherOptions& o) override {
    add(collective_, in);
    return inner_->gather(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override {
    if (getRank() == o.rootRank) {
      for (auto& list : in) add(collective_, list);
    }
    return inner_->scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    for (auto& list : in) add(collective_, list);
    return inner_->reduce_scatter(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    add(collective_, in);
    return inner_->_reduce_scatter_base(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::ReduceScatterOptions& o) override {
    add(collective_, in);
    return inner_->reduce_scatter_tensor_coalesced(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    add(collective_, in);
    return inner_->alltoall_base(out, in, out_splits, in_splits, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllToAllOptions& o) override {
    add(collective_, in);
    return inner_->alltoall(out, in, o);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    add(p2p_, ts);
    return inner_->send(ts, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    return inner_->recv(ts, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    return inner_->recvAnysource(ts, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override { return inner_->barrier(o); }

 private:
  void add(std::atomic<uint64_t>& counter, const at::Tensor& t) { add_bytes(counter, t.numel() * t.element_size()); }
  void add(std::atomic<uint64_t>& counter, const std::vector<at::Tensor>& ts) {
    for (const auto& t : ts) add(counter, t);
  }
  void add_bytes(std::atomic<uint64_t>& counter, int64_t bytes) {
    if (getSize() > 1) counter += static_cast<uint64_t>(bytes);
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  std::atomic<uint64_t> collective_{0};
  std::atomic<uint64_t> p2p_{0};
};

}  // namespace rn
