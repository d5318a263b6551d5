"""Pipeline schedules as data: grids against hand-written ones, bubble arithmetic, measured grids."""

from __future__ import annotations

import random

import pytest

from workbench.config import Config, ConfigError, ModelConfig
from workbench.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    Action,
    ActionInterval,
    Grid,
    config_stages,
    ideal_bubble_fraction,
    measured_bubble,
    measured_grid,
    orders_from_torch,
    place,
    placement,
    rank_orders,
    schedule_grid,
    lighter_ends,
    rank_layers,
    split_layers,
    stage_rank,
    stages_of_rank,
    torch_rank_orders,
    virtual_stages,
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
    # ZB-V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (the V turns on rank 1, 1F → 2F with no send).
    # Backwards split: I (input gradient) is what the stage before waits for; W (weights) waits for its own I
    # only. Rank 0 idles at step 11: 0I1 needs the input gradient of stage 1, which 1I1 makes at step 11.
    ("zbv", 2, 2, 2): """
        rank   0   1   2   3   4   5   6   7   8   9  10  11  12  13
           0 0F0 0F1   . 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0   . 0I1 0W1
           1   . 1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1   .
    """,
    # ZB-H1 (interleaved zero bubble, one stage per rank): rank 1 runs its first weight gradient after its
    # second input gradient, so rank 0's 0I0 (which needs 1I0) need not wait behind a W.
    ("interleaved_zb", 2, 2, 1): """
        rank   0   1   2   3   4   5   6
           0 0F0 0F1   . 0I0 0W0 0I1 0W1
           1   . 1F0 1I0 1F1 1I1 1W0 1W1
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


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_action_runs_once_on_its_rank(schedule):
    pp, m = 4, 8
    v = virtual_stages(schedule, pp, 2)
    orders = rank_orders(schedule, pp, m, v)
    for rank, order in enumerate(orders):
        stages = stages_of_rank(rank, pp, v, placement(schedule))
        assert [stage_rank(s, pp, placement(schedule)) for s in stages] == [rank] * v
        # Every micro-batch once forward and once backward, the backward whole (B) or in two halves (I, W).
        forwards = sorted(a for a in order if a.kind == "F")
        assert forwards == sorted(Action(s, "F", i) for s in stages for i in range(m))
        for s in stages:
            for i in range(m):
                kinds = [a.kind for a in order if (a.stage, a.microbatch) == (s, i) and a.kind != "F"]
                assert kinds in (["B"], ["I", "W"]), (s, i, kinds)
                assert (schedule in SPLIT_BACKWARD) == (kinds == ["I", "W"]) or schedule == "dualpipev"


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
    (s, pp, m, v) for s in ("interleaved_1f1b", "interleaved_zb") for pp in (2, 4) for v in (1, 2, 3, 4)
    for m in (pp, 2 * pp, 3 * pp, 4 * pp)] + [
    ("zbv", pp, m, 2) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 12, 16)] + [
    ("dualpipev", pp, m, 2) for pp in (2, 3, 4, 8) for m in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp)]


def test_rank_orders_are_torchs():
    # One source of truth: torch's schedule objects. rank_orders is their torch-free copy for the kernel side.
    for shape in TORCH_SHAPES:
        ours, torchs = rank_orders(*shape), [list(o) for o in torch_rank_orders(*shape)]
        assert ours == torchs, shape
        # DualPipeV's forward-backward pairs, which torch sends only once both are done, are torch's too.
        assert [[a.paired for a in o] for o in ours] == [[a.paired for a in o] for o in torchs], shape
    assert any(a.paired for o in rank_orders("dualpipev", 2, 4, 2) for a in o)


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

    # Split backwards keep their micro-batch; an OVERLAP_F_B pair becomes its sub-actions, the first paired.
    pair = A(-1, "OVERLAP_F_B", None)
    pair.sub_actions = (A(0, "F", 0), A(1, "B", 3))
    split = orders_from_torch({0: [A(1, "I", 2), A(1, "W", 2), pair]})[0]
    assert split == [Action(1, "I", 2), Action(1, "W", 2), Action(0, "F", 0), Action(1, "B", 3)]
    assert [a.paired for a in split] == [False, False, True, False]


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule"):
        rank_orders("zb", 2, 4)
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        rank_orders("dualpipev", 2, 3)
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
    # V: rank r holds stages r and 2pp-1-r, so rank 0 holds the first and the last.
    assert [stages_of_rank(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [virtual_stages(s, 4, 3) for s in SCHEDULES] == [1, 1, 3, 3, 2, 2]
    assert virtual_stages("zbv", 1, 3) == 1
    with pytest.raises(ValueError, match="exactly 2"):
        stages_of_rank(0, 4, 3, "v")


def test_uneven_stages_cut_where_they_are_told():
    assert split_layers(6, 3, (1, 3, 2)) == [range(0, 1), range(1, 4), range(4, 6)]
    for bad in ((1, 3), (0, 3, 3), (1, 3, 3)):
        with pytest.raises(ValueError, match="summing"):
            split_layers(6, 3, bad)
    # torchtitan's split of Llama 3.1 405B: its 126 layers and the two ends weighed as a block each, 128 units.
    assert lighter_ends(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert lighter_ends(126, 16) == (7,) + (8,) * 14 + (7,)
    assert lighter_ends(32, 4, 0, 0) == (8, 8, 8, 8)
    with pytest.raises(ValueError):
        lighter_ends(4, 4)
    # A rank's blocks under loop placement: rank r holds stages r and r + pp.
    cfg = Config(pp=2, schedule="interleaved_1f1b", micro_batches=2, stage_layers=(1, 2, 2, 1),
                 model=ModelConfig(n_layers=6))
    assert rank_layers(cfg) == [(0, 3, 4), (1, 2, 5)]
    for bad, says in (((1, 2, 3), "3 counts for 4"), ((1, 2, 2, 2), "sum to model.n_layers=6")):
        with pytest.raises(ConfigError, match=r"stage_layers: .*" + says.replace("(", r"\(")):
            cfg.replace(stage_layers=bad)


# -- what the new schedules need of a Config ------------------------------------------------------------------
REFUSED = [
    (dict(pp=2, schedule="dualpipev", micro_batches=2), "micro_batches", "set micro_batches ≥ 4"),
    (dict(pp=2, schedule="interleaved_zb", micro_batches=3, batch_size=12), "micro_batches", "multiple of 2"),
    (dict(pp=3, schedule="zbv", micro_batches=3, batch_size=12), "pp", "choose pp among [2]"),
    (dict(pp=2, dp=2, zero=3, schedule="zbv", micro_batches=2), "zero", "use zero=2"),
    (dict(pp=2, dp=2, zero=1, schedule="interleaved_zb", micro_batches=2), "zero", "zero=0 (replicate) or zero=2"),
    (dict(pp=2, dp=2, schedule="dualpipev", micro_batches=4, compression="powersgd"), "compression", "zero=2"),
    (dict(pp=2, dp=2, schedule="zbv", micro_batches=2, offload=True), "offload", "zero=2 with offload"),
    (dict(model=ModelConfig.preset("tiny-moe"), pp=2, dp=2, ep=2, schedule="zbv", micro_batches=2), "ep", "zero=2"),
    (dict(pp=2, schedule="zbv", micro_batches=2, compile=True), "compile", "compile=False"),
]


@pytest.mark.parametrize("changes,field,fix", REFUSED, ids=lambda x: x if isinstance(x, str) else None)
def test_new_schedules_refuse_what_they_cannot_run_naming_the_field_and_fix(changes, field, fix):
    with pytest.raises(ConfigError) as refused:
        Config(**{"batch_size": 8, "seq_len": 32, **changes})
    assert str(refused.value).startswith(f"{field}: ") and fix in str(refused.value)


def test_new_schedules_accept_what_they_run():
    for changes in (dict(pp=2, schedule="zbv", micro_batches=1),
                    dict(pp=2, dp=2, zero=0, schedule="zbv", micro_batches=2),
                    dict(pp=2, dp=2, zero=2, schedule="dualpipev", micro_batches=4, compression="bf16"),
                    dict(pp=2, schedule="interleaved_zb", stages_per_rank=1, micro_batches=2),
                    dict(pp=2, schedule="zbv", stages_per_rank=4, micro_batches=2)):  # V ignores stages_per_rank
        cfg = Config(batch_size=8, seq_len=32, **changes)
        assert config_stages(cfg) == (2 if cfg.schedule != "interleaved_zb" else cfg.stages_per_rank)
