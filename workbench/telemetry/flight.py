"""Which rank is stuck in which collective: every rank's ring of its last collectives, and what they say together.

The recording backend keeps, on each rank, a small ring of the collectives that rank issued lately, on every
process group: the op, the group, its number within the group, bytes, when, and whether it completed
(extensions/telemetry/flight_recorder.h) — the job of NCCL's flight recorder, for gloo and NCCL alike. A hang
where every rank waits in the same collective is a slow rank or a network; a hang where some ranks wait in a
collective that another never issued is a desync, and the rings show it.

`snapshot()` reads this rank's ring, from any thread, also while the main thread is blocked inside a collective
(so a pool's watchdog thread can read it). `explain()` is pure: given every rank's ring it says where they part
ways, e.g. "ranks 0,2 wait in all_reduce #412 of the dp group; rank 1 has issued only up to #411 there, its
last collective all_gather #411 of the tp group (done)". `diagnose()` is both, for a pool's rank-side
diagnostic provider: one rank's ring as plain data, ready to cross the process boundary.

How a pool uses it for its hang report: on each rank `workbench.pool.rank.add_diagnostic(DIAGNOSTIC, diagnose)`
(the provider runs on the rank's I/O thread while the main thread is stuck); on the driver
`explain_diagnostics`, the pool's `explain` callable, turns what the ranks answered into the report's summary
line (`describe_hang` does the same from rings or `diagnose()` answers directly).

A group's operations are numbered together, sends and receives included. Where a group carries point-to-point
traffic (pipeline stages: a middle stage sends and receives twice as often as the ends), members' numbers
legitimately differ, so such a group's positions are not compared; its pending transfers are still shown, and a
p2p transfer shows as what a rank behind elsewhere did last.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

DIAGNOSTIC = "flight recorder"
"""The name the rank-side provider is registered under; `explain_diagnostics` reads the answers by it."""

State = Literal["issued", "enqueued", "done", "failed"]
"""issued: not completed yet; enqueued: a CUDA collective handed to its stream, not known done on the device yet;
done; failed: completed with an error."""


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it."""

    group: str
    """The group as the recording backend labels it: DeviceMesh's description ("mesh_dp"), else its name."""
    uid: str
    """The group's unique name: the same group on every member rank (labels repeat: every dp group is "mesh_dp")."""
    op: str
    seq: int
    """Its number among the operations this rank issued on the group, from 1: equal on every member when in step."""
    bytes: int
    group_size: int
    backend: str
    start_ns: int
    end_ns: int
    """When it completed on the host (0 while pending)."""
    state: State

    @property
    def p2p(self) -> bool:
        """A send or recv, or a batch of only those ("send+recv")."""
        return all(part in ("send", "recv") for part in self.op.split("+"))

    @property
    def pending(self) -> bool:
        return self.state in ("issued", "enqueued")


