"""Hugging Face families train like their own model in one process, in every layout they support.

The reference is the family's own transformers model and forward (tests/models/families.py) with the initial values
the workbench draws. Tolerance: fp32 losses within 1e-5 relative per step (the built-in model's, test_parity.py):
the differences are the order of floating-point sums across ranks and micro-batches. Tiny shapes and 3 steps each:
what is tested is that every layout computes the same model, not that it learns.
"""

from __future__ import annotations

import pytest

from workbench.config import Config

from tests.engine import rank_fns as fns
from tests.models.families import FAMILIES, family, hf_reference

STEPS = 3
REL = 1e-5
BASE = dict(batch_size=4, seq_len=16, lr=3e-3)

DENSE_LAYOUTS = {
    "dp2 zero0": dict(dp=2),
    "dp2 zero3 ac full": dict(dp=2, zero=3, activation_checkpointing="full"),
    "tp2": dict(tp=2),
    "pp2 1f1b": dict(pp=2, micro_batches=2),
    "cp2": dict(cp=2),
}
MOE_LAYOUTS = {
    "dp2 zero0": dict(dp=2),
    "dp2 ep2 zero2": dict(dp=2, ep=2, zero=2),
    "tp2": dict(tp=2),
    "pp2 1f1b": dict(pp=2, micro_batches=2),
}


def layouts_of(name: str) -> dict[str, dict]:
    """What the family supports here: a mixture of experts adds ep; Mistral's window (8, under seq_len) refuses cp
    (test_what_the_adapter_cannot_lay_out_is_refused_before_any_rank)."""
    if name.endswith("moe"):
        return MOE_LAYOUTS
    return {k: v for k, v in DENSE_LAYOUTS.items() if not (name == "mistral" and v.get("cp", 1) > 1)}


def cases() -> list[tuple[str, str]]:
    return [(name, layout) for name in FAMILIES for layout in layouts_of(name)]


def assert_parity(results: list[dict], reference: list[float]) -> None:
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results), "ranks disagree on the loss"
    assert losses == pytest.approx(reference, rel=REL), f"layout {losses}\nreference {reference}"


@pytest.mark.parametrize("name,layout", cases())
def test_family_layout_matches_its_own_model(pool, name, layout):
    cfg = Config(model=family(name), **BASE, **layouts_of(name)[layout])
    assert_parity(pool.run(fns.train, cfg, STEPS), hf_reference(cfg, STEPS))
