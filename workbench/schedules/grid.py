"""Pipeline actions and the time-step × rank grid they are placed on.

An action is one unit of pipeline work on one micro-batch through one stage,
printed as torch prints it: "1F0" is stage 1, forward, micro-batch 0. Kinds:

- F: forward;
- B: full backward (input and weight gradients in one pass);
- I: the input-gradient half of a split backward (the zero-bubble paper's "B"), which the stage before waits for;
- W: the weight-gradient half, which nothing waits for, so a schedule can put it in what would be a bubble.

`place` puts each rank's ordered actions on unit time steps, each as early as
its dependencies allow: F of stage s needs F of stage s-1; B or I of stage s
needs its own F and the input gradient (B or I) of stage s+1; W needs its own I.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

Kind = Literal["F", "B", "I", "W"]
KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One unit of pipeline work: a forward, full backward, or one half of a split backward."""

    stage: int
    kind: Kind
    microbatch: int
    paired: bool = field(default=False, compare=False)
    """True for the first of a pair that runs as one unit (DualPipeV's forward of one stage with the backward of
    the other): both run back to back, and what the first produces is sent only when the second is done."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """"1F0" → Action(1, "F", 0), the inverse of str()."""
        for kind in KINDS:
            stage, sep, mb = text.partition(kind)
            if sep and stage.isdigit() and mb.isdigit():
                return cls(int(stage), kind, int(mb))
        raise ValueError(f"not an action: {text!r} (expected e.g. '1F0', '0B3', '2I1' or '2W1')")


class ActionInterval(NamedTuple):
    """A measured action on one rank, in nanoseconds of a clock shared by the ranks (same host: monotonic)."""

    rank: int
    stage: int
    microbatch: int
    kind: Kind
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class Grid:
    """rows[rank][time_step] is the action that rank runs at that step, or None when it idles (the bubble)."""

    rows: tuple[tuple[Action | None, ...], ...]

    @property
    def pp(self) -> int:
        return len(self.rows)

    @property
    def steps(self) -> int:
        return max((len(r) for r in self.rows), default=0)

    def at(self, rank: int, step: int) -> Action | None:
        row = self.rows[rank]
        return row[step] if step < len(row) else None

    @property
    def bubble_fraction(self) -> float:
        """Idle cells / all cells, over ranks × steps (every action counted as one step)."""
        total = self.pp * self.steps
        busy = sum(a is not None for row in self.rows for a in row)
        return (total - busy) / total if total else 0.0

    def orders(self) -> list[list[Action]]:
        """Each rank's actions in the order it runs them (the grid without its idle cells)."""
        return [[a for a in row if a is not None] for row in self.rows]

    @classmethod
    def parse(cls, text: str) -> "Grid":
        """Read back what str() prints (a header line, then one line per rank; "." is idle)."""
        rows = []
        for line in text.strip().splitlines()[1:]:
            row = [None if c == "." else Action.parse(c) for c in line.split()[1:]]
            while row and row[-1] is None:
                row.pop()
            rows.append(tuple(row))
        return cls(tuple(rows))

    def __str__(self) -> str:
        width = max([len(str(a)) for row in self.rows for a in row if a is not None] + [len(str(self.steps - 1))])
        header = "rank " + " ".join(f"{t:>{width}}" for t in range(self.steps))
        lines = [header]
        for rank in range(self.pp):
            cells = (str(self.at(rank, t)) if self.at(rank, t) else "." for t in range(self.steps))
            lines.append(f"{rank:>4} " + " ".join(f"{c:>{width}}" for c in cells))
        return "\n".join(lines)


# What an action produces, and what it waits for, as keys: ("F", s, mb) a forward's output, ("G", s, mb) the
# gradient of stage s's input (made by B or I), ("W", s, mb) the weight gradients.
Key = tuple[str, int, int]


def produces(action: Action) -> Key:
    return ("F" if action.kind == "F" else "W" if action.kind == "W" else "G", action.stage, action.microbatch)


def needs(action: Action, last_stage: int) -> tuple[Key, ...]:
    s, mb = action.stage, action.microbatch
    if action.kind == "F":
        return (("F", s - 1, mb),) if s > 0 else ()
    if action.kind == "W":
        return (("G", s, mb),)
    return (("F", s, mb),) + ((("G", s + 1, mb),) if s < last_stage else ())


def place(orders: Sequence[Sequence[Action]], stages_per_rank: int = 1) -> Grid:
    """Put each rank's ordered actions on unit time steps, each as early as its dependencies allow.

    The last stage is pp·stages_per_rank - 1 whatever the placement. A paired
    action's product is available only once its partner (the next action) has
    run. Raises ValueError if the orders deadlock (an action waits on one that
    can never run first).
    """
    pp = len(orders)
    last_stage = pp * stages_per_rank - 1
    done: dict[Key, int] = {}
    held: list[Action | None] = [None] * pp  # a paired action whose product waits for its partner
    rows: list[list[Action | None]] = [[] for _ in range(pp)]
    cursor = [0] * pp
    step = 0
    while any(cursor[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        ran: list[tuple[int, Action]] = []
        for r in range(pp):
            action = orders[r][cursor[r]] if cursor[r] < len(orders[r]) else None
            if action is not None and all(done.get(k, step) < step for k in needs(action, last_stage)):
                rows[r].append(action)
                ran.append((r, action))
                cursor[r] += 1
                progressed = True
            else:
                rows[r].append(None)
        # Products become visible after the step, so a rank's action this step cannot feed another's this step.
        for r, action in ran:
            if action.paired:
                held[r] = action
                continue
            done[produces(action)] = step
            if held[r] is not None:
                done[produces(held[r])] = step
                held[r] = None
        if not progressed:
            stuck = {r: str(orders[r][cursor[r]]) for r in range(pp) if cursor[r] < len(orders[r])}
            raise ValueError(f"schedule deadlocks at step {step}: waiting actions {stuck}")
        step += 1
    # Trailing idle cells carry no information; rows end at their last action.
    for row in rows:
        while row and row[-1] is None:
            row.pop()
    return Grid(tuple(tuple(row) for row in rows))


def by_rank(intervals: Iterable[ActionInterval | tuple]) -> dict[int, list[ActionInterval]]:
    """Measured intervals grouped per rank, each rank's in order of start."""
    grouped: dict[int, list[ActionInterval]] = defaultdict(list)
    for iv in intervals:
        iv = ActionInterval(*iv)
        grouped[iv.rank].append(iv)
    if not grouped:
        raise ValueError("no intervals")
    for ivs in grouped.values():
        ivs.sort(key=lambda iv: iv.start_ns)
    return grouped


def measured_orders(intervals: Iterable[ActionInterval | tuple]) -> list[list[Action]]:
    """The order each rank actually ran its actions in (from timed intervals)."""
    grouped = by_rank(intervals)
    return [[Action(iv.stage, iv.kind, iv.microbatch) for iv in grouped.get(r, [])] for r in range(max(grouped) + 1)]


def measured_grid(intervals: Iterable[ActionInterval | tuple]) -> Grid:
    """The grid of the orders the ranks actually ran, placed like the ideal grid for a cell-by-cell comparison."""
    orders = measured_orders(intervals)
    stages = max(a.stage for order in orders for a in order) + 1
    return place(orders, stages // len(orders))