@dataclass(frozen=True)
class RankRing:
    """A rank's flight recorder at one moment: its collectives, oldest first, and the ranks of each group."""

    rank: int
    collectives: tuple[Collective, ...]
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(uid, the group's global ranks) for each group in `collectives`, where this rank could tell."""
    now_ns: int = 0

    def members(self, uid: str) -> tuple[int, ...] | None:
        return dict(self.groups).get(uid)


# --- on a rank ----------------------------------------------------------------------------------------------


def snapshot() -> RankRing:
    """This rank's ring now. Safe from any thread; takes the native ring's lock only to copy it."""
    from workbench.telemetry import native

    ext = native.load()
    rows = ext.flight_snapshot()
    states = _device_states([(row[0], row[11]) for row in rows if row[10] == "enqueued" and row[11] > 0])
    collectives = []
    for entry_id, group, uid, op, seq, nbytes, size, backend, start, end, state, _mark in rows:
        if entry_id in states:
            state = states[entry_id]
            ext.flight_settle(entry_id, state == "failed")
        collectives.append(Collective(group, uid, op, seq, nbytes, size, backend, start, end, state))
    uids = dict.fromkeys(c.uid for c in collectives)
    groups = tuple((uid, ranks) for uid in uids if (ranks := _group_ranks(uid)) is not None)
    return RankRing(_rank(), tuple(collectives), groups, ext.now_ns())


def diagnose(last: int = 32) -> dict:
    """This rank's ring as plain data, small enough for a hang report (a pool's rank-side diagnostic provider):
    the newest `last` entries, and each group's newest entry of each kind beyond them, which is all `explain`
    reads (where every rank stands in every group). See `from_plain`."""
    return to_plain(_compact(snapshot(), last))


def to_plain(ring: RankRing) -> dict:
    """`ring` as plain, picklable values (lists, ints, strs), for crossing a process boundary."""
    return {"rank": ring.rank, "now_ns": ring.now_ns, "groups": [[uid, list(r)] for uid, r in ring.groups],
            "collectives": [[c.group, c.uid, c.op, c.seq, c.bytes, c.group_size, c.backend, c.start_ns, c.end_ns,
                             c.state] for c in ring.collectives]}


def from_plain(data: Mapping[str, Any]) -> RankRing:
    """The `RankRing` that `to_plain` (or `diagnose()`) described."""
    return RankRing(rank=data["rank"], now_ns=data["now_ns"],
                    groups=tuple((uid, tuple(ranks)) for uid, ranks in data["groups"]),
                    collectives=tuple(Collective(*row) for row in data["collectives"]))


def _compact(ring: RankRing, last: int) -> RankRing:
    newest: dict[tuple[str, bool], int] = {}  # a group's newest p2p entry too: it marks the group uncompared
    for i, c in enumerate(ring.collectives):
        newest[(c.uid, c.p2p)] = i
    keep = sorted({*newest.values(), *range(max(len(ring.collectives) - last, 0), len(ring.collectives))})
    kept = tuple(ring.collectives[i] for i in keep)
    uids = {c.uid for c in kept}
    return RankRing(ring.rank, kept, tuple(g for g in ring.groups if g[0] in uids), ring.now_ns)


def set_capacity(entries: int) -> None:
    """Keep the last `entries` collectives (default 256, ~40 KB); empties the ring."""
    from workbench.telemetry import native

    if entries < 1:
        raise ValueError(f"entries: must be at least 1, got {entries}")
    native.load().flight_reset(entries)


def _device_states(marks: list[tuple[int, int]]) -> dict[int, State]:
    """CUDA collectives enqueued on their streams: done or failed on the device, by their end marks."""
    if not marks:
        return {}
    from workbench.telemetry import cuda

    readings = cuda.read_marks([mark for _, mark in marks])
    out: dict[int, State] = {}
    for entry_id, mark in marks:
        reading = readings.get(mark)
        if reading is not None and reading.state in ("done", "error"):
            out[entry_id] = "done" if reading.state == "done" else "failed"
    return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


@functools.lru_cache(maxsize=256)
def _group_ranks(uid: str) -> tuple[int, ...] | None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return tuple(dist.get_process_group_ranks(_resolve_process_group(uid)))
    except (RuntimeError, ValueError, KeyError):  # not a group this process knows by that name
        return None


# --- anywhere: pure ---------------------------------------------------------------------------------------


def describe_hang(rings: Iterable[RankRing | Mapping[str, Any]]) -> str:
    """`explain` for a hang report: rings as `RankRing`s or as `diagnose()` answered them (plain data)."""
    return explain(r if isinstance(r, RankRing) else from_plain(r) for r in rings)


def explain_diagnostics(diagnostics: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The pool's `explain` callable: what each answering rank's providers said, by rank, to the summary line of a
    hang report; None when no rank answered with its ring (telemetry off, or an older rank)."""
    rings = [answer[DIAGNOSTIC] for answer in diagnostics.values() if isinstance(answer.get(DIAGNOSTIC), Mapping)]
    return describe_hang(rings) if rings else None


def explain(rings: Iterable[RankRing]) -> str:
    """What every rank's ring says about a hang, in a few lines (pure: rings in, words out).

    For each group where the members' rings disagree: which ranks are furthest (and whether they wait there),
    which are behind, and what each rank behind did last anywhere, for that is what it is stuck in. Also
    members that disagree on what the same collective is (op or size: gloo then hangs or reads garbage). When
    nothing disagrees, says what is pending, or that nothing is.
    """
    by_rank = {ring.rank: ring for ring in rings}
    if not by_rank:
        return "flight recorder: no rank's ring to read"
    lines, uncompared = [], []
    for uid in _uids(by_rank.values()):
        if any(c.uid == uid and c.p2p for ring in by_rank.values() for c in ring.collectives):
            uncompared.append(uid)  # its numbers count sends and receives, which members issue in different numbers
            continue
        lines += _group_findings(uid, by_rank)
    if lines:
        return "\n".join(lines)
    waiting = [(r, c) for r, ring in sorted(by_rank.items()) if (c := _last(ring.collectives)) and c.pending]
    if not waiting:
        return "flight recorder: the ranks agree and no collective is pending"
    by_what: dict[tuple[str, bool, str, int], tuple[Collective, list[int]]] = {}
    for rank, c in waiting:
        by_what.setdefault((c.uid, c.p2p, c.op, c.seq), (c, []))[1].append(rank)
    described = [f"{_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in {_describe(c, status=False)}"
                 for c, ranks in by_what.values()]
    where = "every group" if not uncompared else "every group without point-to-point traffic"
    return (f"flight recorder: the ranks agree on {where} (no desync found); " + "; ".join(described)
            + ": a slow rank or link, or a mismatch of sends and receives")


def _group_findings(uid: str, by_rank: dict[int, RankRing]) -> list[str]:
    members = _members(uid, by_rank)
    last = {r: _last(c for c in by_rank[r].collectives if c.uid == uid) for r in members if r in by_rank}
    seen = [c for c in last.values() if c is not None]
    if not seen:
        return []
    name = _group_name(seen[0])
    front = max(c.seq for c in seen)
    ahead = sorted(r for r, c in last.items() if c is not None and c.seq == front)
    behind = sorted(r for r, c in last.items() if c is None or c.seq < front)
    silent = sorted(r for r in members if r not in by_rank)
    lines = []
    # Ranks ahead whose collective completed mean every member joined it: a member showing less has only let its
    # older entries go (its ring is full of other groups' traffic), so nothing is said about it.
    if behind and any(last[r].state != "done" for r in ahead):
        lead = last[ahead[0]]
        one = len(ahead) == 1
        verb = ("waits in" if one else "wait in") if all(last[r].pending for r in ahead) else (
            "has issued" if one else "have issued")
        parts = [f"{_ranks(ahead)} {verb} {lead.op} #{front} of {name}"]
        for r in behind:
            here = last[r]
            where = f"has issued only up to #{here.seq} there" if here is not None else "has issued nothing there"
            latest = _last(by_rank[r].collectives)
            if latest is not None and latest is not here:
                where += f", its last {'operation' if latest.p2p else 'collective'} {_describe(latest)}"
            elif here is not None:
                where += f" ({here.state})"
            parts.append(f"rank {r} {where}")
        lines.append("; ".join(parts))
    elif not behind:
        kinds = {(c.op, c.bytes) for c in seen}
        if len(kinds) > 1:
            what = ", ".join(f"rank {r} {c.op} of {_size(c.bytes)}" for r, c in sorted(last.items()) if c)
            lines.append(f"the ranks of {name} disagree on what #{front} is: {what}")
    if silent and (lines or any(c.pending for c in seen)):
        lines.append(f"{_ranks(silent)} of {name}: no ring read (the process did not answer)")
    return lines


def _members(uid: str, by_rank: dict[int, RankRing]) -> list[int]:
    for ring in by_rank.values():
        known = ring.members(uid)
        if known is not None:
            return list(known)
    return sorted(r for r, ring in by_rank.items() if any(c.uid == uid for c in ring.collectives))


def _uids(rings: Iterable[RankRing]) -> list[str]:
    """Every group in the rings, those with the latest activity first (the likeliest place of a hang)."""
    latest: dict[str, int] = {}
    for ring in rings:
        for c in ring.collectives:
            latest[c.uid] = max(latest.get(c.uid, 0), c.start_ns)
    return sorted(latest, key=lambda uid: -latest[uid])


def _last(collectives: Iterable[Collective]) -> Collective | None:
    last = None
    for c in collectives:  # oldest first
        last = c
    return last


def _group_name(c: Collective) -> str:
    if c.group == "default_pg":
        return "the world group"
    if c.group.startswith("mesh_"):
        return f"the {c.group[5:]} group"
    return f"group {c.group}"


def _describe(c: Collective, status: bool = True) -> str:
    text = f"{c.op} #{c.seq} of {_group_name(c)}"
    if not status:
        return text
    return text + (" (waiting)" if c.state == "issued" else f" ({c.state})")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} B"
