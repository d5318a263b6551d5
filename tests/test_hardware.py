"""Hardware profiles: datasheet peaks, power limits, the measured CPU and custom hardware, as the estimator reads them."""

from __future__ import annotations

import dataclasses

import pytest

from workbench.config import Config
from workbench.estimate import estimate
from workbench.hardware import A100, DATASHEETS, H100, H200, Hardware, measure_cpu, profile, si


def test_datasheet_profiles():
    assert profile("H100") is H100 and profile("h200") is H200 and profile("a100") is A100
    assert H100.peak("bf16") == 989.5e12 and H100.peak("fp32") == 67e12 and H100.peak("tf32") == 494.5e12
    assert (H100.memory_bytes, H100.mem_bw, H100.link_bw) == (80e9, 3.35e12, 450e9)
    assert H200.peak_flops == H100.peak_flops and (H200.memory_bytes, H200.mem_bw) == (141e9, 4.8e12)
    assert (A100.peak("bf16"), A100.peak("fp32"), A100.link_bw) == (312e12, 19.5e12, 300e9)
    assert not any(h.measured for h in DATASHEETS.values())
    with pytest.raises(ValueError, match="fp8"):
        A100.peak("fp8")
    with pytest.raises(ValueError, match="tpu"):
        profile("tpu")


def test_power_limit_slows_power_bound_kernels_only():
    # torchtitan's H100s: the 700 W SXM part run at 500 W. GEMMs and flash attention (power bound) run at 500/700 of
    # their rate; a memory-bound kernel does not change; a profile at its rating (or above it) is not scaled.
    import dataclasses

    from workbench.estimate.kernels import attention_time, gemm_time, memory_time
    from workbench.hardware import H100_96GB

    assert H100_96GB.peak_flops == H100.peak_flops and H100_96GB.power_scale == pytest.approx(500 / 700)
    assert H100.power_scale == H200.power_scale == A100.power_scale == 1.0
    assert dataclasses.replace(H100, power_limit_w=800).power_scale == 1.0
    rated = dataclasses.replace(H100_96GB, power_limit_w=0.0)
    big = (16384, 14336, 4096, 2)
    assert gemm_time(H100_96GB, "bf16", *big) == pytest.approx(gemm_time(rated, "bf16", *big) * 700 / 500)
    assert attention_time(H100_96GB, "bf16", 1e12) == pytest.approx(attention_time(rated, "bf16", 1e12) * 700 / 500)
    assert memory_time(H100_96GB, 1e9) == memory_time(rated, 1e9)
    # A GEMM that is memory bound (one row) keeps its time: the roofline's memory side is not power bound.
    thin = (1, 14336, 4096, 2)
    assert gemm_time(H100_96GB, "bf16", *thin) == gemm_time(rated, "bf16", *thin)
    assert "500 W of its rated 700 W" in str(H100_96GB) and " W" not in str(H100).split("link")[1]


def test_b200_gemms_take_the_times_measured_on_a_b200_and_formats_not_measured_take_hoppers_share():
    # pytorch/ao PR 2427 (June 2025, cuBLAS on a B200): an 8192³ GEMM in 774 µs in bf16 and 205 µs in NVFP4;
    # triton-lang/triton PR 9044 (December 2025, cuBLAS 13.1 on a B200): the MXFP8 one in 385.8 µs. The profile
    # prices those shapes at those times (their own wave quantization included); tensorwise fp8, measured on no B200,
    # at the share Hopper's fp8 reaches; memory at the 7,680-bit bus's 7.67 TB/s (ao PR 4002).
    from workbench.estimate.kernels import FP8_GEMM_EFFICIENCY, gemm_time
    from workbench.hardware import B200

    cube = (8192, 8192, 8192)
    assert gemm_time(B200, "bf16", *cube, 2) == pytest.approx(7.74e-4, rel=1e-9)
    assert gemm_time(B200, "nvfp4", *cube, 0.5) == pytest.approx(2.05e-4, rel=1e-9)
    assert gemm_time(B200, "mxfp8", *cube, 1) == pytest.approx(3.858095e-4, rel=1e-9)
    # Against the same GEMM on a B200 with no figure of its own: Hopper's share, not the MX or NVFP4 one.
    shared = gemm_time(dataclasses.replace(B200, low_precision_gemm_efficiency={}), "fp8_tensorwise", *cube, 1)
    assert gemm_time(B200, "fp8_tensorwise", *cube, 1) == shared
    assert 2 * 8192**3 / shared > 0.6 * FP8_GEMM_EFFICIENCY * B200.peak("fp8_tensorwise")
    assert B200.mem_bw == pytest.approx(7.672e12, rel=1e-3)


