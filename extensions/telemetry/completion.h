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
// CUDA (NCCL): nothing is stamped on the host. A start *mark* (a CUDA event)
// is recorded on the caller's current stream just before the collective is
// issued: NCCL's stream waits for that stream, so the kernel cannot start
// earlier (Python's resolver also orders it after the group's previous
// collective: workbench/telemetry/gpu_timeline.py). The end mark is recorded
// in a callback on the Work's future: a CUDA future runs its callbacks with a
// stream from torch's pool made current and made to wait for the
// collective's completion events (recorded on the stream NCCL ran it on), so
// an event recorded there completes when the collective has. A Work's future
// completes when the kernel is *enqueued*, so this costs no wait. The record
// goes to the recorder at once with both marks; Python reads them at step end.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>

#include "recorder.h"

namespace wbt {

// wb_mark and wb_marks_release of the nvcc-built library (wb_cuda.h),
// supplied by address at run time so this extension links no CUDA.
using CudaMarker = int64_t (*)(int device, uintptr_t stream);
using CudaMarkRelease = int (*)(const int64_t* ids, int n);
void set_cuda_marker(CudaMarker mark, CudaMarkRelease release);
bool has_cuda_marker();

// CUDA collectives that could not be timed (no marker, a mark failed, the
// collective failed): counted here, never recorded with host-side guesses.
uint64_t unstamped_cuda_ops();

// Fault injection for tests: the completion callback stores its span `ns`
// late, as a completion thread the scheduler ran late does on a busy machine.
// Nobody may learn of the collective's end before the span is stored.
void delay_cpu_stamps(int64_t ns);

c10::intrusive_ptr<c10d::Work> stamp_cpu_completion(
    c10::intrusive_ptr<c10d::Work> work,
    Record record,
    std::shared_ptr<Recorder> recorder);

struct CudaStamp;

// Records the start mark on `device`'s current stream; nullptr when it
// cannot (then nothing is recorded for this collective).
CudaStamp* cuda_begin(const at::Device& device, std::shared_ptr<Recorder> recorder);

// Records the end mark behind `work` and stores `record` with both marks.
// Takes ownership of `stamp`.
c10::intrusive_ptr<c10d::Work> cuda_end(
    c10::intrusive_ptr<c10d::Work> work,
    CudaStamp* stamp,
    Record record,
    const at::Device& device);

// Frees `stamp` and its start mark (the issue failed).
void cuda_discard(CudaStamp* stamp);

// A mark on `device`'s current stream now (a collective's start, its end, the flight recorder's end);
// 0 without a marker or when recording it failed. Release it with cuda_release_mark (0 is ignored).
int64_t cuda_mark_now(const at::Device& device);
void cuda_release_mark(int64_t mark);

} // namespace wbt
