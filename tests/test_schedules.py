"""Pipeline schedules as data: grids against hand-written ones, bubble arithmetic, measured grids."""

from __future__ import annotations

import random

import pytest

from workbench.schedules import (
    Action,
    ActionInterval,
    Grid,
    ideal_bubble_fraction,
    measured_bubble,
    measured_grid,
    orders_from_torch,
    place,
    rank_orders,
    schedule_grid,
    split_layers,
    stages_of_rank,
    torch_rank_orders,
)

# Written out by hand from the dependency rules: F of stage s needs F of s-1 one step
# earlier, B of stage s needs B of s+1 and its own F; one action per rank per step.
EXPECTED = {
    ("gpipe", 2, 3, 1): """
        rank   0   1   2   3   4   5   6   7
           0 0F0 0F1 0F2   .   . 0B0 0B1 0B2
           1   . 1F0 1F1 1F2 1B0 1B1 1B2   .
    """,
    # Rank 0 idles at step 2: its next action, B0, waits for rank 1's B0.
    ("1f1b", 2, 4, 1): """
        rank   0   1   2   3   4   5   6   7   8   9
           0 0F0 0F1   . 0B0 0F2 0B1 0F3 0B2   . 0B3
           1   . 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3   .
    """,
    ("1f1b", 3, 3, 1): """
        rank   0   1   2   3   4   5   6   7   8   9
           0 0F0 0F1 0F2   .   . 0B0   . 0B1   . 0B2
           1   . 1F0 1F1   . 1B0 1F2 1B1   . 1B2   .
           2   .   . 2F0 2B0 2F1 2B1 2F2 2B2   .   .
    """,
    # Rank 0 holds stages 0 and 2, rank 1 holds 1 and 3; micro-batches go round in rounds of pp=2.
    ("interleaved_1f1b", 2, 4, 2): """
        rank   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17
           0 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1   . 2B2   . 2B3 0B2 0B3
           1   . 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3   .
    """,
    ("interleaved_1f1b", 2, 2, 2): """
        rank   0   1   2   3   4   5   6   7   8   9
           0 0F0 0F1 2F0 2F1   . 2B0   . 2B1 0B0 0B1
           1   . 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1   .
    """,
}


@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda c: "{}-p{}-m{}-v{}".format(*c))
def test_grid_equals_hand_written(case):
    expected = Grid.parse(EXPECTED[case])
    grid = schedule_grid(*case)
    assert grid == expected, f"\n{grid}\n!=\n{expected}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 12, 4), (8, 16, 2)])
def test_grid_bubble_is_the_formula(schedule, pp, m, v):
    v = v if schedule == "interleaved_1f1b" else 1
    grid = schedule_grid(schedule, pp, m, v)
    assert grid.bubble_fraction == pytest.approx(ideal_bubble_fraction(pp, m, v))
    assert grid.steps == 2 * (v * m + pp - 1)


def test_ideal_bubble_fraction():
    assert ideal_bubble_fraction(1, 8) == 0.0
    assert ideal_bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert ideal_bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert ideal_bubble_fraction(4, 8, stages_per_rank=2) == pytest.approx(3 / 19)
    # More micro-batches or more stages per rank shrink the bubble.
    assert ideal_bubble_fraction(4, 16) < ideal_bubble_fraction(4, 8)
    assert ideal_bubble_fraction(4, 8, 2) < ideal_bubble_fraction(4, 8, 1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_every_action_runs_once_on_its_rank(schedule):
    pp, m, v = 4, 8, 2 if schedule == "interleaved_1f1b" else 1
    orders = rank_orders(schedule, pp, m, v)
    for rank, order in enumerate(orders):
        stages = [rank + k * pp for k in range(v)]
        assert sorted(order) == sorted(Action(s, k, i) for s in stages for k in "FB" for i in range(m))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 9)])
def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_in_flight(pp, m):
    # What 1F1B buys over GPipe: activations of at most pp - rank micro-batches, not m.
    for rank, order in enumerate(rank_orders("1f1b", pp, m)):
        in_flight = peak = 0
        for action in order:
            in_flight += 1 if action.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(m, pp - rank)
    assert max(len([a for a in o if a.kind == "F"]) for o in rank_orders("gpipe", pp, m)) == m


def test_grid_prints_and_parses_back():
    grid = schedule_grid("interleaved_1f1b", 4, 8, 2)
    text = str(grid)
    assert text.splitlines()[1].split()[:3] == ["0", "0F0", "0F1"]
    assert Grid.parse(text) == grid
    assert str(Action(3, "B", 12)) == "3B12" and Action.parse("3B12") == Action(3, "B", 12)
    with pytest.raises(ValueError):
        Action.parse("3X1")


