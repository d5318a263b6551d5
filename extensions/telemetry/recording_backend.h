#pragma once

// A c10d Backend that wraps the real ones (gloo for CPU tensors, NCCL for
// CUDA tensors), forwards every operation unchanged and records one span per
// collective: start when it is issued, end in native code when it completes.
// Because it sits below ProcessGroup, it sees every caller alike: DDP's C++
// reducer, FSDP2, DTensor's functional collectives, pipeline send/recv.

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "completion.h"
#include "flight_recorder.h"
#include "recorder.h"

namespace wbt {

class RecordingBackend final : public c10d::Backend {
 public:
  RecordingBackend(
      int rank,
      int size,
      c10::intrusive_ptr<c10d::Backend> cpu,
      c10::intrusive_ptr<c10d::Backend> cuda,
      std::string group_name,
      std::shared_ptr<Recorder> recorder);

  c10::intrusive_ptr<c10d::Backend> inner(bool cuda) const {
    return cuda ? cuda_ : cpu_;
  }

  const std::string getBackendName() const override {
    return "workbench";
  }

  // --- collectives: recorded ---
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& output_splits,
      std::vector<int64_t>& input_splits,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dst,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int src,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts) override;

  // --- coalescing (NCCL batches p2p this way): one span per batch ---
  bool supportsCoalescing() const override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // --- everything else: forwarded ---
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all)
      override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setGroupUid(const std::string& uid) override;
  c10d::ErrorType getError() override;
  void eagerConnectSingleDevice(at::Device device) override;
  void registerOnCompletionHook(
      std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override;
  void waitForPendingWorks() override;
  void enableCollectivesTiming() override;
  bool supportsTensorAlloc(c10::DeviceIndex index) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options) override;
  std::shared_ptr<c10::Allocator> getMemAllocator() override;
  std::unordered_map<std::string, uint64_t> getMemoryStats() override;
  void abort() override;
  void shutdown() override;

 private:
  using Issue = std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&)>;

  c10d::Backend& route(const at::Device& device);
  c10d::Backend& primary();
  // Issues one operation on the inner backend for `device` and records it.
  c10::intrusive_ptr<c10d::Work> run(
      const char* op,
      int64_t bytes,
      const at::Device& device,
      const Issue& issue_now,
      int peer = -1);
  std::string label() const;
  Record new_record(const char* op, int64_t bytes, c10d::Backend& inner) const;
  // The flight recorder's entry for an operation issued now on this group.
  FlightTicket flight_issue(std::string op, int64_t bytes, c10d::Backend& inner);
  void join_batch(
      const char* op,
      int64_t bytes,
      const at::Device& device,
      c10d::Backend& inner);

  c10::intrusive_ptr<c10d::Backend> cpu_;
  c10::intrusive_ptr<c10d::Backend> cuda_;
  std::string group_name_;
  std::shared_ptr<Recorder> recorder_;
  std::atomic<uint64_t> flight_seq_{0}; // operations issued on this group by this rank

  // Coalescing state. ProcessGroup calls startCoalescing without saying for
  // which device, so the inner backend is chosen by the first op of a batch,
  // and the whole batch becomes one span.
  bool coalescing_ = false;
  c10d::Backend* batch_inner_ = nullptr;
  std::optional<at::Device> batch_device_;
  bool batch_recorded_ = false;
  Record batch_;
  CudaStamp* batch_stamp_ = nullptr;
};

} // namespace wbt
