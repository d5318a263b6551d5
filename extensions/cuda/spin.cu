// A kernel that keeps one GPU thread busy for a given time: tests use it to
// have work pending on a stream (so "not finished yet" can be observed) and
// to make spans of known length.

#include <cuda_runtime.h>

#include "wb_cuda.h"

namespace {

__global__ void spin_kernel(long long ns) {
  // %globaltimer ticks in nanoseconds on every GPU since Volta.
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (static_cast<long long>(now - start) < ns);
}

} // namespace

extern "C" int wb_cuda_spin(uintptr_t stream, int64_t ns) {
  spin_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(ns);
  return cudaGetLastError();
}
