"""How long GPU kernels take: GEMMs by shape, flash attention, and memory-bound kernels by the bytes they move.

One model for every GPU profile and every layout, its constants cited here and in `hardware.py`:
- a GEMM runs its output in tiles, one wave of tiles per SM at a time (NVIDIA Deep Learning Performance
  Guide, "Matrix Multiplication Background": tile and wave quantization); a wave that is not full wastes the
  idle SMs' share. A GEMM whose tiles do not fill one wave is split along K over the SMs instead (split-K /
  Stream-K, `streamk`). Its time is the largest of its FLOPs at the profile's large-GEMM rate over how well it
  keeps the SMs busy, its bytes (A, B and C once) at the memory's streaming rate (the roofline), and the floor of
  one kernel launch (KERNEL_FLOOR_S);
- flash attention at the profile's measured fraction of peak (FlashAttention-2 measured), causal FLOPs
  counted as half the square and the backward as 2.5 forwards, as the FlashAttention papers count them;
- both are power bound: under a power limit below the device's rating they run at `Hardware.power_scale` of
  their rate (torchtitan's 500 W H100s); a device whose shares were measured on another with the same GPU runs
  at its `shares_scale` of them (the GB200 at the B200's rates times the ratio of their clocks);
- everything else (norms, rotary, activations, residual adds, casts, the loss, the optimizer) is memory bound:
  the bytes it reads and writes at the memory's streaming rate.
"""

from __future__ import annotations

import functools
import math

from workbench.estimate.streamk import ACCUMULATOR_BYTES, k_tile, split_k_time
from workbench.hardware import GEMM_EFFICIENCY, Hardware

TILE = (128, 256)
"""Output tile (rows × columns) of cuBLAS's large bf16 GEMM kernels on Ampere and Hopper (the 256×128 tiles of
NVIDIA's "Matrix Multiplication Background" guide): wave quantization counts these per SM."""
MEASURED_SHAPE = 8192
"""The square GEMM behind hardware.GEMM_EFFICIENCY (shared/FACTS.md): its own wave efficiency is divided out,
so a shape with full waves runs a little faster than that figure."""
FP8_GEMM_EFFICIENCY = 1404 / 1979
"""An fp8 GEMM's fraction of the fp8 peak: 1,404 TFLOP/s for m 4096, n 7168, k 16384 on an H800 SXM (the H100 SXM's
compute, 1,979 dense fp8) with 128 × 128 tiles, deepseek-ai/DeepGEMM PR 74 (2025, its "Base" column): 71%, below
bf16's 80% (GEMM_EFFICIENCY): fp8 tensor cores finish a k-tile in half the time, so feeding them (loads, the
scales' epilogue) takes a larger share. Taken for every 8-bit and 4-bit format a device has no measurement of its
own for (`Hardware.low_precision_gemm_efficiency`: the B200's MXFP8 and NVFP4)."""
FP8_MEASURED_SHAPE = (4096, 7168)
"""The output shape behind FP8_GEMM_EFFICIENCY, whose wave efficiency is divided out likewise."""
LOW_PRECISION = ("fp8", "mxfp8", "nvfp4")
"""Peak keys of the formats FP8_GEMM_EFFICIENCY prices."""
MEMORY_EFFICIENCY = 0.9
"""Fraction of HBM bandwidth that streaming kernels (copies, elementwise ops, reductions) reach on NVIDIA data
centre GPUs: BabelStream-class benchmarks reach about 90% of the datasheet figure. An assumption, not measured
here."""
KERNEL_FLOOR_S = 3.0e-6
"""The least time a kernel takes in a stream of them: the launch of one by the CUDA driver, a no-op kernel's raw
cuLaunchKernel measured at 3.0 µs on a GB200 (meta-pytorch/tritonbench PR 1017, 2026, "irreducible CUDA driver
cost"; torch's own dispatch adds more, not counted here). One host thread issues kernels no faster than that, so a
kernel shorter than a launch still takes one; a longer kernel hides the next launch behind it, so no time is
added to it."""
FLASH_BACKWARD_RATIO = 2.5
"""FLOPs of flash attention's backward over its forward (FlashAttention-2, section 4.1: 2.5 times, as it
recomputes the scores and runs five matmuls to the forward's two)."""


def wave_efficiency(hw: Hardware, rows: int, cols: int) -> float:
    """Share of the SMs' work a GEMM's output tiles keep busy: tiles / (waves · SMs)."""
    tiles = math.ceil(rows / TILE[0]) * math.ceil(cols / TILE[1])
    return tiles / (math.ceil(tiles / hw.sms) * hw.sms)


def _intrinsic(hw: Hardware, precision: str = "bf16") -> float:
    """The large-GEMM fraction of peak at `precision` with its measured shape's wave efficiency divided out."""
    if precision.startswith("fp8") or precision in LOW_PRECISION:
        measured = hw.low_precision_gemm_efficiency.get("fp8" if precision.startswith("fp8") else precision)
        if measured:
            return _divided_out(measured, hw.sms, (MEASURED_SHAPE, MEASURED_SHAPE))
        return _divided_out(FP8_GEMM_EFFICIENCY, hw.sms, FP8_MEASURED_SHAPE)
    return _divided_out(hw.gemm_efficiency or GEMM_EFFICIENCY, hw.sms, (MEASURED_SHAPE, MEASURED_SHAPE))


