"""Per-op selective recomputation (Config.activation_checkpointing="op", torchtitan's policy) trains exactly like no
recomputation: the same per-step losses as one process, at the parity tests' 1e-5 (it reruns the same ops)."""

from __future__ import annotations

import pytest

from workbench.config import Config

from tests.engine import rank_fns as fns

STEPS = 3
BASE = Config(batch_size=8, seq_len=64)


@pytest.mark.parametrize("layout", [dict(dp=2, zero=3), dict(tp=2)], ids=["dp2-zero3", "tp2"])
def test_op_recomputation_matches_one_process(pool, layout):
    reference = fns.reference_run(BASE, STEPS)["losses"]
    results = pool.run(fns.train, BASE.replace(activation_checkpointing="op", **layout), STEPS)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert results[0]["losses"] == pytest.approx(reference, rel=1e-5)
