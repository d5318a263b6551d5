"""The flight recorder: each rank's ring of its last collectives, and the explanation of a desync from all of them.

The explanation is pure (synthetic rings here); the ring is checked over torch's in-process fake backend and,
once, end to end on the session pool's 2 ranks where one rank skips a collective on fresh groups (bounded by
their 3 s timeout; the world group is left alone).
"""

from __future__ import annotations

import pytest

from workbench.telemetry import flight
from workbench.telemetry.flight import Collective, RankRing

pytestmark = pytest.mark.mostly_waits  # make test runs it beside the tests that compute (tests/run_suite.py)

WORLD, DP, TP = "0", "3", "5"


def c(group: str, uid: str, op: str, seq: int, state: str = "done", nbytes: int = 1024, start: int = 0) -> Collective:
    return Collective(group, uid, op, seq, nbytes, 2, "gloo", start or seq * 10, 0 if state == "issued" else 1, state)


def ring(rank: int, *collectives: Collective, groups=((DP, (0, 1, 2)), (TP, (1, 2)))) -> RankRing:
    return RankRing(rank, tuple(collectives), tuple(groups))


def test_a_rank_that_skipped_a_collective_is_named_with_what_it_does_instead():
    rings = [
        ring(0, c("mesh_dp", DP, "all_reduce", 411), c("mesh_dp", DP, "all_reduce", 412, "issued", start=5000)),
        ring(1, c("mesh_dp", DP, "all_reduce", 411), c("mesh_tp", TP, "all_gather", 411, "issued", start=4000)),
        ring(2, c("mesh_dp", DP, "all_reduce", 411), c("mesh_dp", DP, "all_reduce", 412, "issued", start=5000),
             c("mesh_tp", TP, "all_gather", 411, start=3000)),
    ]
    text = flight.explain(rings)
    assert text.splitlines()[0] == ("ranks 0,2 wait in all_reduce #412 of the dp group; rank 1 has issued only up "
                                    "to #411 there, its last collective all_gather #411 of the tp group (waiting)")
    assert len(text.splitlines()) == 1, "the tp group agrees: #411 on both members"


def test_ranks_in_step_waiting_together_are_no_desync():
    rings = [ring(r, c("mesh_dp", DP, "all_reduce", 7, "issued"), groups=((DP, (0, 1)),)) for r in (0, 1)]
    text = flight.explain(rings)
    assert "no desync" in text and "ranks 0,1 wait in all_reduce #7 of the dp group" in text


def test_nothing_pending_says_so():
    assert "no collective is pending" in flight.explain([ring(0, c("default_pg", WORLD, "barrier", 3))])
    assert "no rank's ring" in flight.explain([])


def test_members_disagreeing_on_what_a_collective_is_are_shown_with_sizes():
    # gloo hangs (or on one rank succeeds) when members issue different ops or shapes as the same collective.
    rings = [ring(0, c("mesh_dp", DP, "all_reduce", 9, "issued", nbytes=4096), groups=((DP, (0, 1)),)),
             ring(1, c("mesh_dp", DP, "all_reduce", 9, "issued", nbytes=2048), groups=((DP, (0, 1)),))]
    assert flight.explain(rings) == ("the ranks of the dp group disagree on what #9 is: rank 0 all_reduce of 4096 B, "
                                     "rank 1 all_reduce of 2048 B")


def test_a_member_whose_ring_could_not_be_read_is_named():
    rings = [ring(0, c("mesh_dp", DP, "all_reduce", 2, "issued"), groups=((DP, (0, 1)),))]
    assert "rank 1 of the dp group: no ring read" in flight.explain(rings)


def test_labels_repeat_across_groups_so_groups_are_told_apart_by_uid():
    # dp2 x tp2 on 4 ranks: two dp groups, both "mesh_dp"; each is in step, so nothing disagrees.
    a, b = (("7", (0, 2)),), (("8", (1, 3)),)
    rings = [ring(r, c("mesh_dp", g[0][0], "all_reduce", seq), groups=g)
             for r, seq, g in ((0, 5, a), (2, 5, a), (1, 4, b), (3, 4, b))]
    assert "no collective is pending" in flight.explain(rings)


def test_a_group_with_point_to_point_traffic_is_not_compared_but_its_pending_transfers_are_shown():
    # Pipeline stages: sends and receives share the group's numbering, and stages issue them in different numbers.
    g = ((DP, (0, 1)),)
    rings = [ring(0, c("mesh_pp", DP, "send", 3), c("mesh_pp", DP, "all_reduce", 4, "issued"), groups=g),
             ring(1, c("mesh_pp", DP, "all_reduce", 1), c("mesh_pp", DP, "recv", 2, "issued"), groups=g)]
    assert flight.explain(rings) == (
        "flight recorder: the ranks agree on every group without point-to-point traffic (no desync found); "
        "rank 0 waits in all_reduce #4 of the pp group; rank 1 waits in recv #2 of the pp group: a slow rank or "
        "link, or a mismatch of sends and receives")
    assert [x.p2p for x in rings[1].collectives] == [False, True]
    assert c("mesh_pp", DP, "send+recv", 1).p2p and not c("mesh_pp", DP, "all_reduce+send", 1).p2p


