"""Where an emulated collective's time went (workbench.emulation.arrivals), on hand-made records of two ranks: the
wait for the last peer, the paced transfer after it, and the skew the ranks' own compute accounts for; and the
pipeline prediction's hop, which no rank can receive before it is free (schedules.simulate)."""

from __future__ import annotations

import pytest

from workbench.config import Config, ModelConfig
from workbench.emulation import Cluster
from workbench.emulation.arrivals import compute_behind, match, split_exposed
from workbench.emulation.predict import bubble_at_measured_compute, predicted
from workbench.schedules import Action, ActionInterval, Durations, measured_bubble, rank_orders, simulate
from workbench.telemetry.events import Interval

MS = 1_000_000


def _comm(name: str, start: int, end: int, nbytes: int = 1024, group: str = "mesh_dp") -> Interval:
    return Interval("comm", name, start * MS, end * MS, bytes=nbytes, group_size=2, group=group)


def _compute(name: str, start: int, end: int) -> Interval:
    return Interval("compute", name, start * MS, end * MS)


# Rank 1 computes the same forward 4 ms longer; the all-reduce both then issue completes 10 ms after rank 1 arrives.
RANK0 = (_compute("forward", 0, 10), _comm("all_reduce", 10, 24), Interval("wait", "wait", 10 * MS, 24 * MS),
         _compute("optimizer", 24, 26))
RANK1 = (_compute("forward", 0, 14), _comm("all_reduce", 14, 24), Interval("wait", "wait", 14 * MS, 24 * MS),
         _compute("optimizer", 24, 26))


def test_a_collective_is_matched_across_ranks_and_split_at_its_last_arrival():
    (arrival,) = match([RANK0, RANK1])
    assert arrival.last_ns == 14 * MS and arrival.skew_s == pytest.approx(4e-3)
    assert arrival.transfer_s == pytest.approx(10e-3)
    early, late = split_exposed(RANK0, [arrival], 0), split_exposed(RANK1, [arrival], 1)
    assert (early.exposed_s, early.waiting_s, early.transfer_s) == pytest.approx((14e-3, 4e-3, 10e-3))
    assert (late.waiting_s, late.transfer_s) == pytest.approx((0.0, 10e-3))
    # The skew is the late rank's longer forward: the ranks computed the same work at different speeds.
    assert compute_behind([RANK0, RANK1], [arrival]) == pytest.approx(4e-3)


def test_a_send_is_matched_with_the_peers_receive_and_a_late_wait_does_not_stretch_the_transfer():
    # Rank 0 sends at 2 ms and waits on it only at 30 ms (its record ends then); rank 1 posts the receive at 10.
    rank0 = (_comm("send", 2, 30, group="mesh_pp"), _compute("0F1", 2, 29))
    rank1 = (_comm("recv", 10, 17, group="mesh_pp"), Interval("wait", "wait", 10 * MS, 17 * MS))
    (arrival,) = match([rank0, rank1])
    assert arrival.name == "send" and arrival.last_ns == 10 * MS
    assert arrival.transfer_s == pytest.approx(7e-3)  # from the receive's post to the first completion seen
    assert split_exposed(rank1, [arrival], 1).transfer_s == pytest.approx(7e-3)
    assert split_exposed(rank0, [arrival], 0).exposed_s == pytest.approx(1e-3)  # computing meanwhile, but 29-30


def test_groups_whose_ranks_disagree_are_left_out_and_count_as_transfer():
    extra = RANK1 + (_comm("all_gather", 30, 35),)
    assert match([RANK0, extra]) == []  # two records against one: their order says nothing
    split = split_exposed(RANK0, [], 0)
    assert (split.waiting_s, split.transfer_s) == pytest.approx((0.0, 14e-3))


def test_a_transfer_into_a_busy_rank_starts_once_it_is_free():
    """torch's 1F1B posts a stage's receive after its previous action (batched with its send): the hop cannot hide
    behind that action, so with receive_when_free each hop into a busy rank adds its whole time."""
    orders = rank_orders("1f1b", 2, 4)
    d = Durations.split(1.0, 1.0, 1.0)
    hidden, exposed = simulate(orders, d, transfer=0.5), simulate(orders, d, transfer=0.5, receive_when_free=True)
    assert exposed.makespan > hidden.makespan
    # Rank 1's second forward needs rank 0's 0F1, done at t=2 while rank 1 runs 1F0 and 1B0 (t=1.5..4.5): the
    # transfer starts at 4.5, not 2.
    start = {a: s for a, s, _ in exposed.spans[1]}
    assert start[Action(1, "F", 1)] == pytest.approx(5.0)
    assert {a: s for a, s, _ in hidden.spans[1]}[Action(1, "F", 1)] == pytest.approx(4.5)


def test_the_pipeline_at_the_estimates_own_compute_is_the_predicted_bubble():
    """Fed actions that take exactly the estimate's durations, the schedule run with the measured compute gives
    the prediction's bubble: the two differ only by the compute put in."""
    cfg = Config(model=ModelConfig(dim=64, n_layers=2, n_heads=2), batch_size=8, seq_len=64, pp=2,
                 micro_batches=4, schedule="1f1b")
    topology = Cluster("h100-ib", nodes=2).for_world(2).topology
    from workbench.emulation.predict import _estimate, _optimizer_s

    stages = _estimate(cfg, topology).stages
    per_action = [(s.compute_s - _optimizer_s(s)) / cfg.micro_batches for s in stages]
    dilation = 500.0
    actions, ns = [], lambda s: int(s * dilation * 1e9)
    for r in range(2):
        clock = 0
        for a in rank_orders("1f1b", 2, 4)[r]:
            took = ns(per_action[r] / 3 * (1 if a.kind == "F" else 2))
            actions.append(ActionInterval(r, a.stage, a.microbatch, a.kind, clock, clock + took))
            clock += took
    at_measured = bubble_at_measured_compute(cfg, actions, topology, dilation)
    assert at_measured == pytest.approx(predicted(cfg, topology).bubble, rel=1e-6)
    assert measured_bubble(actions).fraction < at_measured  # these records ran back to back: no pipeline in them