def test_grid_orders_drop_idle_cells():
    grid = schedule_grid("1f1b", 2, 4)
    assert grid.orders() == rank_orders("1f1b", 2, 4)


def test_place_refuses_a_deadlock():
    # Rank 1 wants B0 of stage 1 before stage 1 has seen F0: nothing can ever run.
    with pytest.raises(ValueError, match="deadlock"):
        place([[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]])


TORCH_SHAPES = [(s, pp, m, 1) for s in ("gpipe", "1f1b") for pp in (2, 3, 4, 8) for m in (1, 2, 4, 5, 8, 16)
                if s == "gpipe" or m >= pp] + [
    ("interleaved_1f1b", pp, m, v) for pp in (2, 4) for v in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp, 4 * pp)]


def test_rank_orders_are_torchs():
    # One source of truth: torch's schedule objects. rank_orders is their torch-free copy for the kernel side.
    for shape in TORCH_SHAPES:
        assert rank_orders(*shape) == [list(o) for o in torch_rank_orders(*shape)], shape


def test_torch_orders_are_read_from_its_ir_as_it_runs():
    # Idle steps and the actions the grid does not draw are skipped; micro-batches numbered per stage and kind
    # (torch 2.13's 1F1B IR numbers the last rank's forwards from 1, though it runs them from 0).
    class Kind:  # what torch's _ComputationType is: a str enum with a value
        def __init__(self, value):
            self.value = value

    class A:
        def __init__(self, stage, kind, mb):
            self.stage_index, self.computation_type, self.microbatch_index = stage, Kind(kind), mb

    ir = {1: [None, A(1, "F", 1), A(1, "B", 0), A(1, "REDUCE_GRAD", None), A(1, "F", 2)],
          0: [A(0, "F", 0), A(0, "SEND_F", 0), A(0, "F", 1)]}
    assert orders_from_torch(ir) == [[Action(0, "F", 0), Action(0, "F", 1)],
                                     [Action(1, "F", 0), Action(1, "B", 0), Action(1, "F", 1)]]


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule"):
        rank_orders("zb", 2, 4)
    with pytest.raises(ValueError, match="unknown schedule"):
        torch_rank_orders("zb", 2, 4)


def _intervals_from_grid(grid: Grid, step_ns: int, busy_ns: int) -> list[ActionInterval]:
    return [ActionInterval(rank, a.stage, a.microbatch, a.kind, t * step_ns, t * step_ns + busy_ns)
            for rank, row in enumerate(grid.rows) for t, a in enumerate(row) if a is not None]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_measured_grid_of_an_ideal_run_is_the_ideal_grid(case):
    grid = schedule_grid(*case)
    intervals = _intervals_from_grid(grid, step_ns=1000, busy_ns=1000)
    random.Random(0).shuffle(intervals)
    assert measured_grid(intervals) == grid
    bubble = measured_bubble(intervals)
    assert bubble.fraction == pytest.approx(grid.bubble_fraction)
    assert bubble.window_ns == grid.steps * 1000


def test_measured_bubble_counts_time_not_steps():
    # Two ranks, window 0..100 ns. Rank 0 busy 0-40 and (overlapping) 30-60: 60 ns busy.
    # Rank 1 busy 50-100: 50 ns busy.
    intervals = [(0, 0, 0, "F", 0, 40), (0, 0, 1, "F", 30, 60), (1, 1, 0, "F", 50, 100)]
    bubble = measured_bubble(intervals)
    assert bubble.window_ns == 100
    assert bubble.per_rank == pytest.approx((0.4, 0.5))
    assert bubble.fraction == pytest.approx(0.45)


def test_measured_grid_shows_a_different_order():
    # A rank that ran its backwards in reverse order: the measured grid says so, cell by cell.
    grid = schedule_grid("gpipe", 2, 2)
    intervals = _intervals_from_grid(grid, 10, 10)
    swapped = [iv._replace(microbatch=1 - iv.microbatch) if (iv.rank, iv.kind) == (0, "B") else iv
               for iv in intervals]
    measured = measured_grid(swapped)
    assert measured != grid
    assert [str(a) for a in measured.orders()[0]] == ["0F0", "0F1", "0B1", "0B0"]


def test_measured_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        measured_bubble([])


# -- layout: how the model is cut ----------------------------------------------------------------------
def test_split_layers_and_placement():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="divide"):
        split_layers(6, 4)
    assert stages_of_rank(1, pp=4, stages_per_rank=3) == [1, 5, 9]
