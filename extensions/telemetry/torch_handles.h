#pragma once

// What the extension takes from torch's Works and devices, written once:
// the recorder, the flight recorder and the emulation all ask the same two
// questions.

#include <ATen/core/ivalue.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>

namespace wbt {

// The Work's future, or null when there is none (or no Work): gloo's
// send/recv and its reduce_scatter finish inside wait() and throw from
// getFuture(), so their completion is learnt from wait() instead.
inline c10::intrusive_ptr<c10::ivalue::Future> future_of(const c10::intrusive_ptr<c10d::Work>& work) {
  if (!work) {
    return nullptr;
  }
  try {
    return work->getFuture();
  } catch (const c10::Error&) {
    return nullptr;
  }
}

// `device`'s current stream as the raw handle the nvcc-built library takes
// (a cudaStream_t on CUDA), through torch's device-generic guard so this
// extension links no CUDA.
inline uintptr_t current_stream(const at::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return reinterpret_cast<uintptr_t>(impl.getStream(device).native_handle());
}

} // namespace wbt
