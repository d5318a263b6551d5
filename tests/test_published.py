"""The estimator held to published results.

Sources:
- torchtitan, docs/performance.md, "Table 1: 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2,
  global batch size 16. Selective activation checkpointing": FSDP (no torch.compile, no Float8) 5,762 TPS/GPU,
  82.4 GiB, on Grand Teton H100s (96 GB HBM, 500 W power limit). The table states no sequence length; torchtitan's
  llama3_8b.toml trains at seq_len 8192, which we take. The same page says the 8B run without Float8 reaches
  33-39% MFU (eager / compiled).
- Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020),
  Figure 1: a 7.5B-parameter model on 64 GPUs with mixed-precision Adam (2+2 bytes of fp16 parameters and
  gradients, K = 12 bytes of optimizer state per parameter) needs 120 GB (baseline), 31.4 GB (P_os),
  16.6 GB (P_os+g) and 1.9 GB (P_os+g+p) of model states per GPU.
"""

from __future__ import annotations

import math

import pytest

import workbench as wb
from workbench.estimate import ENGINE_STATE_BYTES, model_state_memory, zero_paper_memory

GB = 1e9


def test_zero_paper_model_state_memory():
    # The estimator's own per-category arithmetic (model_state_memory, which every estimate uses), run with the
    # paper's bytes per parameter instead of the engine's fp32 ones.
    predicted = zero_paper_memory(7_500_000_000, dp=64)
    published = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}  # GB, printed to three significant digits
    # Exact arithmetic gives 120, 31.406, 16.641, 1.875 GB: each within half a unit of the published figure's last
    # digit (0.05 GB), i.e. the table is this arithmetic rounded for print; nothing else is needed to match it.
    for zero, gb in published.items():
        assert abs(predicted[zero] / GB - gb) <= 0.05 + 1e-12, (zero, predicted[zero] / GB, gb)
    # The engine's own convention (fp32 master parameters through autocast: 4+4+8 B) on the same model.
    assert model_state_memory(7_500_000_000, 64, 0, ENGINE_STATE_BYTES) == (30 * GB, 30 * GB, 60 * GB)


def test_torchtitan_llama3_8b_fsdp_throughput_on_8_h100():
    cfg = wb.Config(model=wb.ModelConfig.preset("8b"), dp=8, zero=3, precision="bf16", seq_len=8192,
                    batch_size=16, activation_checkpointing="selective")
    # efficiency (the estimate's stated MFU assumption on executed FLOPs) at its default, 0.4; not fitted here.
    est = wb.estimate(cfg, "h100", efficiency=0.4)
    per_gpu = est.tokens_per_s / cfg.world_size
    published = 5762
    print(f"predicted {per_gpu:,.0f} tokens/s/GPU vs published {published:,} ({per_gpu / published - 1:+.1%}); "
          f"MFU {est.mfu:.1%}")
    # Predicted 5,904 tokens/s/GPU (+2.5%), model MFU 35% against torchtitan's 5,762 (33.7% by the same FLOP count).
    # Tolerance 10%: the efficiency is an assumption (torchtitan's own range is 33-39% MFU), our "selective" is
    # every other block recomputed while torchtitan's default is op-level selective recompute, and its H100s ran
    # at a 500 W cap; each moves the figure by several percent.
    assert math.isclose(per_gpu, published, rel_tol=0.10)
    # The model FLOP count is torchtitan's too (6·N + 12·layers·heads·head_dim·seq, embedding excluded):
    # 5,762 tokens/s at 57.9 GFLOP/token is the 33.7% MFU of 989.5 TFLOP/s bf16 torchtitan's figures imply.
    assert est.flops_per_token == pytest.approx(57.9e9, rel=0.002)
    assert 0.33 < published * est.flops_per_token / 989.5e12 < 0.34
