#include "recording_backend.h"

#include "clock.h"
#include "emulation.h"

namespace wbt {

namespace {

int64_t nbytes(const at::Tensor& t) {
  return t.is_sparse() ? t._values().nbytes() : static_cast<int64_t>(t.nbytes());
}

int64_t total(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    n += nbytes(t);
  }
  return n;
}

int64_t total(const std::vector<std::vector<at::Tensor>>& tss) {
  int64_t n = 0;
  for (const auto& ts : tss) {
    n += total(ts);
  }
  return n;
}

at::Device device_of(const std::vector<at::Tensor>& ts) {
  TORCH_CHECK(!ts.empty(), "workbench backend: collective without tensors");
  return ts.front().device();
}

} // namespace

// Payload sizes follow nccl-tests, whose bus-bandwidth factors assume them:
// the size of the whole buffer, i.e. the output of all_gather (n pieces), the
// input of reduce_scatter and all_to_all, and the one tensor otherwise.

RecordingBackend::RecordingBackend(
    int rank,
    int size,
    c10::intrusive_ptr<c10d::Backend> cpu,
    c10::intrusive_ptr<c10d::Backend> cuda,
    std::string group_name,
    std::shared_ptr<Recorder> recorder)
    : Backend(rank, size),
      cpu_(std::move(cpu)),
      cuda_(std::move(cuda)),
      group_name_(std::move(group_name)),
      recorder_(std::move(recorder)) {
  TORCH_CHECK(cpu_ || cuda_, "workbench backend needs an inner backend");
  if (!group_name_.empty()) {
    Backend::setGroupUid(group_name_);
  }
}

c10d::Backend& RecordingBackend::route(const at::Device& device) {
  if (device.is_cuda()) {
    TORCH_CHECK(
        cuda_,
        "workbench backend: a CUDA tensor was given but this group has no "
        "NCCL backend (CUDA was unavailable when the group was created)");
    return *cuda_;
  }
  TORCH_CHECK(
      cpu_, "workbench backend: a CPU tensor was given but this group has no gloo backend");
  return *cpu_;
}

c10d::Backend& RecordingBackend::primary() {
  return cuda_ ? *cuda_ : *cpu_;
}

std::string RecordingBackend::label() const {
  // DeviceMesh names its groups through the description ("mesh_dp"), which is
  // what a reader wants to see; the uid is the fallback.
  const auto& desc = getGroupDesc();
  return (desc.empty() || desc == "undefined") ? getGroupUid() : desc;
}

FlightTicket RecordingBackend::flight_issue(std::string op, int64_t bytes, c10d::Backend& inner) {
  return flight_ring().issue(label(), getGroupUid(), std::move(op), ++flight_seq_, bytes, getSize(), inner.getBackendName());
}

Record RecordingBackend::new_record(
    const char* op,
    int64_t bytes,
    c10d::Backend& inner) const {
  Record r;
  r.kind = Kind::Comm;
  r.name = op;
  r.bytes = bytes;
  r.group_size = getSize();
  r.stream = inner.getBackendName(); // "gloo" or "nccl": whose threads/streams ran it
  r.group = label();
  // The group's collectives queue on one NCCL stream: the uid is unique.
  r.queue = r.stream + ":" + getGroupUid();
  return r;
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::run(
    const char* op,
    int64_t bytes,
    const at::Device& device,
    const Issue& issue_now,
    int peer) {
  c10d::Backend& inner = route(device);
  if (coalescing_) {
    join_batch(op, bytes, device, inner);
    return issue_now(inner);
  }
  IssueFn paced; // an emulated cluster's cost (emulation.h); the real issue when emulation is off
  const Issue& issue = emulation_on() ? (paced = emulated(issue_now, getGroupUid(), op, bytes, peer, device)) : issue_now;
  // The flight recorder sees every operation, recorded or not (flight_recorder.h).
  const FlightTicket flight = flight_issue(op, bytes, inner);
  const Issue watched = [&](c10d::Backend& b) { return flight_watch(issue(b), flight, device); };
  if (!recorder_->enabled()) {
    return watched(inner);
  }
  Record r = new_record(op, bytes, inner);
  if (device.is_cuda()) {
    CudaStamp* stamp = cuda_begin(device, recorder_);
    if (stamp == nullptr) {
      return watched(inner);
    }
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = watched(inner);
    } catch (...) {
      cuda_discard(stamp);
      throw;
    }
    return cuda_end(std::move(work), stamp, std::move(r), device);
  }
  r.start_ns = now_ns();
  return stamp_cpu_completion(watched(inner), std::move(r), recorder_);
}

