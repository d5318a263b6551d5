// CPU quantise / dequantise kernels behind the int8 and 1-bit compressed all-reduce.
// See quantize.h for the arithmetic; tensors are checked here so Python gets a clear error.

#include "quantize.h"

#include <torch/python.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace wbt {
namespace {

void check_input(const at::Tensor& x, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, " must be a CPU tensor (CUDA tensors go through libwbcuda)");
  TORCH_CHECK(x.scalar_type() == dtype, what, " must be ", c10::toString(dtype), ", got ",
              c10::toString(x.scalar_type()));
  TORCH_CHECK(x.is_contiguous() && x.dim() == 1, what, " must be a contiguous 1-D tensor");
}

int64_t blocks_of(int64_t n, int64_t block) {
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  return (n + block - 1) / block;
}

std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x, int64_t block) {
  check_input(x, at::kFloat, "x");
  const int64_t n = x.numel(), nb = blocks_of(n, block);
  auto q = at::empty({n}, x.options().dtype(at::kChar));
  auto scales = at::empty({nb}, x.options());
  const float* in = x.data_ptr<float>();
  int8_t* out = q.data_ptr<int8_t>();
  float* s = scales.data_ptr<float>();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = std::min(n, lo + block);
    float absmax = 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      absmax = std::max(absmax, std::fabs(in[i]));
    }
    const float scale = absmax / 127.0f;
    s[b] = scale;
    for (int64_t i = lo; i < hi; ++i) {
      // x / scale, not x * (1 / scale): the same float operation as the torch reference.
      const float v = scale > 0.0f ? std::nearbyint(in[i] / scale) : 0.0f;
      out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
  }
  return {q, scales};
}

at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block) {
  check_input(q, at::kChar, "q");
  check_input(scales, at::kFloat, "scales");
  const int64_t n = q.numel(), nb = blocks_of(n, block);
  TORCH_CHECK(scales.numel() == nb, "expected ", nb, " scales for ", n, " values, got ", scales.numel());
  auto x = at::empty({n}, scales.options());
  const int8_t* in = q.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* out = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(in[i]) * s[i / block];
  }
  return x;
}

std::tuple<at::Tensor, at::Tensor> sign_quantize(const at::Tensor& x, int64_t block) {
  check_input(x, at::kFloat, "x");
  const int64_t n = x.numel(), nb = blocks_of(n, block);
  auto bits = at::zeros({(n + 7) / 8}, x.options().dtype(at::kByte));
  auto scales = at::empty({nb}, x.options());
  const float* in = x.data_ptr<float>();
  uint8_t* out = bits.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = std::min(n, lo + block);
    double sum = 0.0;
    for (int64_t i = lo; i < hi; ++i) {
      sum += std::fabs(static_cast<double>(in[i]));
    }
    s[b] = static_cast<float>(sum / static_cast<double>(hi - lo));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (in[i] >= 0.0f) {
      out[i >> 3] |= static_cast<uint8_t>(1u << (i & 7));
    }
  }
  return {bits, scales};
}

at::Tensor sign_dequantize(const at::Tensor& bits, const at::Tensor& scales, int64_t n, int64_t block) {
  check_input(bits, at::kByte, "bits");
  check_input(scales, at::kFloat, "scales");
  const int64_t nb = blocks_of(n, block);
  TORCH_CHECK(bits.numel() == (n + 7) / 8, "expected ", (n + 7) / 8, " bytes of signs for ", n,
              " values, got ", bits.numel());
  TORCH_CHECK(scales.numel() == nb, "expected ", nb, " scales for ", n, " values, got ", scales.numel());
  auto x = at::empty({n}, scales.options());
  const uint8_t* in = bits.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  float* out = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float scale = s[i / block];
    out[i] = (in[i >> 3] >> (i & 7)) & 1u ? scale : -scale;
  }
  return x;
}

} // namespace

void bind_quantize(pybind11::module_& m) {
  namespace py = pybind11;
  // The loops hold no Python objects: release the GIL so other rank threads (telemetry) run.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("int8_quantize", &int8_quantize, py::arg("x"), py::arg("block"), nogil);
  m.def("int8_dequantize", &int8_dequantize, py::arg("q"), py::arg("scales"), py::arg("block"), nogil);
  m.def("sign_quantize", &sign_quantize, py::arg("x"), py::arg("block"), nogil);
  m.def("sign_dequantize", &sign_dequantize, py::arg("bits"), py::arg("scales"), py::arg("n"),
        py::arg("block"), nogil);
}

} // namespace wbt