@functools.lru_cache(maxsize=64)
def _divided_out(efficiency: float, sms: int, shape: tuple[int, int]) -> float:
    tiles = math.ceil(shape[0] / TILE[0]) * math.ceil(shape[1] / TILE[1])
    return efficiency / (tiles / (math.ceil(tiles / sms) * sms))


def gemm_time(hw: Hardware, precision: str, m: int, n: int, k: int, elem_bytes: float) -> float:
    """Seconds of an (m × k) · (k × n) GEMM at `precision` whose operands take `elem_bytes` each."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return _gemm(_rate(hw, precision), hw.sms, hw.mem_bw, m, n, k, elem_bytes, k_tile(precision))


def _rate(hw: Hardware, precision: str) -> float:
    """FLOP/s a GEMM of many full waves reaches at `precision`."""
    return hw.peak(precision) * min(1.0, _intrinsic(hw, precision)) * hw.compute_scale


@functools.lru_cache(maxsize=4096)
def _gemm(rate: float, sms: int, mem_bw: float, m: int, n: int, k: int, elem_bytes: float, k_step: int) -> float:
    # Cached on plain numbers: wb.plan prices the same few shapes for thousands of layouts.
    tiles = math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
    memory = elem_bytes * (m * k + k * n + m * n) / (mem_bw * MEMORY_EFFICIENCY)
    if tiles >= sms:
        # Full waves and a tail: data-parallel tiles (cuBLAS's handling of a tail wave is not documented; the
        # measured GEMM_EFFICIENCY, whose 8192² shape has a 52%-full tail, is taken with whatever it does).
        compute = 2 * m * n * k / (rate * tiles / (math.ceil(tiles / sms) * sms))
    else:
        # One SM's rate on a tile's share of the useful FLOPs, per k-tile; a partial tile is the tile's share of
        # the output in fp32, written by a peer and read by the finisher at one SM's share of the memory.
        iteration = 2 * m * n * k_step / tiles / (rate / sms)
        partial = 2 * ACCUMULATOR_BYTES * m * n / tiles / (mem_bw * MEMORY_EFFICIENCY / sms)
        compute = split_k_time(tiles, math.ceil(k / k_step), iteration, partial, sms, KERNEL_FLOOR_S)
    return max(compute, memory, KERNEL_FLOOR_S)


def linear_time(hw: Hardware, precision: str, tokens: int, fan_in: int, fan_out: int, elem_bytes: float,
                forward: bool = True, backward: bool = True) -> float:
    """A linear layer over `tokens` rows: forward (tokens × in → out), and backward's gradient of its input
    (tokens × out → in) and of its weight (in × tokens → out)."""
    fwd, dgrad, wgrad = linear_parts(hw, precision, tokens, fan_in, fan_out, elem_bytes)
    return (fwd if forward else 0.0) + (dgrad + wgrad if backward else 0.0)


def linear_parts(hw: Hardware, precision: str, tokens: int, fan_in: int, fan_out: int, elem_bytes: float,
                 chunks: int = 1) -> tuple[float, float, float]:
    """A linear layer's three GEMMs over `tokens` rows: (forward, input gradient, weight gradient). `chunks`: the
    forward and input-gradient GEMMs run as that many GEMMs of tokens/chunks rows each (async TP's
    micro-pipelining, which multiplies each shard of the sequence as it arrives)."""
    rows = -(-tokens // chunks)
    if min(tokens, fan_in, fan_out) <= 0:
        return 0.0, 0.0, 0.0
    # gemm_time's three GEMMs with the rate worked out once (wb.plan prices ~300,000 linears).
    rate, sms, bw, k_step = _rate(hw, precision), hw.sms, hw.mem_bw, k_tile(precision)
    return (chunks * _gemm(rate, sms, bw, rows, fan_out, fan_in, elem_bytes, k_step),
            chunks * _gemm(rate, sms, bw, rows, fan_in, fan_out, elem_bytes, k_step),
            _gemm(rate, sms, bw, fan_in, fan_out, tokens, elem_bytes, k_step))


def attention_forward_flops(queries: int, seq_len: int, heads: int, head_dim: int) -> float:
    """Causal flash attention's forward FLOPs as its papers count them: q·kᵀ and p·v over half the square, for
    `queries` tokens of sequences of `seq_len` (a cp rank's share of them attends to the whole sequence)."""
    return queries * 4 * seq_len * head_dim * heads / 2


def attention_time(hw: Hardware, precision: str, forward_flops: float, forwards: int = 1,
                   backward: bool = True) -> float:
    """Seconds of `forwards` flash-attention forwards (a recomputation is one more) and, if asked, a backward."""
    rate = hw.peak(precision) * (hw.attention_efficiency or _intrinsic(hw)) * hw.compute_scale
    return forward_flops * (forwards + (FLASH_BACKWARD_RATIO if backward else 0)) / rate


def memory_time(hw: Hardware, nbytes: float) -> float:
    """Seconds a memory-bound kernel (or many) takes to read and write `nbytes`."""
    return nbytes / (hw.mem_bw * MEMORY_EFFICIENCY)
