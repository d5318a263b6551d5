"""The pipeline bubble: idle time per rank, as each schedule's formula predicts it and as a step measured it.

Three views of one quantity, so each can be checked against the others:

- `bubble_formula(schedule, pp, durations)`: the closed forms of the
  literature, in the time of one action (a forward chunk F, a full backward
  chunk B, a weight-gradient chunk W): 1F1B (p-1)(F+B); ZB1P (p-1)(F+B-2W);
  DualPipeV (S/2-1)(F&B+B-3W) over S = 2p stages (the DualPipe README, which
  counts stages, not ranks). tests/test_schedules.py holds each equal to
  `simulate` of torch's own order when every stage takes the same time.
- `simulate(orders, durations)`: the schedule's actions placed in time, each
  as early as its rank and its dependencies allow (a hop between ranks takes
  a given transfer time, or none); its `idle_per_rank` is the bubble that
  order costs with those durations.
- `measured_bubble(intervals)`: idle time per rank from timed intervals.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from workbench.schedules.grid import Action, ActionInterval, Key, by_rank, needs, produces
from workbench.schedules.layout import Schedule



class Durations(NamedTuple):
    """Time of one action of each kind (any unit): forward, full backward, input-gradient and weight-gradient halves.

    `B` is a full backward; where a schedule splits every backward, B = I + W (`Durations.split`).
    """

    F: float
    B: float
    I: float  # noqa: E741 (torch's letter for the input-gradient half)
    W: float

    @classmethod
    def split(cls, F: float, I: float, W: float) -> Durations:  # noqa: E741
        """Durations where a full backward costs its two halves."""
        return cls(F, I + W, I, W)

    def of(self, action: Action) -> float:
        return getattr(self, action.kind)


def ideal_bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle time / total time of a 1F1B-family pipeline step with equal F and B costs: (p-1) / (v·m + p-1).

    With one stage per rank (v=1) this is GPipe's and 1F1B's (p-1)/(m+p-1).
    Interleaving v stages per rank makes each fill/drain step v times shorter;
    Megatron's paper states it as bubble/compute = (p-1)/(v·m), i.e. (p-1)/m
    divided by v, which is the same schedule measured against compute instead
    of total time.
    """
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


FORMULAS: dict[str, str] = {
    "gpipe": "(p−1)(F+B)",
    "1f1b": "(p−1)(F+B)",
    "interleaved_1f1b": "(p−1)(F+B)",
    "interleaved_zb": "(p−1)(F+B−2W)",
    "zbv": "(p−1)(F+B−2W)",
    "dualpipev": "(S/2−1)(F&B+B−3W), S = 2p",
}
"""Each schedule's bubble per rank as printed, in the time of one action (one chunk: 1/v of a rank's layers)."""


def bubble_formula(schedule: Schedule, pp: int, d: Durations) -> float:
    """Idle time per rank that `schedule` costs over `pp` ranks with action durations `d` (FORMULAS).

    F&B, DualPipeV's forward paired with a backward, is F + B here: torch's
    runtime runs the pair one after the other (on one stream, nothing to overlap them with).
    """
    p = pp
    if schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        return (p - 1) * (d.F + d.B)
    if schedule in ("interleaved_zb", "zbv"):
        return (p - 1) * (d.F + d.B - 2 * d.W)
    if schedule == "dualpipev":
        stages = 2 * p
        return (stages / 2 - 1) * ((d.F + d.B) + d.B - 3 * d.W)
    raise ValueError(f"no bubble formula for schedule {schedule!r}; one of {sorted(FORMULAS)}")


@dataclass(frozen=True)
class Timeline:
    """Each action of a simulated step with its start and end (the units of the durations given)."""

    spans: tuple[tuple[tuple[Action, float, float], ...], ...]
    """spans[rank] = ((action, start, end), ...) in the order the rank runs them."""

    @property
    def makespan(self) -> float:
        return max((end for row in self.spans for _, _, end in row), default=0.0)

    @property
    def idle_per_rank(self) -> tuple[float, ...]:
        """Per rank: the step's length minus the rank's busy time (the bubble it pays)."""
        return tuple(self.makespan - sum(end - start for _, start, end in row) for row in self.spans)


