"""wb.plan without processes: every layout enumerated, refusals from Config itself, ranking by the estimator,
and the rule that carries a planned layout onto the local pool."""

from __future__ import annotations

import subprocess
import sys

import pytest

import workbench as wb
from workbench.plan import AXES, Axis, PlanInputs, layouts, plan, scale_layout


@pytest.fixture(scope="module")
def plan_8b():
    return plan("8b", hardware="h100", gpus=16, global_batch=64, seq_len=4096, max_micro_batches=8)


def test_every_layout_is_ranked_or_refused_with_a_reason(plan_8b):
    p = plan_8b
    enumerated = list(layouts(p.inputs))
    assert len(p.ranked) + len(p.refused) == len(enumerated) > 100
    # Every factorisation of 16 ranks into dp·cp·tp·pp was tried (cp while each rank keeps 2048 of the 4096 tokens).
    tried = {(c.choice["dp"], c.choice["cp"], c.choice["tp"], c.choice["pp"]) for c in (*p.ranked, *p.refused)}
    assert tried == {(16 // (t * q * k), k, t, q) for t in (1, 2, 4, 8, 16) for q in (1, 2, 4, 8, 16) for k in (1, 2)
                     if 16 % (t * q * k) == 0}
    for c in p.refused:
        if c.refused.startswith("invalid"):
            # The refusal is Config's own: making that Config raises the same message.
            with pytest.raises(wb.ConfigError) as e:
                wb.Config(model=p.inputs.model, batch_size=64, seq_len=4096, precision="bf16", **c.choice)
            assert c.refused == f"invalid: {e.value}"
        else:
            # Refused on its memory alone, its time never priced: the memory is the estimator's for that Config.
            assert c.refused.startswith("does not fit") and c.estimate is None and c.memory.total > 80e9
    too_big = [c for c in p.refused if c.memory is not None]
    for c in too_big[:: max(1, len(too_big) // 12)]:
        again = wb.estimate(c.config, "h100")
        assert again.memory == c.memory and not again.fits


def test_the_ranking_is_the_estimators_step_time_among_layouts_that_fit(plan_8b):
    p = plan_8b
    # Layouts with room for the allocator's fragments first, fastest first; then those that fit only as the
    # allocator gives back its cache ("tight"), fastest first: the best is never one of them while another fits.
    tight = [c.estimate.tight for c in p.ranked]
    assert tight == sorted(tight) and 0 < sum(tight) < len(tight)
    for group in (False, True):
        times = [c.step_time_s for c in p.ranked if c.estimate.tight == group]
        assert times == sorted(times)
    assert all(c.estimate.fits for c in p.ranked) and not p.best.estimate.tight
    assert min(c.step_time_s for c in p.ranked if c.estimate.tight) < p.best.step_time_s, "a tight one was faster"
    tight_row = p.rows(len(p.ranked))[tight.index(True)]
    assert tight_row["headroom"] == "tight" and "tight: only as the allocator gives back its cache" in p.table()
    best = p.best
    again = wb.estimate(best.config, "h100")  # an independent call: the plan ranked what estimate predicts
    assert again.step_time_s == best.step_time_s and again.memory.total <= 80e9
    # Nothing refused for memory would have been faster and fit: the best is the fastest that fits.
    assert all(c.estimate is None and c.memory.total > 80e9 for c in p.refused if c.memory is not None)


def test_the_plan_prints_its_top_layouts_and_why_others_were_refused(plan_8b):
    text = plan_8b.table(5)
    assert plan_8b.best.config.layout in text.splitlines()[2]
    assert len(plan_8b.rows(5)) == 5
    assert "refused: " in text and "does not fit" in text and "invalid (zero)" in text


def test_an_axis_is_one_entry():
    # How an axis joins the search (ep did so): one Axis whose values may depend on the degrees already chosen.
    inputs = PlanInputs(wb.ModelConfig.preset("tiny"), 4, 16, 128, "fp32", 8)
    base = list(layouts(inputs))
    extended = list(layouts(inputs, AXES + (Axis("seed", lambda c, p: range(c["dp"])),)))
    assert len(extended) == sum(c["dp"] for c in base)


def test_planning_imports_no_torch():
    code = "import sys, workbench as wb; wb.plan('1b', gpus=8, global_batch=32); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("world, expected, said", [
    (2, (1, 2, 1), ["dp 8→1", "pp 4→1", "tp 2 kept", "zero 3→0 (no dp ranks to shard across)"]),
    (4, (1, 2, 2), ["dp 8→1", "pp 4→2", "tp 2 kept", "zero 3→0 (no dp ranks to shard across)"]),
    (8, (1, 2, 4), ["dp 8→1", "pp 4 kept", "tp 2 kept", "zero 3→0 (no dp ranks to shard across)"]),
    (16, (2, 2, 4), ["dp 8→2", "pp 4 kept", "tp 2 kept"]),
])
def test_a_planned_layout_shrinks_dp_first_then_pp_then_tp(world, expected, said):
    big = wb.Config(model=wb.ModelConfig.preset("8b"), dp=8, tp=2, pp=4, zero=3, micro_batches=8, batch_size=64,
                    seq_len=4096, precision="bf16", activation_checkpointing="selective")
    local = wb.Config(batch_size=16)  # the notebook's tiny model
    scaled = scale_layout(big, world, local)
    cfg = scaled.config
    assert (cfg.dp, cfg.tp, cfg.pp) == expected and cfg.world_size == world
    assert cfg.model == local.model and cfg.activation_checkpointing == "selective" and cfg.precision == "bf16"
    assert list(scaled.changes) == said
    assert scaled.describe() == "; ".join(said)


def test_scaling_says_every_other_change_the_local_world_needs():
    # tiny has 2 key/value heads: tp 4 cannot stay; interleaved pp 2 needs micro-batches a multiple of pp.
    big = wb.Config(model=wb.ModelConfig.preset("8b"), dp=1, tp=4, pp=1, batch_size=8, seq_len=4096)
    scaled = scale_layout(big, 4, wb.Config(batch_size=5, seq_len=127))
    assert (scaled.config.dp, scaled.config.tp) == (2, 2)
    assert "tp 4→2" in scaled.changes and "batch_size 5→6 (divisible by dp·micro_batches)" in scaled.changes
    assert "seq_len 127→126 (a multiple of tp)" in scaled.changes
    pipe = wb.Config(model=wb.ModelConfig.preset("8b"), pp=4, schedule="interleaved_1f1b", micro_batches=4,
                     batch_size=8, seq_len=4096)
    scaled = scale_layout(pipe, 2, wb.Config())
    assert (scaled.config.pp, scaled.config.micro_batches) == (2, 4) and scaled.config.world_size == 2


def test_a_mixture_of_experts_is_planned_over_ep_too():
    moe = wb.ModelConfig.preset("tiny-moe")
    p = plan(moe, hardware="h100", gpus=8, global_batch=64, seq_len=256, max_micro_batches=2)
    tried = {(c.choice["dp"], c.choice["ep"]) for c in (*p.ranked, *p.refused)}
    # ep takes every divisor of dp that divides the experts: 4 experts on dp=8 → ep ∈ {1, 2, 4}.
    assert {(8, 1), (8, 2), (8, 4)} <= tried and all(dp % ep == 0 and moe.n_experts % ep == 0 for dp, ep in tried)
    assert any(c.config.ep > 1 for c in p.ranked)
    for c in p.ranked[::50]:  # the estimator sees each ep: experts split over more ranks leave fewer per rank
        assert c.estimate == wb.estimate(c.config, "h100", efficiency=p.efficiency)
    dense = plan("tiny", hardware="h100", gpus=8, global_batch=64, seq_len=256, max_micro_batches=2)
    assert {c.choice["ep"] for c in (*dense.ranked, *dense.refused)} == {1}


def test_ep_is_kept_as_far_as_the_local_dp_and_experts_allow():
    moe = wb.ModelConfig.preset("tiny-moe")
    planned = wb.Config(model=moe, dp=8, ep=4, zero=3, batch_size=64)
    scaled = scale_layout(planned, 2, wb.Config(model=moe, batch_size=8, seq_len=64))
    assert (scaled.config.dp, scaled.config.ep, scaled.config.zero) == (2, 2, 3)
    assert "ep 4→2" in scaled.describe()
    onto_dense = scale_layout(planned, 2, wb.Config(batch_size=8, seq_len=64))
    assert onto_dense.config.ep == 1 and "the local model is dense" in onto_dense.describe()


def test_the_published_layout_is_accepted_with_its_headroom():
    # torchtitan's Llama 3.1 8B run on 8 H100s (tests/test_published.py): FSDP 8, bf16 FSDP2 mixed precision, op
    # recomputation, local batch 2 × 8192. The plan keeps it among the layouts that fit, and says by how much.
    p = plan("8b", hardware="h100-96gb", gpus=8, global_batch=16, seq_len=8192, max_micro_batches=2)
    published = dict(dp=8, tp=1, pp=1, zero=3, mixed_precision="fsdp", activation_checkpointing="op",
                     micro_batches=1)
    (accepted,) = [c for c in p.ranked if all(getattr(c.config, k) == v for k, v in published.items())]
    assert 0 < accepted.estimate.headroom < 0.2 * 96e9
    row = p.rows(len(p.ranked))[p.ranked.index(accepted)]
    assert row["headroom"] == wb.hardware.si(accepted.estimate.headroom, "B") and row["bf16"] == "fsdp"
    # Refused for memory means does not fit by the same estimate: its device total over the 96 GB.
    assert all(c.memory.total > 96e9 for c in p.refused if c.refused.startswith("does not fit"))
