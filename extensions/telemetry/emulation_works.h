#pragma once

// The paced Works: the inner backend's Work, reporting completion no earlier
// than the emulated cluster would (emulation.h).
//  - CPU: a Work whose future the timer thread completes at the deadline; a
//    Work without a future (gloo's send/recv, reduce_scatter) sleeps in wait().
//  - CUDA: the consumer's stream is held by a kernel waiting on the GPU clock
//    (extensions/cuda/emulate.cu), never a host thread.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>

#include "emulation_model.h"

namespace wbt::emulation {

c10::intrusive_ptr<c10d::Work> paced_cpu(c10::intrusive_ptr<c10d::Work> inner, Start start, int64_t target_ns);

c10::intrusive_ptr<c10d::Work> paced_cuda(
    c10::intrusive_ptr<c10d::Work> inner,
    const at::Device& device,
    int64_t slot,
    int64_t real_ns,
    int64_t target_ns);

// wb_emulate_stamp / wb_emulate_hold of the nvcc-built library (extensions/cuda/wb_emulate.h),
// supplied by address so this extension links no CUDA.
using CudaStartStamp = int64_t (*)(int device, uintptr_t stream);
using CudaHold = int (*)(int device, uintptr_t stream, int64_t slot, int64_t target_ns, int64_t real_ns);
void set_cuda_pacer(CudaStartStamp stamp, CudaHold hold);

// A GPU-clock stamp on `device`'s current stream, for a hold to count from: its slot.
int64_t cuda_stamp(const at::Device& device);

} // namespace wbt::emulation
