"""Checkpoints of expert-parallel layouts: saved at any ep, loaded at any other, training on as if uninterrupted.

Each rank holds its own slice of the experts under the bare model's names; the checkpoint must hold all
experts (and their AdamW moments), and a load must hand each rank the slice it holds now.

Tolerance as tests/engine/test_checkpoint.py: across layouts, the losses after a load equal the
single-process reference within 1e-5 relative; in the same layout a resume is bit-identical (== on floats).
"""

from __future__ import annotations

import pytest

import workbench as wb
from workbench.engine.session import drop

from tests.engine import rank_fns as fns
from tests.engine.test_checkpoint import SAVED_AT, THEN, resume_in_layouts
from tests.engine.test_moe import BASE

REL = 1e-5
EP2 = BASE.replace(dp=2, ep=2)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return fns.reference_run(BASE, SAVED_AT + THEN)["losses"]


def test_a_dp2_ep2_checkpoint_continues_at_ep1_at_ep2_and_under_zero3(pool, reference, tmp_path):
    targets = {"dp2 ep2": EP2, "dp2 ep1": BASE.replace(dp=2), "dp2 ep2 zero3": EP2.replace(zero=3),
               "dp2 ep1 zero2": BASE.replace(dp=2, zero=2)}
    out = pool.run(resume_in_layouts, EP2, targets, str(tmp_path))[0]
    straight = pool.run(fns.train, EP2, SAVED_AT + THEN)[0]["losses"]
    assert out["saved"] == straight[:SAVED_AT]
    assert out["dp2 ep2"] == straight[SAVED_AT:]  # same layout: bit-identical
    for name in targets:
        assert out[name] == pytest.approx(reference[SAVED_AT:], rel=REL), name


def test_an_ep1_zero3_checkpoint_continues_at_ep2(pool, reference, tmp_path):
    targets = {"dp2 ep2": EP2, "dp2 ep2 zero2": EP2.replace(zero=2)}
    out = pool.run(resume_in_layouts, BASE.replace(dp=2, zero=3), targets, str(tmp_path))[0]
    for name in targets:
        assert out[name] == pytest.approx(reference[SAVED_AT:], rel=REL), name


def test_dp4_ep2_zero3_shards_over_edp_and_loads_at_ep4(pool4, reference, tmp_path):
    # edp=2: each expert slice is itself an FSDP2 shard over two ranks; ep4 then holds one expert per rank.
    targets = {"dp4 ep4": BASE.replace(dp=4, ep=4), "dp4 ep2 zero0": BASE.replace(dp=4, ep=2)}
    out = pool4.run(resume_in_layouts, BASE.replace(dp=4, ep=2, zero=3), targets, str(tmp_path))[0]
    for name in targets:
        assert out[name] == pytest.approx(reference[SAVED_AT:], rel=REL), name


def test_periodic_saves_at_ep2_resume_exactly_in_a_fresh_workbench(pool, tmp_path):
    pool.run(drop)
    try:
        bench = wb.Workbench(pool=pool, telemetry=False)
        bench.apply(EP2)
        straight = [m.loss for m in bench.train(6, save_every=3, save_to=tmp_path).wait()]
        assert [d.name for _, d in wb.checkpoints.complete(tmp_path)] == ["step-000003", "step-000006"]
        pool.run(drop)
        fresh = wb.Workbench(pool=pool, telemetry=False)
        info = fresh.load(tmp_path / "step-000003")  # no model yet: the saved Config (ep=2) is applied first
        assert fresh.config == EP2 and info["step"] == 3 and info["saved_layout"] == EP2.layout
        assert [m.loss for m in fresh.train(3).wait()] == straight[3:]
    finally:
        if not pool.broken:
            pool.run(drop)
