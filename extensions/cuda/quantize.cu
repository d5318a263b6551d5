// CUDA twins of extensions/telemetry/quantize.cpp: block-wise int8 and 1-bit (sign) quantisers
// behind the compressed all-reduce. Same arithmetic as the CPU kernels (see quantize.h there):
//   int8: scale = absmax / 127, q = nearbyint(x / scale) clamped to ±127, zeros for a zero block;
//   sign: scale = mean |x| (accumulated in double), bit i of byte i / 8 set for x >= 0.
// Called from workbench/engine/parallel/quantize.py through ctypes with raw device pointers and
// the torch stream as an integer; launches are asynchronous on that stream. Returns cudaError_t.

#include <cuda_runtime.h>
#include <stdint.h>

#include "wb_cuda.h"

namespace {

constexpr int kThreads = 256;

// One CUDA block per quantisation block: reduce in shared memory, then write the block's values.
__global__ void int8_quantize_kernel(const float* x, int8_t* q, float* scales, int64_t n, int64_t block) {
  __shared__ float partial[kThreads];
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * block;
  const int64_t hi = min(n, lo + block);
  float m = 0.0f;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    m = fmaxf(m, fabsf(x[i]));
  }
  partial[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + s]);
    }
    __syncthreads();
  }
  const float scale = partial[0] / 127.0f;
  if (threadIdx.x == 0) {
    scales[blockIdx.x] = scale;
  }
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    // __fdiv_rn: the correctly rounded x / scale the CPU computes (no fast-math reciprocal).
    const float v = scale > 0.0f ? nearbyintf(__fdiv_rn(x[i], scale)) : 0.0f;
    q[i] = static_cast<int8_t>(fminf(127.0f, fmaxf(-127.0f, v)));
  }
}

__global__ void int8_dequantize_kernel(const int8_t* q, const float* scales, float* x, int64_t n, int64_t block) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    x[i] = static_cast<float>(q[i]) * scales[i / block];
  }
}

__global__ void sign_scale_kernel(const float* x, float* scales, int64_t n, int64_t block) {
  __shared__ double partial[kThreads];
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * block;
  const int64_t hi = min(n, lo + block);
  double sum = 0.0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    sum += fabs(static_cast<double>(x[i]));
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      partial[threadIdx.x] += partial[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    scales[blockIdx.x] = static_cast<float>(partial[0] / static_cast<double>(hi - lo));
  }
}

// One thread per output byte: packs the signs of 8 consecutive values.
__global__ void sign_pack_kernel(const float* x, uint8_t* bits, int64_t n) {
  const int64_t byte = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (byte * 8 >= n) {
    return;
  }
  uint8_t packed = 0;
  for (int k = 0; k < 8 && byte * 8 + k < n; ++k) {
    packed |= static_cast<uint8_t>(x[byte * 8 + k] >= 0.0f) << k;
  }
  bits[byte] = packed;
}

__global__ void sign_dequantize_kernel(const uint8_t* bits, const float* scales, float* x, int64_t n, int64_t block) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    const float scale = scales[i / block];
    x[i] = (bits[i >> 3] >> (i & 7)) & 1u ? scale : -scale;
  }
}

unsigned grid_for(int64_t count) {
  return static_cast<unsigned>((count + kThreads - 1) / kThreads);
}

cudaStream_t as_stream(uintptr_t stream) {
  return reinterpret_cast<cudaStream_t>(stream);
}

} // namespace

extern "C" {

WB_API int wb_quant_int8_quantize(const float* x, int8_t* q, float* scales, int64_t n, int64_t block,
                                  uintptr_t stream) {
  if (n <= 0) {
    return cudaSuccess;
  }
  const int64_t blocks = (n + block - 1) / block;
  int8_quantize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream)>>>(x, q, scales, n, block);
  return cudaGetLastError();
}

WB_API int wb_quant_int8_dequantize(const int8_t* q, const float* scales, float* x, int64_t n, int64_t block,
                                    uintptr_t stream) {
  if (n <= 0) {
    return cudaSuccess;
  }
  int8_dequantize_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(q, scales, x, n, block);
  return cudaGetLastError();
}

WB_API int wb_quant_sign_quantize(const float* x, uint8_t* bits, float* scales, int64_t n, int64_t block,
                                  uintptr_t stream) {
  if (n <= 0) {
    return cudaSuccess;
  }
  const int64_t blocks = (n + block - 1) / block;
  sign_scale_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, as_stream(stream)>>>(x, scales, n, block);
  sign_pack_kernel<<<grid_for((n + 7) / 8), kThreads, 0, as_stream(stream)>>>(x, bits, n);
  return cudaGetLastError();
}

WB_API int wb_quant_sign_dequantize(const uint8_t* bits, const float* scales, float* x, int64_t n, int64_t block,
                                    uintptr_t stream) {
  if (n <= 0) {
    return cudaSuccess;
  }
  sign_dequantize_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(bits, scales, x, n, block);
  return cudaGetLastError();
}

} // extern "C"
