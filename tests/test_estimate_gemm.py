"""The GPU kernel model's GEMMs: wave quantization when the tiles fill the SMs, split-K / Stream-K when they do not,
and a kernel launch as every kernel's floor (workbench/estimate/kernels.py, streamk.py)."""

from __future__ import annotations

import math

import pytest

import workbench as wb
from workbench.estimate.kernels import KERNEL_FLOOR_S, MEMORY_EFFICIENCY, TILE, _intrinsic, gemm_time
from workbench.estimate.streamk import split_k_time
from workbench.hardware import A100, H100


def _rate(hw, precision: str) -> float:
    return hw.peak(precision) * min(1.0, _intrinsic(hw)) * hw.power_scale


def _wave_quantized(hw, precision: str, m: int, n: int, k: int, elem: float) -> float:
    """The data-parallel model written out on its own: FLOPs over the waves' efficiency, or the bytes."""
    tiles = math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
    compute = 2 * m * n * k / (_rate(hw, precision) * tiles / (math.ceil(tiles / hw.sms) * hw.sms))
    return max(compute, elem * (m * k + k * n + m * n) / (hw.mem_bw * MEMORY_EFFICIENCY))


@pytest.mark.parametrize("shape", [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336),
                                   (14336, 4096, 16384), (131072, 1024, 8192)])
def test_gemms_that_fill_the_sms_keep_wave_quantization(shape):
    # The published runs' GEMMs (tiles ≫ SMs) are priced exactly as before split-K was modelled.
    m, n, k = shape
    assert gemm_time(H100, "bf16", m, n, k, 2) == _wave_quantized(H100, "bf16", m, n, k, 2)


def test_one_tile_weight_gradient_runs_on_every_sm():
    # A weight gradient of one output tile with K = 131,072 tokens (fp32, compute bound): on one SM it would take
    # 132× its FLOPs at the whole device's rate; split along K it takes about that rate, plus the floor and the
    # reduction of 131 fp32 partial tiles (128 KiB each, written and read at the memory's rate).
    m, n, k = TILE[0], TILE[1], 131072
    filled = 2 * m * n * k / _rate(H100, "fp32")
    reduction = 131 * 2 * 4 * m * n / (H100.mem_bw * MEMORY_EFFICIENCY)
    t = gemm_time(H100, "fp32", m, n, k, 4)
    assert filled < t <= filled * 1.01 + KERNEL_FLOOR_S + reduction
    assert t < _wave_quantized(H100, "fp32", m, n, k, 4) / 50


def test_skinny_tensor_parallel_weight_gradient_is_faster_than_one_wave_of_its_tiles():
    # wk's weight gradient under tp 8 (4096 × 128, K = 98,304 tokens, bf16): 32 tiles on 132 SMs.
    args = (H100, "bf16", 4096, 128, 98304, 2)
    assert gemm_time(*args) < 0.9 * _wave_quantized(*args)


@pytest.mark.parametrize("hw", [H100, A100], ids=lambda h: h.name)
@pytest.mark.parametrize("mn", [(64, 64), (64, 192), (128, 256), (1024, 512), (4096, 128)])
@pytest.mark.parametrize("precision,elem", [("fp32", 4), ("bf16", 2)])
def test_time_is_monotone_in_k(hw, mn, precision, elem):
    ks = [*range(8, 2048, 13), *range(2048, 40000, 1997)]  # every k-tile boundary region, then long K
    times = [gemm_time(hw, precision, *mn, k, elem) for k in ks]
    assert all(a <= b for a, b in zip(times, times[1:]))


def test_no_gemm_is_faster_than_a_launch_nor_than_its_flops_on_every_sm():
    assert gemm_time(H100, "bf16", 16, 16, 16, 2) == KERNEL_FLOOR_S
    for m, n, k in [(64, 64, 256), (64, 256, 1024), (256, 64, 64), (128, 128, 65536), (512, 4096, 4096)]:
        t = gemm_time(H100, "bf16", m, n, k, 2)
        assert t >= max(KERNEL_FLOOR_S, 2 * m * n * k / _rate(H100, "bf16"))


def test_splitting_is_never_slower_than_one_unit_per_tile():
    # g = tiles (data parallel) is among the choices; costly fixups leave it the best.
    assert split_k_time(4, 100, 1e-6, 0.0, 132, 0.0) == pytest.approx(math.ceil(400 / 132) * 1e-6)
    assert split_k_time(4, 100, 1e-6, 1.0, 132, 1.0) == pytest.approx(100e-6)


def test_small_model_estimate_is_bounded_by_launches_not_by_one_sm():
    # The 64-wide 2-layer model at 256 tokens per rank: its 45 GEMMs (7 linears × 3 per block, 2 blocks, the
    # head's 3) each at least a launch; before split-K its weight gradients ran K-long on one SM (286 µs in all).
    cfg = wb.Config(dp=2, batch_size=8, seq_len=64, model=wb.ModelConfig(dim=64, n_layers=2, n_heads=2))
    gemm = dict(wb.estimate(cfg, "h100").stages[0].compute_split)["gemm"]
    assert 45 * KERNEL_FLOOR_S <= gemm < 200e-6
    bigger = wb.Config(dp=2, batch_size=32, seq_len=64, model=cfg.model)
    assert dict(wb.estimate(bigger, "h100").stages[0].compute_split)["gemm"] < 2 * gemm
