// The GPU side of the emulated links (wb_emulate.h): start stamps and holds on
// the GPU clock, so a paced NCCL collective delays its consumer's stream, not
// a host thread.

#include <cuda_runtime.h>

#include <mutex>

#include "wb_emulate.h"

namespace {

// Slots are reused round-robin: a slot is overwritten after this many more
// collectives, long after the hold that reads it has run.
constexpr int64_t kSlots = 1 << 14;
constexpr int kMaxDevices = 64;

__device__ __forceinline__ long long gpu_clock() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<long long>(t);
}

__global__ void stamp_kernel(long long* slot) {
  *slot = gpu_clock();
}

__global__ void hold_kernel(const long long* slot, long long target_ns, long long real_ns) {
  const long long start = gpu_clock() - real_ns;
  const long long due = (*slot > start ? *slot : start) + target_ns;
  while (gpu_clock() < due) {
    __nanosleep(2000);
  }
}

std::mutex g_mu;
long long* g_slots[kMaxDevices] = {};
int64_t g_next[kMaxDevices] = {};

// Runs `body` with `device` current, restoring the caller's device after.
template <class F>
int on_device(int device, F body) {
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err != cudaSuccess) {
    return err;
  }
  if ((err = cudaSetDevice(device)) != cudaSuccess) {
    return err;
  }
  const int result = body();
  cudaSetDevice(previous);
  return result;
}

} // namespace

extern "C" int64_t wb_emulate_stamp(int device, uintptr_t stream) {
  if (device < 0 || device >= kMaxDevices) {
    return -static_cast<int64_t>(cudaErrorInvalidDevice);
  }
  int64_t slot = 0;
  const int err = on_device(device, [&]() -> int {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_slots[device] == nullptr) {
      const cudaError_t e = cudaMalloc(&g_slots[device], kSlots * sizeof(long long));
      if (e != cudaSuccess) {
        g_slots[device] = nullptr;
        return e;
      }
    }
    slot = g_next[device]++ % kSlots;
    stamp_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(g_slots[device] + slot);
    return cudaGetLastError();
  });
  return err == cudaSuccess ? slot : -static_cast<int64_t>(err);
}

extern "C" int wb_emulate_hold(int device, uintptr_t stream, int64_t slot, int64_t target_ns, int64_t real_ns) {
  if (device < 0 || device >= kMaxDevices || slot < 0 || slot >= kSlots) {
    return cudaErrorInvalidValue;
  }
  return on_device(device, [&]() -> int {
    long long* slots = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      slots = g_slots[device];
    }
    if (slots == nullptr) {
      return cudaErrorInvalidValue; // no stamp was taken on this device
    }
    hold_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(slots + slot, target_ns, real_ns);
    return cudaGetLastError();
  });
}
