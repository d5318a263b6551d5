"""The overlap arithmetic written another way: the independent reference `workbench.telemetry.analysis` is held to.

The product merges sorted spans and sweeps two merged lists; this cuts the timeline at every span boundary and
asks of each piece which sets cover it (a depth count per set), sharing no code with the product; slower,
which a test does not mind. Spans are half-open ``(start_ns, end_ns)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from workbench.telemetry.events import Interval

Span = tuple[int, int]

__all__ = ["merge", "covered_ns", "intersection", "step_overlap_ns", "step_summary"]


def _pieces(*sets: Iterable[Span]) -> Iterator[tuple[int, int, tuple[bool, ...]]]:
    """``(lo, hi, covered)`` for each piece between consecutive boundaries; ``covered[k]``: set k covers it."""
    changes: dict[int, list[int]] = {}
    for k, spans in enumerate(sets):
        for start, end in spans:
            if end < start:
                raise ValueError(f"interval ends before it starts: [{start}, {end})")
            if end > start:
                changes.setdefault(start, [0] * len(sets))[k] += 1
                changes.setdefault(end, [0] * len(sets))[k] -= 1
    depth = [0] * len(sets)
    bounds = sorted(changes)
    for lo, hi in zip(bounds, bounds[1:]):
        depth = [d + c for d, c in zip(depth, changes[lo])]
        yield lo, hi, tuple(d > 0 for d in depth)


def _joined(pieces: Iterable[Span]) -> list[Span]:
    out: list[Span] = []
    for lo, hi in pieces:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def merge(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering exactly the instants of ``spans``."""
    return _joined((lo, hi) for lo, hi, (covered,) in _pieces(list(spans)) if covered)


def covered_ns(spans: Iterable[Span]) -> int:
    """Time covered by at least one span, overlaps counted once."""
    return sum(hi - lo for lo, hi, (covered,) in _pieces(list(spans)) if covered)


def intersection(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Instants covered by both sets, as merged spans."""
    return _joined((lo, hi) for lo, hi, (in_a, in_b) in _pieces(list(a), list(b)) if in_a and in_b)


def _overlap(compute: list[Span], comm: list[Span], waits: list[Span]) -> tuple[int, int, int]:
    comm_ns = overlapped_ns = 0
    for lo, hi, (computing, communicating, waiting) in _pieces(compute, comm, waits):
        if communicating:
            comm_ns += hi - lo
            overlapped_ns += hi - lo if computing and not waiting else 0
    return comm_ns, comm_ns - overlapped_ns, overlapped_ns


def step_overlap_ns(compute: Iterable[Span], comm: Iterable[Span]) -> tuple[int, int, int]:
    """``(comm_ns, exposed_ns, overlapped_ns)``: the union of communication, the part of it with
    no computation running, and the part with computation running."""
    return _overlap(list(compute), list(comm), [])


def step_summary(intervals: Iterable[Interval]) -> tuple[float, float, float | None]:
    """``(comm_time_s, exposed_comm_s, overlap)`` of one step's records: a thread waiting on a collective
    computes nothing, even inside a compute span; overlap is None without communication."""
    spans: dict[str, list[Span]] = {"compute": [], "comm": [], "wait": []}
    for iv in intervals:
        spans[iv.kind if iv.kind in ("comm", "wait") else "compute"].append((iv.start_ns, iv.end_ns))
    comm_ns, exposed_ns, overlapped_ns = _overlap(spans["compute"], spans["comm"], spans["wait"])
    return comm_ns * 1e-9, exposed_ns * 1e-9, (overlapped_ns / comm_ns if comm_ns else None)
