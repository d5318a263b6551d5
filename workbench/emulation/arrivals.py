"""Where an emulated collective's time went: waiting for the last peer to arrive, or the paced transfer after it.

A collective cannot start before its last peer has issued it, so each rank's recorded span of it (issue to
completion) is the wait for that peer plus the transfer the emulation paced from then on. The two have different
causes: the transfer is the link model's (what the emulation promises), the wait is the ranks' own skew (a rank
that computed the same work more slowly, a pipeline stage waiting for its input, a router that sent one rank more
tokens). Splitting them tells a gap between an emulated step and a prediction apart: a mis-paced link, or ranks
that did not arrive together.

Pure: it reads `Interval`s of one step, one tuple a rank, stamped on one clock (every rank of the pool on this
host: CLOCK_MONOTONIC, as the pacer's shared arrivals are). Collectives are matched across ranks by their group
and their order in it; a send is matched with the peer's receive of the same order. Groups must span every rank
given (the benches' 2-rank worlds): a group of fewer ranks cannot be told apart from its namesakes by its records.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from workbench.telemetry.analysis import Span, covered_ns, merge, split_kinds, subtract
from workbench.telemetry.events import Interval

_P2P = ("send", "recv")


@dataclass(frozen=True)
class Arrival:
    """One collective as every rank of its group issued and completed it (ns on the shared clock)."""

    group: str
    name: str
    """The kind of the first rank's record ("send" for a matched send/recv pair)."""
    bytes: int
    issued: tuple[int, ...]
    """Each rank's issue, in the order of the ranks given."""
    ended: tuple[int, ...]

    @property
    def last_ns(self) -> int:
        """When the last peer arrived: the earliest the transfer could begin."""
        return max(self.issued)

    @property
    def skew_s(self) -> float:
        """The first rank's wait for the last: how far apart the ranks arrived."""
        return (max(self.issued) - min(self.issued)) * 1e-9

    @property
    def transfer_s(self) -> float:
        """From the last arrival to the first rank's completion: what the pacer let the transfer take. The first,
        since a rank that waits on a collective late (a send waited on after the next compute) stamps its end
        then: its record is an upper bound of the completion."""
        return (min(self.ended) - self.last_ns) * 1e-9


def _comm(intervals: Sequence[Interval]) -> list[Interval]:
    return sorted((iv for iv in intervals if iv.kind == "comm" and iv.group_size > 1), key=lambda iv: iv.start_ns)


def match(ranks: Sequence[Sequence[Interval]]) -> list[Arrival]:
    """The collectives of one step that every rank in `ranks` recorded, matched by (group, order); a send and the
    other rank's receive of the same order are one transfer (2 ranks only: more cannot tell which peer). A group
    whose ranks recorded different counts is left out (its order cannot be trusted)."""
    n = len(ranks)
    queues: list[dict[tuple[str, str], list[Interval]]] = []
    for intervals in ranks:
        q: dict[tuple[str, str], list[Interval]] = defaultdict(list)
        for iv in _comm(intervals):
            if iv.group_size != n:
                continue
            q[iv.group, iv.name if iv.name in _P2P else "collective"].append(iv)
        queues.append(q)
    out: list[Arrival] = []
    for group, kind in sorted({key for q in queues for key in q}):
        if kind == "collective":
            seqs = [q.get((group, kind), []) for q in queues]
            if len({len(s) for s in seqs}) != 1 or any(len({iv.name for iv in col}) != 1 for col in zip(*seqs)):
                continue
            out += [_arrival(group, col) for col in zip(*seqs)]
        elif kind == "send" and n == 2:
            for sender in (0, 1):
                sends, recvs = queues[sender].get((group, "send"), []), queues[1 - sender].get((group, "recv"), [])
                if len(sends) != len(recvs):
                    continue
                out += [_arrival(group, (s, r) if sender == 0 else (r, s), "send") for s, r in zip(sends, recvs)]
    return sorted(out, key=lambda a: a.last_ns)


def _arrival(group: str, col: Sequence[Interval], name: str | None = None) -> Arrival:
    return Arrival(group, name or col[0].name, max(iv.bytes for iv in col), tuple(iv.start_ns for iv in col),
                   tuple(iv.end_ns for iv in col))


@dataclass(frozen=True)
class ExposedSplit:
    """One rank's exposed communication of a step (communication during which it computed nothing), split by
    what it was doing: waiting for a peer to arrive, or the transfer itself."""

    exposed_s: float
    waiting_s: float
    """Exposed while no collective this rank was in had all its peers yet."""
    transfer_s: float
    """Exposed while at least one of its collectives was transferring (its last peer had arrived)."""


def split_exposed(intervals: Sequence[Interval], arrivals: Sequence[Arrival], rank: int) -> ExposedSplit:
    """`rank`'s (its place in the ranks `arrivals` were matched over) exposed communication, split at each
    collective's last arrival. A collective left unmatched counts as transfer from its issue: nothing says a
    peer kept it waiting."""
    compute, comm = split_kinds(intervals)
    exposed = subtract(comm, compute)
    matched = {(a.issued[rank], a.ended[rank]) for a in arrivals}
    transferring: list[Span] = [(max(a.last_ns, a.issued[rank]), a.ended[rank]) for a in arrivals]
    transferring += [(iv.start_ns, iv.end_ns) for iv in _comm(intervals) if (iv.start_ns, iv.end_ns) not in matched]
    exposed_ns = covered_ns(exposed)
    waiting_ns = covered_ns(subtract(exposed, transferring))
    return ExposedSplit(exposed_ns * 1e-9, waiting_ns * 1e-9, (exposed_ns - waiting_ns) * 1e-9)


def compute_behind(ranks: Sequence[Sequence[Interval]], arrivals: Sequence[Arrival]) -> float:
    """Seconds of the step's skew that the ranks' own compute accounts for: before each collective, how much
    longer the last rank to arrive computed than the first, since the collective before (when both were last
    released together). Equal work computed at equal speed makes it 0; a rank on a busier core, or given more
    tokens by a router, makes it the skew it causes."""
    computes = [merge(split_kinds(intervals)[0]) for intervals in ranks]
    behind, released = 0, [min(iv.start_ns for iv in intervals) for intervals in ranks]
    for a in arrivals:
        spent = [covered_ns(_clip(c, since, issued)) for c, since, issued in zip(computes, released, a.issued)]
        late, early = a.issued.index(max(a.issued)), a.issued.index(min(a.issued))
        behind += max(0, spent[late] - spent[early])
        released = list(a.ended)
    return behind * 1e-9


def _clip(spans: Sequence[Span], start: int, end: int) -> list[Span]:
    return [(max(s, start), min(e, end)) for s, e in spans if e > start and s < end and start < end]
