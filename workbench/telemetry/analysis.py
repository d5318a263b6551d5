"""Pure functions over telemetry records: what overlap is measured over, and bandwidth.

Overlap is measured on the ranks by the compiled extension (``native``) as a
sweep over merged intervals: the fraction of communication time during which
computation also runs (the HolisticTraceAnalysis definition). This module
prepares its input, ``split_kinds``: compute spans less the time a thread
waited on a collective. The plain-Python sweep the extension is tested
against lives with the tests (``tests/telemetry/overlap_reference.py``), so
there is one implementation in the product and an independent one to check it.

Spans are half-open ``(start_ns, end_ns)`` on one rank's monotonic clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from workbench import links
from workbench.telemetry.events import Interval

Span = tuple[int, int]


def merge(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering exactly the instants of ``spans`` (empty ones vanish)."""
    ordered = sorted(spans)
    for start, end in ordered:
        if end < start:
            raise ValueError(f"interval ends before it starts: [{start}, {end})")
    out: list[list[int]] = []
    for start, end in ordered:
        if end == start:
            continue
        # Touching spans join: no instant lies between [0, 5) and [5, 9).
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def covered_ns(spans: Iterable[Span]) -> int:
    """How long ``spans`` cover, each instant once (overlaps counted once)."""
    return sum(end - start for start, end in merge(spans))


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


# --- bandwidth, as nccl-tests reports it (doc/PERFORMANCE.md) ---------------------


def bus_factor(op: str, group_size: int) -> float:
    """busbw / algbw of a recorded ``op`` among ``group_size`` ranks: nccl-tests' factor (`links.bus_factor`, the
    one table), refused for a barrier, which moves no payload and so has no bus bandwidth to report."""
    if "barrier" in op.split("+"):
        raise ValueError(f"no bus bandwidth factor for {op!r}: a barrier moves no payload")
    return links.bus_factor(op, group_size)


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
