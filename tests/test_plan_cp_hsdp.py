"""Context parallel and HSDP in `wb.plan`'s search and in `scale_layout` (pure arithmetic, no processes)."""

from __future__ import annotations

import pytest

import workbench as wb
from workbench.plan import PlanInputs, layouts, plan, scale_layout

MODEL = wb.ModelConfig.preset("8b")


@pytest.fixture(scope="module")
def plan_16():
    return plan(MODEL, hardware="h100", gpus=16, global_batch=32, seq_len=8192)


def test_cp_is_searched_while_each_rank_keeps_enough_of_a_sequence(plan_16):
    tried = {c.choice["cp"] for c in (*plan_16.ranked, *plan_16.refused)}
    assert tried == {1, 2, 4}  # 8192 tokens: 4096 and 2048 per rank; cp 8 would leave 1024 < min_cp_tokens
    shorter = PlanInputs(MODEL, 16, 32, 2048, "bf16", 32)
    assert {c["cp"] for c in layouts(shorter)} == {1}
    assert {c["cp"] for c in layouts(PlanInputs(MODEL, 16, 32, 2048, "bf16", 32, min_cp_tokens=512))} == {1, 2, 4}
    for c in plan_16.ranked:  # every valid cp layout is ranked by its own estimate; its world is dp·cp·tp·pp
        assert c.config.world_size == 16 and c.config.cp == c.choice["cp"]
    assert any(c.config.cp > 1 for c in plan_16.ranked)


def test_hsdp_is_searched_with_one_shard_group_per_node(plan_16):
    hsdp = [c for c in (*plan_16.ranked, *plan_16.refused) if c.choice["dp_replicate"] > 1]
    assert hsdp and all(c.choice["zero"] >= 2 for c in hsdp)
    for c in hsdp:
        ch = c.choice
        shard = ch["dp"] // ch["dp_replicate"]
        assert shard * ch["cp"] * ch["tp"] == 8  # the shard group and the tp·cp ranks inside it fill one node
    on_4 = PlanInputs(MODEL, 16, 32, 8192, "bf16", 32, gpus_per_node=4)
    assert {c["dp_replicate"] for c in layouts(on_4) if c["tp"] == c["cp"] == c["pp"] == 1 and c["zero"] == 3} \
        == {1, 4}
    text = plan_16.table(20)
    assert "cp" in text.splitlines()[1].split()


def test_bad_search_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="gpus_per_node"):
        plan(MODEL, gpus=8, gpus_per_node=0)
    with pytest.raises(ValueError, match="min_cp_tokens"):
        plan(MODEL, gpus=8, min_cp_tokens=1.5)


BIG = wb.Config(model=MODEL, dp=16, cp=4, tp=2, zero=3, dp_replicate=4, batch_size=64, seq_len=8192,
                precision="bf16")


@pytest.mark.parametrize("world, degrees, said", [
    (2, (1, 1, 2), ["dp 16→1", "cp 4→1", "pp 1 kept", "tp 2 kept", "zero 3→0 (no dp ranks to shard across)",
                    "dp_replicate 4→1 (zero=0 replicates everything)"]),
    (8, (1, 4, 2), ["dp 16→1", "cp 4 kept", "pp 1 kept", "tp 2 kept",
                    "dp_replicate 4→1 (dp=1: every replica group needs ≥ 2 ranks to shard over)",
                    "seq_len 200→192 (a multiple of 2·cp·tp = 16)"]),
    (32, (4, 4, 2), ["dp 16→4", "cp 4 kept", "pp 1 kept", "tp 2 kept",
                     "dp_replicate 4→2 (dp=4: every replica group needs ≥ 2 ranks to shard over)",
                     "seq_len 200→192 (a multiple of 2·cp·tp = 16)"]),
])
def test_a_planned_cp_and_hsdp_layout_keeps_tp_then_cp_then_pp(world, degrees, said):
    scaled = scale_layout(BIG, world, wb.Config(batch_size=16, seq_len=200))
    cfg = scaled.config
    assert (cfg.dp, cfg.cp, cfg.tp) == degrees and cfg.world_size == world
    assert list(scaled.changes) == said


def test_hsdp_is_kept_where_the_local_dp_allows_and_cp_leaves_a_mixture_of_experts():
    hsdp = wb.Config(model=MODEL, dp=8, zero=3, dp_replicate=2, batch_size=64, seq_len=4096)
    kept = scale_layout(hsdp, 4, wb.Config(batch_size=16))
    assert (kept.config.dp, kept.config.dp_replicate, kept.config.hsdp) == (4, 2, True)
    assert not any("dp_replicate" in change for change in kept.changes)
    moe = scale_layout(BIG, 4, wb.Config(model=wb.ModelConfig.preset("tiny-moe"), batch_size=16))
    assert moe.config.cp == 1 and "cp 4→1 (a mixture of experts routes whole sequences)" in moe.changes