// --- collectives ---

c10::intrusive_ptr<c10d::Work> RecordingBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return run("broadcast", total(tensors), device_of(tensors), [&](auto& b) {
    return b.broadcast(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return run("all_reduce", total(tensors), device_of(tensors), [&](auto& b) {
    return b.allreduce(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return run("all_reduce", total(tensors), device_of(tensors), [&](auto& b) {
    return b.allreduce_sparse(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return run("all_reduce", total(tensors), device_of(tensors), [&](auto& b) {
    return b.allreduce_coalesced(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return run("reduce", total(tensors), device_of(tensors), [&](auto& b) {
    return b.reduce(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run("all_gather", total(outputs), device_of(inputs), [&](auto& b) {
    return b.allgather(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return run("all_gather", nbytes(output), input.device(), [&](auto& b) {
    return b._allgather_base(output, input, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run("all_gather", total(outputs), device_of(inputs), [&](auto& b) {
    return b.allgather_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run("all_gather", total(outputs), device_of(inputs), [&](auto& b) {
    return b.allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  // Only the root holds outputs; every rank can size the gathered buffer.
  const int64_t bytes = total(inputs) * getSize();
  return run("gather", bytes, device_of(inputs), [&](auto& b) {
    return b.gather(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const int64_t bytes = total(outputs) * getSize();
  return run("scatter", bytes, device_of(outputs), [&](auto& b) {
    return b.scatter(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter", total(inputs), device_of(outputs), [&](auto& b) {
    return b.reduce_scatter(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter", nbytes(input), input.device(), [&](auto& b) {
    return b._reduce_scatter_base(output, input, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter", total(inputs), device_of(inputs), [&](auto& b) {
    return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits,
    const c10d::AllToAllOptions& opts) {
  return run("all_to_all", nbytes(input), input.device(), [&](auto& b) {
    return b.alltoall_base(output, input, output_splits, input_splits, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return run("all_to_all", total(inputs), device_of(inputs), [&](auto& b) {
    return b.alltoall(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::send(
    std::vector<at::Tensor>& tensors,
    int dst,
    int tag) {
  return run("send", total(tensors), device_of(tensors), [&](auto& b) {
    return b.send(tensors, dst, tag);
  }, dst);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::recv(
    std::vector<at::Tensor>& tensors,
    int src,
    int tag) {
  return run("recv", total(tensors), device_of(tensors), [&](auto& b) {
    return b.recv(tensors, src, tag);
  }, src);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  return run("recv", total(tensors), device_of(tensors), [&](auto& b) {
    return b.recvAnysource(tensors, tag);
  });
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::barrier(
    const c10d::BarrierOptions& opts) {
  at::Device device = opts.device.value_or(at::Device(at::kCPU));
  if (!opts.device && !opts.device_ids.empty() && cuda_) {
    device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(opts.device_ids.front()));
  }
  if (device.is_cuda() && !cuda_) {
    device = at::Device(at::kCPU);
  }
  if (!device.is_cuda() && !cpu_) {
    device = at::Device(at::kCUDA);
  }
  return run("barrier", 0, device, [&](auto& b) { return b.barrier(opts); });
}

} // namespace wbt
