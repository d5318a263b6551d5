// Small runtime-API services: device memory counters, errors.

#include <cuda_runtime.h>

#include "wb_cuda.h"

extern "C" {

int wb_cuda_abi_version(void) {
  return WB_CUDA_ABI_VERSION;
}

const char* wb_cuda_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

int wb_cuda_device_count(int* count) {
  *count = 0;
  return cudaGetDeviceCount(count);
}

int wb_cuda_mem_info(int device, size_t* free_bytes, size_t* total_bytes) {
  *free_bytes = 0;
  *total_bytes = 0;
  int previous = -1;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) {
    err = cudaSetDevice(device);
  }
  if (err == cudaSuccess) {
    // Device-wide figures (every process on the GPU), unlike torch's
    // allocator counters, which see only this process's tensors.
    err = cudaMemGetInfo(free_bytes, total_bytes);
  }
  if (previous >= 0 && previous != device) {
    cudaSetDevice(previous);
  }
  return err;
}

} // extern "C"
