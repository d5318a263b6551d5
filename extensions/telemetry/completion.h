#pragma once

// Stamping the end of a collective at the moment it completes, in native
// code, without waiting for Python to get the GIL back.
//
// CPU (gloo): the Work's future is completed by gloo's worker thread and runs
// our callback right there; the Work handed back (RecordedWork) exposes a
// future completed only after that stamp. Works without a future (gloo's
// send/recv and reduce_scatter, which complete inside wait()) are stamped as
// wait() returns.
//
// CUDA (NCCL): a Work's future completes when the kernel is *enqueued*, so
// its callback time means nothing; instead the callback (which runs with the
// current stream made to wait for the collective) enqueues a host function on
// that stream, and the CUDA driver runs it when the collective is done. The
// start is a host function enqueued on the caller's stream just before the
// collective, which NCCL's stream waits for.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>

#include "recorder.h"

namespace wbt {

// cudaLaunchHostFunc's shape; returns a cudaError_t (0 = success). Supplied
// at run time by the nvcc-built library so this extension links no CUDA.
using HostFuncLauncher = int (*)(void* stream, void (*fn)(void*), void* data);
void set_host_func_launcher(HostFuncLauncher launcher);
bool has_host_func_launcher();

// CUDA collectives that could not be timed (no launcher, or launching
// failed): counted here, never recorded with host-side guesses.
uint64_t unstamped_cuda_ops();

c10::intrusive_ptr<c10d::Work> stamp_cpu_completion(
    c10::intrusive_ptr<c10d::Work> work,
    Record record,
    std::shared_ptr<Recorder> recorder);

struct CudaStamp;

// Enqueues the start stamp on `device`'s current stream; nullptr when it
// cannot (then nothing is recorded for this collective).
CudaStamp* cuda_begin(const at::Device& device, std::shared_ptr<Recorder> recorder);

// Arranges for `record` to be stamped and stored when `work` is done on the
// GPU. Takes ownership of `stamp`.
c10::intrusive_ptr<c10d::Work> cuda_end(
    c10::intrusive_ptr<c10d::Work> work,
    CudaStamp* stamp,
    Record record,
    const at::Device& device);

// Frees `stamp` once its start stamp has run (the issue failed).
void cuda_discard(CudaStamp* stamp);

} // namespace wbt
