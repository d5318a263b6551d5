"""Block-wise gradient quantisers, run by the compiled extension: int8 (absmax) and 1-bit (sign + scale).

CPU tensors go to the C++ ops in `extensions/telemetry/quantize.cpp` (the
telemetry extension, built and cached by `workbench.telemetry.native`); CUDA
tensors to the kernels in `extensions/cuda/quantize.cu` (the CUDA library of
`workbench.telemetry.cuda`), launched on torch's current stream with raw
pointers. There is no Python fallback: if the extension is missing, a
`QuantizeUnavailable` error says how to build it, because a silently slower
or differently rounded path would change what a user measures.

    int8  per block: scale = absmax / 127, q = round(x / scale) in [-127, 127]
          1 byte per value + 4 bytes per block
    sign  per block: scale = mean |x| (the least-squares scale for scale·sign(x)), 1 bit per value
          (bit i of byte i/8 is 1 for x >= 0) + 4 bytes per block
"""

from __future__ import annotations

import ctypes
import functools

import torch

INT8_BLOCK = 256
"""Values sharing one int8 scale: the 4-byte scale costs 1.6% on top of 1 byte per value."""
SIGN_BLOCK = 2048
"""Values sharing one 1-bit scale: 4 bytes per 2048 bits (1.6%); smaller blocks track magnitudes better."""


CUDA_FUNCTIONS = ("wb_quant_int8_quantize", "wb_quant_int8_dequantize",
                  "wb_quant_sign_quantize", "wb_quant_sign_dequantize")
"""The kernels' C entry points in libwbcuda (extensions/cuda/quantize.cu): (in, out, out, n, block, stream)."""


class QuantizeUnavailable(RuntimeError):
    """The compiled quantisers are not available; the message says how to build them."""


@functools.cache
def _cpu_ops():
    from workbench.telemetry import native

    try:
        ext = native.load()
    except native.NativeBuildError as e:
        raise QuantizeUnavailable(
            f"compression 'int8' and '1bit' quantise in the compiled extension, which is unavailable: {e}\n"
            "Fix: build it with `python -m workbench.telemetry.native --build`, or use compression 'fp16'/'bf16'."
        ) from e
    if not hasattr(ext, "int8_quantize"):
        raise QuantizeUnavailable(f"the telemetry extension at {native.extension_path()} has no quantisers: rebuild "
                                  "it with `python -m workbench.telemetry.native --build`")
    return ext


@functools.cache
def _cuda_lib() -> ctypes.CDLL:
    from workbench.telemetry import cuda, native

    try:
        lib = cuda.load()
    except (native.NativeBuildError, OSError) as e:
        raise QuantizeUnavailable(
            f"compression 'int8' and '1bit' on CUDA quantise in the CUDA library (extensions/cuda), which is "
            f"unavailable: {e}\nFix: install the CUDA toolkit (nvcc) and run "
            "`python -m workbench.telemetry.native --build`, or use compression 'fp16'/'bf16'."
        ) from e
    vp, i64, u = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    for name in CUDA_FUNCTIONS:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [vp, vp, vp, i64, i64, u], ctypes.c_int
    return lib


def _launch(name: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, n: int, block: int) -> None:
    lib = _cuda_lib()
    stream = torch.cuda.current_stream(a.device).cuda_stream
    err = getattr(lib, name)(a.data_ptr(), b.data_ptr(), c.data_ptr(), n, block, stream)
    if err:
        raise RuntimeError(f"{name}: CUDA error {err} ({lib.wb_cuda_error_string(err).decode()})")


def _flat(x: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    if x.dtype != dtype or x.dim() != 1:
        raise TypeError(f"{what} must be a 1-D {dtype} tensor, got {x.dim()}-D {x.dtype}")
    return x.contiguous()


def blocks(n: int, block: int) -> int:
    return -(-n // block)


def int8_quantize(x: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n], scales float32 [ceil(n / block)]) of a 1-D float32 tensor."""
    x = _flat(x, torch.float32, "x")
    if x.device.type == "cpu":
        return _cpu_ops().int8_quantize(x, block)
    q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    scales = torch.empty(blocks(x.numel(), block), dtype=torch.float32, device=x.device)
    _launch("wb_quant_int8_quantize", x, q, scales, x.numel(), block)
    return q, scales


def int8_dequantize(q: torch.Tensor, scales: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    q, scales = _flat(q, torch.int8, "q"), _flat(scales, torch.float32, "scales")
    if q.device.type == "cpu":
        return _cpu_ops().int8_dequantize(q, scales, block)
    out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    _launch("wb_quant_int8_dequantize", q, scales, out, q.numel(), block)
    return out


def sign_quantize(x: torch.Tensor, block: int = SIGN_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits uint8 [ceil(n / 8)], scales float32 [ceil(n / block)]) of a 1-D float32 tensor."""
    x = _flat(x, torch.float32, "x")
    if x.device.type == "cpu":
        return _cpu_ops().sign_quantize(x, block)
    bits = torch.empty(-(-x.numel() // 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(blocks(x.numel(), block), dtype=torch.float32, device=x.device)
    _launch("wb_quant_sign_quantize", x, bits, scales, x.numel(), block)
    return bits, scales


def sign_dequantize(bits: torch.Tensor, scales: torch.Tensor, n: int, block: int = SIGN_BLOCK) -> torch.Tensor:
    bits, scales = _flat(bits, torch.uint8, "bits"), _flat(scales, torch.float32, "scales")
    if bits.device.type == "cpu":
        return _cpu_ops().sign_dequantize(bits, scales, n, block)
    out = torch.empty(n, dtype=torch.float32, device=bits.device)
    _launch("wb_quant_sign_dequantize", bits, scales, out, n, block)
    return out
