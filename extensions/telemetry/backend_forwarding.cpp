// The part of RecordingBackend that is not collectives: coalesced batches and
// the plain forwarding of everything else to the inner backends.

#include "recording_backend.h"

#include "clock.h"
#include "emulation.h"

namespace wbt {

bool RecordingBackend::supportsCoalescing() const {
  // NCCL batches p2p (pipeline schedules) this way; gloo does not, and torch
  // then issues the ops one by one, which is what we want to report.
  return cuda_ ? cuda_->supportsCoalescing() : cpu_->supportsCoalescing();
}

void RecordingBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "workbench backend: nested coalescing");
  coalescing_ = true;
  batch_inner_ = nullptr;
  batch_device_.reset();
  batch_stamp_ = nullptr;
}

void RecordingBackend::join_batch(
    const char* op,
    int64_t bytes,
    const at::Device& device,
    c10d::Backend& inner) {
  if (batch_inner_ == nullptr) {
    inner.startCoalescing();
    batch_inner_ = &inner;
    batch_device_ = device;
    batch_recorded_ = recorder_->enabled();
    batch_ = new_record(op, 0, inner);
    if (batch_recorded_ && device.is_cuda()) {
      batch_stamp_ = cuda_begin(device, recorder_);
      batch_recorded_ = batch_stamp_ != nullptr;
    }
    batch_.start_ns = now_ns();
  }
  TORCH_CHECK(
      &inner == batch_inner_,
      "workbench backend: one coalesced batch mixes CPU and CUDA tensors");
  // A batch of sends and recvs is named "send+recv": what a reader needs to
  // know is which kinds of transfer the one span covers.
  const std::string name(op);
  if (("+" + batch_.name + "+").find("+" + name + "+") == std::string::npos) {
    batch_.name += "+" + name;
  }
  batch_.bytes += bytes;
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "workbench backend: endCoalescing without start");
  coalescing_ = false;
  if (batch_inner_ == nullptr) {
    // An empty batch: let the inner backend decide what that returns.
    primary().startCoalescing();
    return primary().endCoalescing();
  }
  c10d::Backend* inner = batch_inner_;
  batch_inner_ = nullptr;
  // A batch is launched as one (NCCL's group call): one flight-recorder entry, "send+recv".
  const FlightTicket flight = flight_issue(batch_.name, batch_.bytes, *inner);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = flight_watch(
        emulated_batch(inner->endCoalescing(), getGroupUid(), batch_.name, batch_.bytes, batch_.start_ns, *batch_device_),
        flight, *batch_device_);
  } catch (...) {
    if (batch_stamp_ != nullptr) {
      cuda_discard(batch_stamp_);
    }
    throw;
  }
  if (!batch_recorded_) {
    return work;
  }
  if (batch_device_->is_cuda()) {
    return cuda_end(std::move(work), batch_stamp_, std::move(batch_), *batch_device_);
  }
  return stamp_cpu_completion(std::move(work), std::move(batch_), recorder_);
}

// --- forwarding ---

void RecordingBackend::monitoredBarrier(
    const c10d::BarrierOptions& opts,
    bool wait_all) {
  // Only gloo implements it; it is a health check, not training traffic.
  TORCH_CHECK(cpu_, "workbench backend: monitored_barrier needs gloo");
  cpu_->monitoredBarrier(opts, wait_all);
}

void RecordingBackend::setSequenceNumberForGroup() {
  for (auto* b : {cpu_.get(), cuda_.get()}) {
    if (b) {
      b->setSequenceNumberForGroup();
    }
  }
}

uint64_t RecordingBackend::getSequenceNumberForGroup() {
  return primary().getSequenceNumberForGroup();
}

c10::intrusive_ptr<c10d::Backend::Options> RecordingBackend::getBackendOptions() {
  return primary().getBackendOptions();
}

void RecordingBackend::setTimeout(std::chrono::milliseconds timeout) {
  for (auto* b : {cpu_.get(), cuda_.get()}) {
    if (b) {
      b->setTimeout(timeout);
    }
  }
}

void RecordingBackend::setGroupUid(const std::string& uid) {
  Backend::setGroupUid(uid);
  for (auto* b : {cpu_.get(), cuda_.get()}) {
    if (b) {
      b->setGroupUid(uid);
    }
  }
}

c10d::ErrorType RecordingBackend::getError() {
  return primary().getError();
}

void RecordingBackend::eagerConnectSingleDevice(at::Device device) {
  route(device).eagerConnectSingleDevice(device);
}

void RecordingBackend::registerOnCompletionHook(
    std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) {
  primary().registerOnCompletionHook(std::move(hook));
}

void RecordingBackend::waitForPendingWorks() {
  primary().waitForPendingWorks();
}

void RecordingBackend::enableCollectivesTiming() {
  for (auto* b : {cpu_.get(), cuda_.get()}) {
    if (b) {
      b->enableCollectivesTiming();
    }
  }
}

bool RecordingBackend::supportsTensorAlloc(c10::DeviceIndex index) {
  return cuda_ && cuda_->supportsTensorAlloc(index);
}

at::Tensor RecordingBackend::allocateTensor(long size, at::TensorOptions options) {
  return route(options.device()).allocateTensor(size, options);
}

std::shared_ptr<c10::Allocator> RecordingBackend::getMemAllocator() {
  return primary().getMemAllocator();
}

std::unordered_map<std::string, uint64_t> RecordingBackend::getMemoryStats() {
  return primary().getMemoryStats();
}

void RecordingBackend::abort() {
  for (auto* b : {cpu_.get(), cuda_.get()}) {
    if (b) {
      b->abort();
    }
  }
}

void RecordingBackend::shutdown() {
  for (auto* b : {cpu_.get(), cuda_.get()}) {
    if (b) {
      b->shutdown();
    }
  }
}

} // namespace wbt