def test_a_rank_behind_that_waits_in_a_transfer_says_so():
    rings = [ring(0, c("mesh_dp", DP, "all_reduce", 3, "issued"), groups=((DP, (0, 1)), ("9", (1, 2)))),
             ring(1, c("mesh_dp", DP, "all_reduce", 2), c("mesh_pp", "9", "recv", 7, "issued"),
                  groups=((DP, (0, 1)), ("9", (1, 2))))]
    assert flight.explain(rings).splitlines()[0] == (
        "rank 0 waits in all_reduce #3 of the dp group; rank 1 has issued only up to #2 there, its last operation "
        "recv #7 of the pp group (waiting)")


def test_the_compact_ring_keeps_every_groups_newest_entry():
    old = c("mesh_tp", TP, "all_gather", 1)
    rest = [c("mesh_dp", DP, "all_reduce", i) for i in range(1, 50)]
    compact = flight._compact(ring(0, old, *rest), last=8)
    assert compact.collectives == (old, *rest[-8:])
    assert flight.explain([compact]) == flight.explain([ring(0, old, *rest)])


def test_the_pools_explain_reads_the_rings_by_name_and_is_silent_without_them():
    r = ring(0, c("mesh_dp", DP, "all_reduce", 2, "issued"), groups=((DP, (0, 1)),))
    answers = {0: {flight.DIAGNOSTIC: flight.to_plain(r), "stack": "..."}, 1: {"stack": "..."}}
    assert flight.explain_diagnostics(answers) == flight.describe_hang([r])
    assert flight.explain_diagnostics({1: {"stack": "..."}}) is None


def test_a_member_whose_ring_let_a_completed_groups_entries_go_is_not_taken_for_a_desync():
    # Rank 1's ring is full of the dp group's traffic; the tp group's #411, done on rank 2, was done on rank 1 too.
    rings = [ring(1, *[c("mesh_dp", DP, "all_reduce", i) for i in range(5, 9)]),
             ring(2, c("mesh_tp", TP, "all_gather", 411), *[c("mesh_dp", DP, "all_reduce", i) for i in range(5, 9)]),
             ring(0, *[c("mesh_dp", DP, "all_reduce", i) for i in range(5, 9)])]
    assert flight.explain(rings) == "flight recorder: the ranks agree and no collective is pending"


def test_plain_data_round_trip():
    r = ring(1, c("mesh_dp", DP, "all_reduce", 3, "issued"))
    assert flight.from_plain(flight.to_plain(r)) == r


# --- the native ring, over torch's in-process fake backend ----------------------------------------------------


@pytest.fixture
def fake_group():
    from torch._C._distributed_c10d import FakeProcessGroup

    from workbench.telemetry import native

    ext = native.load()
    flight.set_capacity(8)
    yield ext.recording_backend(0, 2, FakeProcessGroup._create_internal(0, 2), None, "g")
    flight.set_capacity(256)


def test_the_ring_numbers_each_groups_collectives_and_keeps_the_last_few(fake_group):
    import torch

    for _ in range(10):
        fake_group.allreduce([torch.ones(4)]).wait()
    fake_group.send([torch.ones(3)], 1, 0).wait()  # fake works complete at once
    entries = flight.snapshot().collectives
    assert len(entries) == 8, "bounded: the ring keeps its capacity"
    assert [(e.seq, e.p2p) for e in entries] == [(i, False) for i in range(4, 11)] + [(11, True)]
    assert [(e.op, e.bytes, e.state, e.group_size) for e in entries[-2:]] == [
        ("all_reduce", 16, "done", 2), ("send", 12, "done", 2)]
    assert all(e.end_ns >= e.start_ns > 0 for e in entries)


def test_the_ring_is_kept_while_span_recording_is_off(fake_group):
    import torch

    from workbench.telemetry import native

    native.recorder().set_enabled(False)
    try:
        fake_group.broadcast([torch.ones(2)]).wait()
    finally:
        native.recorder().set_enabled(True)
    assert flight.snapshot().collectives[-1].op == "broadcast"


# --- end to end: one rank skips a collective ----------------------------------------------------------------


def test_a_skipped_collective_is_explained_from_both_rings_read_while_the_ranks_are_blocked(pool):
    from tests.telemetry import flight_rank_fns as fns

    results = pool.run(fns.skip_a_collective, 3.0)
    assert all("error" in r for r in results), "each blocked collective ended at the groups' 3 s timeout"
    rings = [r["ring"] for r in results]
    assert [ring["collectives"][-1][9] for ring in rings] == ["issued", "issued"], "read while still blocked"
    assert [r["after"][9] for r in results] == ["failed", "failed"], "the timeout marks each entry failed"
    text = flight.describe_hang(rings)
    assert ("rank 0 waits in all_reduce #2 of group flight_dp; rank 1 has issued only up to #1 there, its last "
            "collective all_gather #2 of group flight_tp (waiting)") in text, text
    assert ("rank 1 waits in all_gather #2 of group flight_tp; rank 0 has issued only up to #1 there, its last "
            "collective all_reduce #2 of group flight_dp (waiting)") in text, text
    # As the pool's hang report asks for it: each answering rank's diagnostic providers, by rank.
    assert flight.explain_diagnostics({r: {flight.DIAGNOSTIC: ring} for r, ring in enumerate(rings)}) == text
