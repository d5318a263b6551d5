"""The direct reshard (each rank's pieces moved straight into the new layout), held to the full-state path's bar.

After every direct reshard the new layout exports bit for bit the full state
the old one exported (weights, optimizer state, loss scale, counters) — what
the full-state path would have imported — and the chain trains the losses of
one process training straight through (test_reshard's tolerances), so the
optimizer state is placed where its updates need it. Layouts the direct path
declines (host offload) take the full state, and say why. "Bit for bit" is
the tolerance: the direct path only copies bytes, it computes nothing.
"""

from __future__ import annotations

import dataclasses

import pytest

from workbench.config import Config
from workbench.engine.reshard_plan import Uncovered, overlap_boxes, plan_moves, runs_of, whole

from tests.engine import rank_fns as fns
from tests.engine.test_reshard import BASE, check_chain, plan


def test_runs_and_overlaps():
    assert runs_of([0, 1, 2, 6, 7, 3]) == ((0, 3), (6, 8), (3, 4))
    # rows 4..7 of an 8x4 tensor held whole, wanted by a rank holding rows {2, 3, 6, 7} (a strided shard)
    boxes = overlap_boxes(whole((8, 4)), (((2, 4), (6, 8)), ((0, 4),)))
    assert boxes == [(((2, 2), (0, 4)), ((0, 2), (0, 4))), (((6, 2), (0, 4)), ((2, 2), (0, 4)))]


def test_a_plan_copies_locally_where_it_can_and_spreads_the_rest_over_replicas():
    rows = lambda a, b: (((a, b),), ((0, 4),))  # noqa: E731
    # dp2 (both whole) → tp2 (rows split): each rank slices its own copy, nothing crosses.
    moves = plan_moves([{"w": whole((8, 4))}] * 2, [{"w": rows(0, 4)}, {"w": rows(4, 8)}])
    assert [(m.src, m.dst) for m in moves] == [(0, 0), (1, 1)]
    # tp2 → dp2: each rank keeps its half and receives the other.
    moves = plan_moves([{"w": rows(0, 4)}, {"w": rows(4, 8)}], [{"w": whole((8, 4))}] * 2)
    assert sorted((m.src, m.dst, m.dst_box) for m in moves) == [
        (0, 0, ((0, 4), (0, 4))), (0, 1, ((0, 4), (0, 4))), (1, 0, ((4, 4), (0, 4))), (1, 1, ((4, 4), (0, 4)))]
    # Three replicas, a fourth rank holding nothing: it takes from the replica its number picks.
    moves = plan_moves([{"w": whole((2, 2))}] * 3 + [{}], [{}, {}, {}, {"w": whole((2, 2))}])
    assert [(m.src, m.dst) for m in moves] == [(0, 3)]


def test_a_plan_refuses_pieces_that_do_not_make_up_the_whole():
    with pytest.raises(Uncovered, match="wants 32 elements"):
        plan_moves([{"w": (((0, 4),), ((0, 4),))}, {}], [{"w": whole((8, 4))}, {}])
    with pytest.raises(Uncovered, match="overlap"):
        plan_moves([{"w": (((0, 5),), )}, {"w": (((4, 8),), )}], [{"w": whole((8,))}, {}])


CHAIN = plan((dict(dp=2, zero=1), 2), (dict(tp=2), 1), (dict(cp=2, zero=3), 1), (dict(dp=2, zero=2, offload=True), 1),
             (dict(dp=2), 1), precision="fp16")
MOE = dataclasses.replace(BASE.model, n_experts=4, moe_every=2)
# SGD: its momentum_buffer moves by its parameter as AdamW's moments do (the state is carried generically).
MOE_CHAIN = [(BASE.replace(model=MOE, optimizer="sgd", **degrees), steps)
             for degrees, steps in ((dict(dp=2, zero=1), 2), (dict(dp=2, ep=2, zero=3), 1), (dict(tp=2), 1),
                                    (dict(dp=2, ep=2), 1))]
FOUR_RANK_CHAIN = plan((dict(dp=2, tp=2, zero=2), 2), (dict(pp=2, dp=2, zero=1, micro_batches=2), 1),
                       (dict(dp=4, zero=3, dp_replicate=2), 1), (dict(dp=2, tp=2, zero=3), 1))


def check_direct(results: list[dict], chain: list[tuple[Config, int]]) -> None:
    """As test_reshard's chains (losses against one process, every reshard exact), each reshard taking the direct
    path but into or out of host offload, where it says why it took the full state."""
    check_chain(results, chain)
    for path, (before, _), (cfg, _) in zip(results[0]["paths"], chain, chain[1:]):
        if before.offload or cfg.offload:
            assert path.startswith("full state (rank 0: host offload"), (cfg.layout, path)
        else:
            assert path == "direct", (cfg.layout, path)
    assert all(r["paths"] == results[0]["paths"] for r in results)


def test_direct_reshard_through_every_two_rank_layout(pool):
    """ZeRO-1's partitions (moments sent across), TP's DTensors (each rank slices its own copy), FSDP2's shards over
    cp, a host-offloaded layout (the full-state fallback) and DDP; fp16, so the loss scale moves. Pipeline stages:
    the four-rank chain."""
    check_direct(pool.run(fns.train_through_layouts, CHAIN, direct=True), CHAIN)


def test_direct_reshard_moves_expert_slices_and_sgd_momentum(pool):
    check_direct(pool.run(fns.train_through_layouts, MOE_CHAIN, direct=True), MOE_CHAIN)


@pytest.mark.slow
def test_direct_reshard_on_four_ranks_through_strided_shards_stages_and_hsdp(pool4):
    """dp2·tp2 under FSDP2 (_StridedShard: interleaved rows), dp×pp ZeRO-1, HSDP, and back."""
    check_direct(pool4.run(fns.train_through_layouts, FOUR_RANK_CHAIN, direct=True), FOUR_RANK_CHAIN)
