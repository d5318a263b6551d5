"""Tensor parallel's GPU-only variants on two GPUs (skipped without them): async TP (torch's micro-pipelined TP
over CUDA symmetric memory) and Float8 linears under torchao's Float8 tensor-parallel styles. On the CPU both are
refused before any rank is touched (tests/engine/test_compile.py).

Tolerances: async TP multiplies the same operands in tp chunks, so its bf16 losses follow plain TP's within bf16
rounding (1e-2 relative, the same bound the compiled-vs-eager GPU test keeps); Float8 follows bf16 within 2 %, as
tests/engine/test_compile.py holds Float8 without tensor parallel.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import workbench as wb  # noqa: E402
from tests.engine import rank_fns as fns  # noqa: E402

pytestmark = pytest.mark.gpu

TP2 = wb.Config(model=wb.ModelConfig(dim=256, n_layers=2, n_heads=4, ffn_dim=768, max_seq_len=256), tp=2,
                batch_size=8, seq_len=128, precision="bf16", compile=True)
STEPS = 5


@pytest.fixture(scope="module")
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one NCCL rank each)")
    with wb.Workbench(2, telemetry=False) as bench:
        yield bench


def _losses(bench: wb.Workbench, cfg: wb.Config) -> list[float]:
    bench.check(cfg)
    return bench.pool.run(fns.train_on_device, cfg, STEPS)[0]


def test_async_tp_trains_as_plain_tensor_parallel(two_gpus):
    plain = _losses(two_gpus, TP2)
    fused = _losses(two_gpus, TP2.replace(async_tp=True))
    assert fused == pytest.approx(plain, rel=1e-2)


def test_float8_under_tensor_parallel_follows_bf16(two_gpus):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs fp8 matrix units (compute capability 8.9 or newer)")
    pytest.importorskip("torchao")
    bf16 = _losses(two_gpus, TP2)
    for recipe in ("fp8_tensorwise", "fp8_rowwise"):
        fp8 = _losses(two_gpus, TP2.replace(precision=recipe))
        assert all(torch.isfinite(torch.tensor(fp8)))
        assert fp8 == pytest.approx(bf16, rel=2e-2), recipe
