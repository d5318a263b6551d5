// Block-wise gradient quantisers for compressed all-reduce (workbench.engine.parallel.compression).
// CPU kernels here; the CUDA twins live in extensions/cuda/quantize.cu. Both follow the same
// arithmetic, which tests/engine/test_quantize.py checks against torch reference ops:
//   int8: per block of `block` elements, scale = absmax / 127 and q = nearbyint(x / scale)
//         (round half to even, as torch.round); a block of zeros has scale 0 and q = 0.
//   sign: per block, scale = mean |x| (the scale minimising the block's squared error of
//         scale * sign(x)), accumulated in double; bit i of byte i / 8 is 1 for x >= 0.

#pragma once

#include <pybind11/pybind11.h>

namespace wbt {

// Adds the quantiser ops to the extension module (called from bindings.cpp).
void bind_quantize(pybind11::module_& m);

} // namespace wbt