def test_a_gb200_multiplies_at_the_b200s_measured_rates_times_their_clocks_ratio_not_their_peaks():
    # Same GPU: the GB200's 2,062 MHz against the B200's 1,965 (nvidia-smi's maximum SM clocks); its datasheet
    # peaks are 11% above the B200's, its best measured matmuls 4.4% (bf16) and 5.3% (fp8) above.
    from workbench.estimate.kernels import attention_time, gemm_time
    from workbench.hardware import B200, GB200

    cube = (8192, 8192, 8192)
    for fmt, elem in (("bf16", 2), ("mxfp8", 1), ("nvfp4", 0.5), ("fp8_tensorwise", 1)):
        assert gemm_time(GB200, fmt, *cube, elem) == pytest.approx(gemm_time(B200, fmt, *cube, elem) * 1965 / 2062,
                                                                   rel=1e-9), fmt
    assert attention_time(GB200, "bf16", 1e15) == pytest.approx(attention_time(B200, "bf16", 1e15) * 1965 / 2062)
    assert B200.compute_scale == 1.0 and GB200.peak("bf16") / B200.peak("bf16") == pytest.approx(2500 / 2250)


def test_cpu_profile_is_measured():
    cpu = measure_cpu(budget_s=0.05)
    assert cpu.measured and cpu.name == "cpu"
    assert set(cpu.peak_flops) == {"fp32", "bf16", "fp16"} and all(v > 1e6 for v in cpu.peak_flops.values())
    assert cpu.memory_bytes > 1e9 and cpu.mem_bw > 1e8
    est = estimate(Config(), hardware=cpu)
    assert est.hardware is cpu and est.compute_s > estimate(Config()).compute_s


def test_the_notebooks_cpu_estimate_measures_the_cpu_as_its_ranks_see_it(monkeypatch):
    """In the notebook, "cpu" is measured at the intra-op threads each local rank of the layout gets (the cores
    shared among them, as the pool sets them), not at the notebook's own: it predicts the ranks."""
    import os

    import torch

    from workbench import hardware

    seen = []

    def measure(torch_module, budget_s):
        seen.append(torch_module.get_num_threads())
        return hardware.cpu_with_peak("fp32", 1e9)

    monkeypatch.setattr(hardware, "_measure_cpu", measure)
    hardware._measured_cpu.cache_clear()
    before = torch.get_num_threads()
    try:
        estimate(Config(dp=2), "cpu")
        estimate(Config(), "cpu")
    finally:
        hardware._measured_cpu.cache_clear()
    assert seen == [max(1, (os.cpu_count() or 1) // 2), os.cpu_count() or 1]
    assert torch.get_num_threads() == before  # the notebook's own threads are left as they were


def test_custom_hardware():
    tiny_gpu = Hardware(name="toy", peak_flops={"fp32": 1e12}, memory_bytes=1e6, mem_bw=1e11, link_bw=1e9,
                        measured=False)
    est = estimate(Config(), tiny_gpu)
    assert not est.fits and "DOES NOT FIT" in est.table()
    with pytest.raises(ValueError, match="bf16"):
        estimate(Config(precision="bf16"), tiny_gpu)


def test_si():
    assert si(989.5e12, "FLOP/s") == "990 TFLOP/s"
    assert si(999.7, "B") == "1 kB"
    assert si(0, "B") == "0 B"
