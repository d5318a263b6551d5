"""The overlap sweep in plain Python: the independent reference the compiled extension is held equal to.

The product measures overlap in C++ (`workbench.telemetry.native`, sources in
extensions/telemetry/intervals.*); this is the same definition written out
the simplest way, so a test can compare the two on hand-computed and random
spans. Spans are half-open ``(start_ns, end_ns)``.
"""

from __future__ import annotations

from collections.abc import Iterable

from workbench.telemetry.analysis import Span, merge, split_kinds
from workbench.telemetry.events import Interval

__all__ = ["merge", "union_length", "intersection", "step_overlap_ns", "step_summary"]


def union_length(spans: Iterable[Span]) -> int:
    """Time covered by at least one span, overlaps counted once."""
    return sum(e - s for s, e in merge(spans))


def intersection(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Instants covered by both sets, as merged spans."""
    x, y = merge(a), merge(b)
    out: list[Span] = []
    i = j = 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if lo < hi:
            out.append((lo, hi))
        # Advance whichever ends first; the other may still meet the next one.
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def step_overlap_ns(compute: Iterable[Span], comm: Iterable[Span]) -> tuple[int, int, int]:
    """``(comm_ns, exposed_ns, overlapped_ns)``: the union of communication, the part of it with
    no computation running, and the part with computation running."""
    comm = list(comm)
    comm_ns = union_length(comm)
    overlapped = union_length(intersection(comm, compute))
    return comm_ns, comm_ns - overlapped, overlapped


def step_summary(intervals: Iterable[Interval]) -> tuple[float, float, float | None]:
    """``(comm_time_s, exposed_comm_s, overlap)`` of one step's records; overlap is None without communication
    (0/0 is not "no overlap")."""
    comm_ns, exposed_ns, overlapped_ns = step_overlap_ns(*split_kinds(intervals))
    overlap = overlapped_ns / comm_ns if comm_ns else None
    return comm_ns * 1e-9, exposed_ns * 1e-9, overlap