def simulate(orders: Sequence[Sequence[Action]], duration: Durations | Callable[[Action], float],
             stages_per_rank: int = 1, transfer: float = 0.0, receive_when_free: bool = False) -> Timeline:
    """Run each rank's ordered actions in time: an action starts when its rank is free and what it needs is done.

    `duration` is a `Durations` or any function of the action (e.g. measured
    per stage). `transfer`: the time what one rank produces (an activation, its
    gradient) takes to reach another rank; 0, communication takes no time.
    `receive_when_free`: a transfer starts only once the receiving rank is free as well, not while it still
    computes: torch's schedules post a receive after the rank's previous action (batched with its send), and a
    send/recv moves nothing before both sides have posted; False lets the transfer hide behind that action.
    Raises ValueError on a deadlock.
    """
    cost = duration.of if isinstance(duration, Durations) else duration
    pp = len(orders)
    orders = tuple(map(tuple, orders))
    links = _dependencies(orders, pp * stages_per_rank - 1)
    finished: dict[Key, float] = {}
    made_on: dict[Key, int] = {}
    held: list[Key | None] = [None] * pp  # a paired action's product, which waits for its partner's end
    free = [0.0] * pp
    cursor = [0] * pp
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    remaining = sum(map(len, orders))
    while remaining:
        progressed = False
        for r in range(pp):
            while cursor[r] < len(orders[r]):
                action, (deps, product) = orders[r][cursor[r]], links[r][cursor[r]]
                if not all(k in finished for k in deps):
                    break
                if receive_when_free:
                    ready = max([free[r], *(finished[k] for k in deps)])
                    start = ready + (transfer if any(made_on[k] != r for k in deps) else 0.0)
                else:
                    start = max([free[r], *(finished[k] + (transfer if made_on[k] != r else 0.0) for k in deps)])
                end = start + cost(action)
                spans[r].append((action, start, end))
                free[r] = end
                if action.paired:
                    held[r] = product
                else:
                    finished[product], made_on[product] = end, r
                    if held[r] is not None:
                        finished[held[r]], made_on[held[r]] = end, r
                        held[r] = None
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][cursor[r]]) for r in range(pp) if cursor[r] < len(orders[r])}
            raise ValueError(f"schedule deadlocks: waiting actions {stuck}")
    return Timeline(tuple(tuple(row) for row in spans))


@functools.lru_cache(maxsize=256)
def _dependencies(orders: tuple[tuple[Action, ...], ...], last_stage: int
                  ) -> tuple[tuple[tuple[tuple[Key, ...], Key], ...], ...]:
    """What each rank's actions wait for and produce, worked out once per schedule: `wb.plan` simulates the same
    few schedules in thousands of layouts' times. (Actions that differ only in `paired` compare equal, so the
    cache holds only what does not depend on it.)"""
    return tuple(tuple((needs(a, last_stage), produces(a)) for a in row) for row in orders)


@dataclass(frozen=True)
class MeasuredBubble:
    """Idle time over the step's window (earliest start to latest end, across all ranks)."""

    fraction: float
    """Mean over ranks of idle time / window."""
    per_rank: tuple[float, ...]
    """Each rank's idle time / window."""
    window_ns: int

    @property
    def idle_ns(self) -> float:
        """Mean idle time per rank, in ns: what a formula in time units predicts."""
        return self.fraction * self.window_ns


def measured_bubble(intervals: Iterable[ActionInterval | tuple]) -> MeasuredBubble:
    """Idle time / total time per rank, from measured intervals.

    The window is common to all ranks, so the time a later rank waits for the
    pipeline to fill counts as its bubble; that needs timestamps from one clock
    (ranks on one host share CLOCK_MONOTONIC).
    """
    grouped = by_rank(intervals)
    pp = max(grouped) + 1
    start = min(iv.start_ns for ivs in grouped.values() for iv in ivs)
    end = max(iv.end_ns for ivs in grouped.values() for iv in ivs)
    window = end - start
    per_rank = tuple(1.0 - _union_ns(grouped.get(r, [])) / window if window else 0.0 for r in range(pp))
    return MeasuredBubble(sum(per_rank) / pp, per_rank, window)


def measured_durations(intervals: Iterable[ActionInterval | tuple]) -> Durations:
    """Mean measured time of each kind of action (ns). A kind the step did not run is 0, except B: where every
    backward was split, B is the mean I plus the mean W (what a full backward of those chunks costs).

    Stage 0's split is left out of I and W: it has no input gradient to send, so torch runs its whole backward
    in its W and its I is empty; counted in, the means would describe no real chunk.
    """
    sums: dict[str, list[int]] = {k: [] for k in "FBIW"}
    for iv in intervals:
        iv = ActionInterval(*iv)
        if iv.stage == 0 and iv.kind in "IW":
            continue
        sums[iv.kind].append(iv.end_ns - iv.start_ns)
    mean: Mapping[str, float] = {k: sum(v) / len(v) if v else 0.0 for k, v in sums.items()}
    full = mean["B"] if sums["B"] else mean["I"] + mean["W"]
    return Durations(mean["F"], full, mean["I"], mean["W"])


def _union_ns(intervals: list[ActionInterval]) -> int:
    busy, reach = 0, None
    for iv in sorted(intervals, key=lambda iv: iv.start_ns):
        lo = iv.start_ns if reach is None else max(iv.start_ns, reach)
        if iv.end_ns > lo:
            busy += iv.end_ns - lo
        reach = iv.end_ns if reach is None else max(reach, iv.end_ns)
    return busy
