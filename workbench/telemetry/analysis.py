"""Pure functions over telemetry records: the interval arithmetic behind overlap, and bandwidth.

Overlap is a sweep over merged intervals: the fraction of communication time during which computation also
runs (the HolisticTraceAnalysis definition). This module is its one implementation: ranks call `step_summary`
at each step's end (telemetry/probes.py), and the notebook side reads compute and exposed time with the same
functions (emulation/predict.py, emulation/arrivals.py), so it has to be plain Python: the notebook never
imports torch, which the compiled extension needs. The independent check it is held to is written another way
(a sweep over span boundaries) with the tests: tests/telemetry/overlap_reference.py.

Spans are half-open ``(start_ns, end_ns)`` on one rank's monotonic clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from workbench.telemetry.events import Interval

Span = tuple[int, int]


def merge(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering exactly the instants of ``spans`` (empty ones vanish).

    A span ending before it starts is a caller's bug: refused, naming it."""
    out: list[Span] = []
    lo = hi = None
    for start, end in sorted(spans):
        if end <= start:
            if end < start:
                raise ValueError(f"interval ends before it starts: [{start}, {end})")
            continue
        # Touching spans join: no instant lies between [0, 5) and [5, 9).
        if hi is not None and start <= hi:
            if end > hi:
                hi = end
        else:
            if hi is not None:
                out.append((lo, hi))
            lo, hi = start, end
    if hi is not None:
        out.append((lo, hi))
    return out


def covered_ns(spans: Iterable[Span]) -> int:
    """How long ``spans`` cover, each instant once (overlaps counted once)."""
    return sum(end - start for start, end in merge(spans))


def intersection(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Instants covered by both sets, as merged spans."""
    x, y = merge(a), merge(b)
    out: list[Span] = []
    i = j = 0
    # Both lists are sorted and disjoint, so one sweep visits every pair that can meet: advance whichever span
    # ends first, since the other may still meet the next one.
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if lo < hi:
            out.append((lo, hi))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """The parts of the union of ``a`` not covered by ``b``, merged and sorted."""
    out: list[Span] = []
    holes = merge(b)
    for start, end in merge(a):
        for h_start, h_end in holes:
            if h_end <= start or h_start >= end:
                continue
            if h_start > start:
                out.append((start, h_start))
            start = max(start, h_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def split_kinds(intervals: Iterable[Interval]) -> tuple[list[Span], list[Span]]:
    """``(compute_spans, comm_spans)`` of a set of records; time a thread spent waiting on a collective is
    taken out of the compute spans it falls in, since nothing was computed then."""
    compute: list[Span] = []
    comm: list[Span] = []
    waits: list[Span] = []
    for iv in intervals:
        {"comm": comm, "wait": waits}.get(iv.kind, compute).append((iv.start_ns, iv.end_ns))
    return (subtract(compute, waits) if waits else compute), comm


def step_overlap_ns(compute: Iterable[Span], comm: Iterable[Span]) -> tuple[int, int, int]:
    """``(comm_ns, exposed_ns, overlapped_ns)``: the union of communication, the part of it with no computation
    running, and the part with computation running."""
    comm = merge(comm)
    comm_ns = sum(end - start for start, end in comm)
    overlapped_ns = sum(end - start for start, end in intersection(comm, compute))
    return comm_ns, comm_ns - overlapped_ns, overlapped_ns


def step_summary(intervals: Iterable[Interval]) -> tuple[float, float, float | None]:
    """``(comm_time_s, exposed_comm_s, overlap)`` of one step's records; overlap is None without communication
    (0/0 is not "no overlap")."""
    comm_ns, exposed_ns, overlapped_ns = step_overlap_ns(*split_kinds(intervals))
    overlap = overlapped_ns / comm_ns if comm_ns else None
    return comm_ns * 1e-9, exposed_ns * 1e-9, overlap


# --- bandwidth, as nccl-tests reports it (doc/PERFORMANCE.md) ---------------------

_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


def bus_factor(op: str, group_size: int) -> float:
    """busbw / algbw for ``op`` among ``group_size`` ranks: how much of the payload each rank's
    link must carry, so busbw compares with the hardware's peak whatever the rank count.

    A coalesced batch ("send+recv") takes its parts' factor when they agree.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    factors = set()
    for part in op.split("+"):
        if part not in _BUS_FACTORS:
            raise ValueError(f"no bus bandwidth factor for {part!r}; known: {sorted(_BUS_FACTORS)}")
        factors.add(_BUS_FACTORS[part](group_size))
    if len(factors) != 1:
        raise ValueError(f"the parts of {op!r} have different bus factors")
    return factors.pop()


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: size / time."""
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {seconds} s")
    return nbytes / seconds


def busbw(op: str, nbytes: int, seconds: float, group_size: int) -> float:
    """Bus bandwidth in bytes/s: algbw times the nccl-tests factor of ``op``."""
    return algbw(nbytes, seconds) * bus_factor(op, group_size)


def interval_bandwidth(iv: Interval) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s of one recorded collective."""
    seconds = iv.duration_s
    return algbw(iv.bytes, seconds), busbw(iv.name, iv.bytes, seconds, iv.group_size)
