// C interface of the workbench CUDA telemetry library (loaded with ctypes).
// Only the CUDA runtime API is used, so it builds with nvcc alone, without
// torch's CUDA libraries. Streams are passed as integers (torch's
// `stream.cuda_stream`); they are driver objects, valid across runtimes
// sharing the device's primary context.
//
// Every function returning int returns a cudaError_t (0 = success) unless
// it says otherwise.

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WB_CUDA_ABI_VERSION 3

// Built with -fvisibility=hidden: only these functions are exported, not the
// statically linked CUDA runtime or C++ library internals.
#define WB_API __attribute__((visibility("default")))

// Not an error code: WB_CUDA_ABI_VERSION, so Python can refuse a stale build.
WB_API int wb_cuda_abi_version(void);
WB_API const char* wb_cuda_error_string(int error);
WB_API int wb_cuda_device_count(int* count);
WB_API int wb_cuda_mem_info(int device, size_t* free_bytes, size_t* total_bytes);

// Marks (marks.cu): one CUDA event recorded on a stream, read back later as
// a raw reading that Python pairs into intervals. Process-wide, every device.
enum { WB_MARK_DONE = 0, WB_MARK_PENDING = 1, WB_MARK_ERROR = 2, WB_MARK_UNKNOWN = 3 };

typedef struct {
  int64_t mark;
  int32_t state;      // WB_MARK_*
  int32_t error;      // the cudaError_t of WB_MARK_ERROR
  int64_t anchor_ns;  // host time (monotonic ns) of the mark's anchor event
  float elapsed_ms;   // GPU time from the anchor to the mark (WB_MARK_DONE)
} wb_mark_reading;

// Records a mark on `stream` of `device`; returns its id (> 0), or minus a
// cudaError_t. The recording backend calls it by address (no CUDA linked there).
WB_API int64_t wb_mark(int device, uintptr_t stream);
// Records mark `id` again on `stream`: it then stands for this later point.
WB_API int wb_mark_again(int64_t id, uintptr_t stream);
// Reads `n` marks into `out` without waiting; with release_done, marks that
// are done (or failed) are released at once (their reading is final).
WB_API int wb_marks_read(const int64_t* ids, int n, wb_mark_reading* out, int release_done);
// Forgets marks (unknown ids are ignored).
WB_API int wb_marks_release(const int64_t* ids, int n);
// Marks recorded and not released (not an error code).
WB_API int wb_marks_live(void);

// Test and calibration aid: keeps the GPU busy for about `ns` nanoseconds.
WB_API int wb_cuda_spin(uintptr_t stream, int64_t ns);

#ifdef __cplusplus
}
#endif
