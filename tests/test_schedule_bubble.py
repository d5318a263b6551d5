"""Each schedule's bubble formula against its own order placed in time (schedules/bubble.py's simulate)."""

from __future__ import annotations

import pytest

from workbench.schedules import (
    Action,
    Durations,
    bubble_formula,
    measured_durations,
    rank_orders,
    simulate,
    torch_rank_orders,
    virtual_stages,
)


# -- the bubble: each schedule's formula against its own order placed in time ------------------------------------
BALANCED = Durations.split(F=1.0, I=1.0, W=1.0)
"""F = I = W: the zero-bubble papers' own assumption, where every formula below is exact."""


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_formula_is_the_bubble_of_torchs_order_when_chunks_take_equal_time(schedule, pp):
    v = virtual_stages(schedule, pp, 2)
    for m in (2 * pp, 4 * pp):  # enough micro-batches for a steady state (DualPipeV needs 2·pp)
        timeline = simulate(torch_rank_orders(schedule, pp, m, v), BALANCED, v)
        # Every rank idles the same time, the formula's per-rank bubble.
        assert timeline.idle_per_rank == pytest.approx([bubble_formula(schedule, pp, BALANCED)] * pp), m
        assert timeline.makespan == pytest.approx(m * v * 3 + bubble_formula(schedule, pp, BALANCED))


def test_what_each_schedule_buys_at_equal_chunk_times():
    # In chunk times: 1F1B idles (p-1)(F+B) = 3(p-1) per rank; interleaving v stages makes chunks 1/v of a rank's
    # work; ZB1P and ZB-V fill all but (p-1)(F+B-2W) = (p-1) of it with weight gradients, a third of 1F1B's.
    # DualPipeV, its forward-backward pairs run one after the other (torch, one stream), idles twice that:
    # (2p/2-1)(F&B+B-3W) with F&B = F+B.
    pp = 4
    assert [bubble_formula(s, pp, BALANCED) for s in ("1f1b", "interleaved_zb", "zbv", "dualpipev")] == [9, 3, 3, 6]


@pytest.mark.parametrize("durations", [Durations(1.0, 2.0, 0, 0), Durations(1.0, 3.3, 0, 0), Durations(2.0, 1.0, 0, 0)])
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)])
def test_one_f_one_b_formula_holds_for_any_forward_and_backward_times(schedule, v, durations):
    for pp in (2, 4):
        timeline = simulate(rank_orders(schedule, pp, 2 * pp, v), durations, v)
        assert sum(timeline.idle_per_rank) / pp == pytest.approx(bubble_formula(schedule, pp, durations))


@pytest.mark.parametrize("F,I,W", [(1, 1.1, 0.9), (1, 1.3, 0.7), (1.2, 1, 1), (2, 3, 1)])
def test_zb1p_formula_holds_while_weight_gradients_take_no_longer_than_input_gradients(F, I, W):
    # (p-1)(F+B-2W) = (p-1)(F+I-W): with W > I there is more weight-gradient work than bubble to hide it in.
    d = Durations.split(F, I, W)
    for pp, v in ((2, 1), (4, 1), (4, 2)):
        timeline = simulate(rank_orders("interleaved_zb", pp, 4 * pp, v), d, v)
        assert sum(timeline.idle_per_rank) / pp == pytest.approx(bubble_formula("interleaved_zb", pp, d))


def test_simulate_holds_a_pairs_output_until_its_partner_is_done():
    # Rank 0 pairs the forward of micro-batch 1 with the backward of micro-batch 0, as DualPipeV pairs a forward
    # with a backward: torch sends the forward's output only once the backward is done, so 1F1 waits for 0B0.
    F, B = 1.0, 2.0
    orders = [[Action(0, "F", 0), Action(0, "F", 1, paired=True), Action(0, "B", 0), Action(0, "B", 1)],
              [Action(1, "F", 0), Action(1, "B", 0), Action(1, "F", 1), Action(1, "B", 1)]]
    spans = {str(a): (start, end) for row in simulate(orders, Durations(F, B, 0, 0)).spans for a, start, end in row}
    assert spans["1B0"] == (2.0, 4.0) and spans["0B0"] == (4.0, 6.0)
    assert spans["1F1"] == (6.0, 7.0)
    unpaired = [[Action(a.stage, a.kind, a.microbatch) for a in order] for order in orders]
    spans = {str(a): (start, end) for row in simulate(unpaired, Durations(F, B, 0, 0)).spans for a, start, end in row}
    assert spans["1F1"] == (4.0, 5.0)  # free to start once rank 1 is


def test_simulate_pays_a_transfer_on_every_hop_between_ranks():
    # 1F1B on 2 ranks, one micro-batch: the activation crosses once forward, its gradient once backward.
    F, B, t = 1.0, 2.0, 0.25
    orders = rank_orders("1f1b", 2, 1)
    spans = {str(a): (start, end) for row in simulate(orders, Durations(F, B, 0, 0), transfer=t).spans
             for a, start, end in row}
    assert spans["1F0"] == (F + t, 2 * F + t) and spans["1B0"] == (2 * F + t, 2 * F + t + B)
    assert spans["0B0"] == (2 * F + B + 2 * t, 2 * F + 2 * B + 2 * t)  # its own forward needs no hop
    assert simulate(orders, Durations(F, B, 0, 0), transfer=t).makespan == 2 * (F + B + t)


def test_simulate_refuses_a_deadlock():
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]], BALANCED)


def test_measured_durations_leave_out_the_first_stages_empty_split():
    # torch's first stage has no input gradient: its I is empty and its W does the whole backward.
    intervals = [(0, 0, 0, "F", 0, 10), (0, 0, 0, "I", 10, 11), (0, 0, 0, "W", 11, 41),
                 (1, 1, 0, "F", 0, 12), (1, 1, 0, "I", 20, 34), (1, 1, 0, "W", 34, 50)]
    d = measured_durations(intervals)
    assert d == Durations(F=11.0, B=30.0, I=14.0, W=16.0)
    assert measured_durations([(0, 1, 0, "F", 0, 4), (0, 1, 0, "B", 4, 12)]) == Durations(4.0, 8.0, 0.0, 0.0)
