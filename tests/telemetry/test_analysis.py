"""The pure-Python telemetry arithmetic against hand-computed values and an independent reference.

The interval cases run against the product (`workbench.telemetry.analysis`, the one implementation: ranks and
the notebook both use it) and against the reference written another way (tests/telemetry/overlap_reference.py);
random sets hold the two equal.
"""

from __future__ import annotations

import math
import random

import pytest

from tests.telemetry import overlap_reference as reference
from workbench.telemetry import analysis
from workbench.telemetry.events import Interval

# (spans, merged, union length), worked out by hand.
UNION_CASES = [
    ([], [], 0),
    ([(3, 3)], [], 0),
    ([(0, 10), (5, 15), (20, 25)], [(0, 15), (20, 25)], 20),
    ([(0, 5), (5, 9)], [(0, 9)], 9),  # touching spans join
    ([(0, 100), (10, 20), (30, 40)], [(0, 100)], 100),  # nested
    ([(20, 30), (0, 10), (8, 12)], [(0, 12), (20, 30)], 22),  # unsorted input
]

# (a, b, a ∩ b)
INTERSECTION_CASES = [
    ([(0, 10), (20, 30)], [(5, 25)], [(5, 10), (20, 25)]),
    ([(20, 30), (0, 10), (8, 12)], [(11, 21), (29, 50)], [(11, 12), (20, 21), (29, 30)]),
    ([(0, 10)], [(10, 20)], []),  # touching is not overlapping
    ([(0, 10)], [], []),
]

# (compute, comm, (comm_ns, exposed_ns, overlapped_ns))
OVERLAP_CASES = [
    # comm = [80,160) ∪ [190,250) = 140; under compute: [80,100) + [150,160) + [190,200) = 40
    ([(0, 100), (150, 200)], [(80, 160), (190, 250)], (140, 100, 40)),
    # comm entirely hidden behind compute; its two spans overlap each other
    ([(0, 100)], [(10, 20), (15, 30)], (20, 0, 20)),
    # nothing runs alongside
    ([(0, 10)], [(10, 30)], (20, 20, 0)),
    # no communication at all
    ([(0, 10)], [], (0, 0, 0)),
]


IMPLS = [pytest.param(analysis, id="product"), pytest.param(reference, id="reference")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("spans", "merged", "length"), UNION_CASES)
def test_merge_and_union_length(impl, spans, merged, length):
    assert impl.merge(spans) == merged
    assert impl.covered_ns(spans) == length


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("a", "b", "expected"), INTERSECTION_CASES)
def test_intersection(impl, a, b, expected):
    assert impl.intersection(a, b) == expected
    assert impl.intersection(b, a) == expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("compute", "comm", "expected"), OVERLAP_CASES)
def test_step_overlap_ns(impl, compute, comm, expected):
    assert impl.step_overlap_ns(compute, comm) == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_inverted_span_is_refused(impl):
    with pytest.raises(ValueError, match="ends before it starts"):
        impl.covered_ns([(10, 5)])
    with pytest.raises(ValueError, match=r"\[10, 5\)"):
        impl.merge([(0, 3), (10, 5)])


def _iv(kind, start, end):
    return Interval(kind=kind, name="x", start_ns=start, end_ns=end)


@pytest.mark.parametrize("impl", IMPLS)
def test_step_summary_in_seconds_with_overlap_ratio(impl):
    ivs = [_iv("compute", 0, 100), _iv("compute", 150, 200), _iv("comm", 80, 160), _iv("comm", 190, 250)]
    comm_s, exposed_s, overlap = impl.step_summary(ivs)
    assert comm_s == pytest.approx(140e-9, rel=1e-12)
    assert exposed_s == pytest.approx(100e-9, rel=1e-12)
    assert overlap == 40 / 140


@pytest.mark.parametrize("impl", IMPLS)
def test_step_summary_without_communication_has_no_overlap(impl):
    assert impl.step_summary([_iv("compute", 0, 10)]) == (0.0, 0.0, None)
    assert impl.step_summary([]) == (0.0, 0.0, None)


def _random_spans(rng: random.Random) -> list[tuple[int, int]]:
    out = []
    for _ in range(rng.randint(0, 12)):
        s = rng.randint(0, 10_000)
        out.append((s, s + rng.randint(0, 2_000)))
    return out


def test_product_equals_reference_on_random_sets():
    rng = random.Random(1234)
    for _ in range(300):
        a, b, waits = _random_spans(rng), _random_spans(rng), _random_spans(rng)
        assert analysis.merge(a) == reference.merge(a)
        assert analysis.covered_ns(a) == reference.covered_ns(a)
        assert analysis.intersection(a, b) == reference.intersection(a, b)
        assert analysis.step_overlap_ns(a, b) == reference.step_overlap_ns(a, b)
        ivs = ([_iv("compute", *s) for s in a] + [_iv("comm", *s) for s in b] + [_iv("wait", *s) for s in waits])
        assert analysis.step_summary(ivs) == reference.step_summary(ivs)


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 2 * 7 / 8),
        ("all_gather", 4, 3 / 4),
        ("reduce_scatter", 4, 3 / 4),
        ("all_to_all", 8, 7 / 8),
        ("broadcast", 8, 1.0),
        ("reduce", 8, 1.0),
        ("send", 2, 1.0),
        ("recv", 2, 1.0),
        ("send+recv", 2, 1.0),
        ("all_reduce", 1, 0.0),  # one rank moves nothing over a bus
    ],
)
def test_bus_factor_follows_nccl_tests(op, n, factor):
    assert analysis.bus_factor(op, n) == pytest.approx(factor, rel=1e-15)


def test_bus_factor_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="barrier"):
        analysis.bus_factor("barrier", 2)
    with pytest.raises(ValueError, match="different bus factors"):
        analysis.bus_factor("all_reduce+send", 4)


def test_bandwidth_of_a_recorded_all_reduce():
    # 1 GB all_reduce in 0.5 s among 4 ranks: algbw 2 GB/s, busbw 2 * 2*3/4 = 3 GB/s
    iv = Interval("comm", "all_reduce", 0, 500_000_000, bytes=10**9, group_size=4)
    alg, bus = analysis.interval_bandwidth(iv)
    assert alg == pytest.approx(2e9)
    assert bus == pytest.approx(3e9)
    with pytest.raises(ValueError, match="positive"):
        analysis.algbw(10, 0.0)
    assert math.isclose(analysis.busbw("all_gather", 4_000, 1e-6, 2), 2e9)
