"""Pipeline arithmetic as data: which layers each rank holds, and who runs which forward (F) or backward (B)
at each time step.

Pure Python (no torch), so the notebook side (config, estimator, plan, plots)
and the engine share one rule without processes, and the notebook kernel
never imports torch for it:

- `virtual_stages(schedule, pp, stages_per_rank)`: model chunks per pipeline
  rank (the interleaved schedule's v; 1 otherwise); `split_layers` and
  `stages_of_rank` say which blocks each stage and rank holds (`rank_layers`).

Three sources produce the same `Grid`:

- `schedule_grid(schedule, pp, microbatches, stages_per_rank)`: the order in
  which each rank runs its actions under torch.distributed.pipelining's
  schedule (GPipe, 1F1B, interleaved 1F1B), placed on unit time steps as early
  as the dependencies allow (F of stage s needs F of stage s-1; B of stage s
  needs B of stage s+1 and its own F). Every F and B takes one step, as in
  torch's own printed schedules.
- torch's own order, the schedule objects' `pipeline_order`: `orders_from_torch`
  reads it (the engine's runner has the object), `torch_rank_orders` builds the
  schedule object without processes to ask it (imports torch, so it is never
  on the kernel's path). tests/test_schedules.py holds `rank_orders` equal to
  it over a grid of shapes: torch's is the truth, ours its torch-free copy.
- `measured_grid(intervals)`: the order each rank actually ran (from timed
  intervals), placed the same way, so it can be compared cell by cell with the
  ideal grid; `measured_bubble(intervals)` gives the idle fraction in real time.

Cells print as torch prints its actions: "1F0" is stage 1, forward, micro-batch 0.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:  # config imports this module for its pipeline rule: no import back at run time
    from workbench.config import Config, Schedule

Kind = Literal["F", "B"]


# -- layout: which stages and layers each pipeline rank holds ------------------------------------------
def virtual_stages(schedule: Schedule, pp: int, stages_per_rank: int) -> int:
    """Model chunks (pipeline stages) per rank: `stages_per_rank` under interleaved 1F1B with pp > 1, else 1."""
    return stages_per_rank if pp > 1 and schedule == "interleaved_1f1b" else 1


def config_stages(cfg: Config) -> int:
    """`virtual_stages` of a Config."""
    return virtual_stages(cfg.schedule, cfg.pp, cfg.stages_per_rank)


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """The global block indices of each stage: n_stages runs of consecutive blocks, equal in size."""
    if n_layers % n_stages:
        raise ValueError(f"{n_stages} pipeline stages do not divide {n_layers} layers; choose a divisor of n_layers")
    per = n_layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


def stages_of_rank(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Loop placement: rank r holds stages r, r+pp, r+2pp, ... (what torch's multi-stage schedules expect)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def rank_layers(cfg: Config) -> list[tuple[int, ...]]:
    """The global block indices each pipeline rank holds, in its stages' order."""
    v = config_stages(cfg)
    layers = split_layers(cfg.model.n_layers, cfg.pp * v)
    return [tuple(i for stage in stages_of_rank(r, cfg.pp, v) for i in layers[stage]) for r in range(cfg.pp)]


# -- schedules --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One unit of pipeline work: a forward or full backward of one micro-batch through one stage."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """"1F0" → Action(1, "F", 0), the inverse of str()."""
        for kind in ("F", "B"):
            stage, sep, mb = text.partition(kind)
            if sep:
                return cls(int(stage), kind, int(mb))
        raise ValueError(f"not an action: {text!r} (expected e.g. '1F0' or '0B3')")


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


def ideal_bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle time / total time of a pipeline step with equal F and B costs: (p-1) / (v·m + p-1).

    With one stage per rank (v=1) this is GPipe's and 1F1B's (p-1)/(m+p-1).
    Interleaving v stages per rank makes each fill/drain step v times shorter;
    Megatron's paper states it as bubble/compute = (p-1)/(v·m), i.e. (p-1)/m
    divided by v, which is the same schedule measured against compute instead
    of total time.
    """
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def rank_orders(schedule: Schedule, pp: int, microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """The order in which each rank runs its F and B actions under torch's schedule of that name.

    Mirrors torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B,
    ScheduleInterleaved1F1B with stages placed in loop style: rank r holds
    stages r, r+pp, ...) without importing torch, for the kernel side;
    tests/test_schedules.py checks it equal to `torch_rank_orders`.
    """
    if pp < 1 or microbatches < 1 or stages_per_rank < 1:
        raise ValueError(f"pp, microbatches and stages_per_rank must be ≥ 1, got {pp}, {microbatches}, {stages_per_rank}")
    if schedule == "gpipe":
        return [[Action(r, "F", i) for i in range(microbatches)] + [Action(r, "B", i) for i in range(microbatches)]
                for r in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(r, pp, microbatches) for r in range(pp)]
    if schedule == "interleaved_1f1b":
        return [_interleaved(r, pp, microbatches, stages_per_rank) for r in range(pp)]
    raise ValueError(f"unknown schedule {schedule!r}; use 'gpipe', '1f1b' or 'interleaved_1f1b'")


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    # Warm up with enough forwards to fill the pipe below this rank, then alternate
    # (one F, one B) so at most pp - rank micro-batches hold activations, then drain.
    warmup = min(m, pp - rank - 1)
    order = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    return order + [Action(rank, "B", i) for i in range(m - warmup, m)]


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    # torch's ScheduleInterleaved1F1B: micro-batches go round the v local stages in
    # rounds of `per_round`; forwards walk the local stages upwards, backwards downwards,
    # and the warm-up is one round per extra local stage plus 2 per hop from the last rank.
    rounds = max(1, m // pp)
    if m % rounds:
        raise ValueError(f"interleaved 1F1B needs microbatches ({m}) to be a multiple of {rounds} (= m // pp)")
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v

    def fwd_stage(op: int) -> int:
        return (op // per_round) % v * pp + rank

    def bwd_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    next_f: dict[int, int] = defaultdict(int)
    next_b: dict[int, int] = defaultdict(int)
    order: list[Action] = []

    def emit(kind: Kind, stage: int, counter: dict[int, int]) -> None:
        order.append(Action(stage, kind, counter[stage]))
        counter[stage] += 1

    for op in range(total + warmup):
        if op < total:
            emit("F", fwd_stage(op), next_f)
        if op >= warmup:
            emit("B", bwd_stage(op), next_b)
    return order


def orders_from_torch(pipeline_order: Mapping[int, Sequence[Any]]) -> list[list[Action]]:
    """Each rank's F and B actions in a torch schedule's `pipeline_order` (its IR: `_Action`s, None for idle steps,
    and actions this grid does not draw, such as REDUCE_GRAD or sends), read without importing torch.

    Micro-batches are numbered by order of appearance per stage and kind: every torch schedule runs a stage's
    forwards and its backwards in micro-batch order, and torch 2.13's Schedule1F1B IR numbers the last rank's
    forwards 1..m although it runs 0..m-1 (where the IR is right this changes nothing).
    """
    orders = []
    for rank in sorted(pipeline_order):
        seen: dict[tuple[int, str], int] = defaultdict(int)
        order = []
        for action in pipeline_order[rank]:
            kind = getattr(getattr(action, "computation_type", None), "value", None)
            if kind in ("F", "B"):
                key = (action.stage_index, kind)
                order.append(Action(action.stage_index, kind, seen[key]))
                seen[key] += 1
        orders.append(order)
    return orders


@functools.lru_cache(maxsize=256)
def torch_rank_orders(schedule: Schedule, pp: int, microbatches: int, stages_per_rank: int = 1) -> tuple[tuple[Action, ...], ...]:
    """What torch.distributed.pipelining's schedule of that name orders, asked of the schedule object itself.

    Built over stand-in stages (a schedule computes `pipeline_order` in its
    constructor from the stages' indices and group size, before any
    communication), so it needs no process group; it imports torch (seconds
    on first use), which is why the kernel-side callers use `rank_orders`.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
    if schedule not in classes:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {sorted(classes)}")
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    stages = [_StandInStage(k * pp, pp * v, pp) for k in range(v)]
    built = classes[schedule](stages if schedule == "interleaved_1f1b" else stages[0], microbatches)
    return tuple(tuple(order) for order in orders_from_torch(built.pipeline_order))


@dataclass
class _StandInStage:
    """What a torch schedule's constructor reads of rank 0's stage(s) to lay out every rank's order."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def place(orders: Sequence[Sequence[Action]], stages_per_rank: int = 1) -> Grid:
    """Put each rank's ordered actions on unit time steps, each as early as its dependencies allow.

    Stage s lives on rank s % pp (loop style). Raises ValueError if the orders
    deadlock (an action waits on one that can never run first).
    """
    pp = len(orders)
    last_stage = pp * stages_per_rank - 1
    done: dict[Action, int] = {}
    rows: list[list[Action | None]] = [[] for _ in range(pp)]
    cursor = [0] * pp
    step = 0
    while any(cursor[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if cursor[r] < len(orders[r]) and all(done.get(d, step) < step for d in _needs(orders[r][cursor[r]], last_stage)):
                action = orders[r][cursor[r]]
                rows[r].append(action)
                done[action] = step
                cursor[r] += 1
                progressed = True
            else:
                rows[r].append(None)
        if not progressed:
            stuck = {r: str(orders[r][cursor[r]]) for r in range(pp) if cursor[r] < len(orders[r])}
            raise ValueError(f"schedule deadlocks at step {step}: waiting actions {stuck}")
        step += 1
    # Trailing idle cells carry no information; rows end at their last action.
    for row in rows:
        while row and row[-1] is None:
            row.pop()
    return Grid(tuple(tuple(row) for row in rows))


def _needs(action: Action, last_stage: int) -> tuple[Action, ...]:
    s, mb = action.stage, action.microbatch
    if action.kind == "F":
        return (Action(s - 1, "F", mb),) if s > 0 else ()
    return (Action(s, "F", mb),) + ((Action(s + 1, "B", mb),) if s < last_stage else ())


def schedule_grid(schedule: Schedule, pp: int, microbatches: int, stages_per_rank: int = 1) -> Grid:
    """The ideal time-step × rank grid of a schedule (each F and B one step)."""
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return place(rank_orders(schedule, pp, microbatches, v), v)


def config_grid(cfg: Config) -> Grid:
    """The ideal grid of a Config's pipeline."""
    return schedule_grid(cfg.schedule, cfg.pp, cfg.micro_batches, config_stages(cfg))


def measured_grid(intervals: Iterable[ActionInterval | tuple]) -> Grid:
    """The grid of the orders the ranks actually ran, placed like `schedule_grid` for a cell-by-cell comparison."""
    by_rank = _by_rank(intervals)
    pp = max(by_rank) + 1
    stages = max(iv.stage for ivs in by_rank.values() for iv in ivs) + 1
    orders = [[Action(iv.stage, iv.kind, iv.microbatch) for iv in by_rank.get(r, [])] for r in range(pp)]
    return place(orders, stages // pp)


@dataclass(frozen=True)
class MeasuredBubble:
    """Idle fractions over the step's window (earliest start to latest end, across all ranks)."""

    fraction: float
    """Mean over ranks of idle time / window."""
    per_rank: tuple[float, ...]
    window_ns: int


def measured_bubble(intervals: Iterable[ActionInterval | tuple]) -> MeasuredBubble:
    """Idle time / total time per rank, from measured F/B intervals.

    The window is common to all ranks, so the time a later rank waits for the
    pipeline to fill counts as its bubble; that needs timestamps from one clock
    (ranks on one host share CLOCK_MONOTONIC).
    """
    by_rank = _by_rank(intervals)
    pp = max(by_rank) + 1
    start = min(iv.start_ns for ivs in by_rank.values() for iv in ivs)
    end = max(iv.end_ns for ivs in by_rank.values() for iv in ivs)
    window = end - start
    per_rank = tuple(1.0 - _union_ns(by_rank.get(r, [])) / window if window else 0.0 for r in range(pp))
    return MeasuredBubble(sum(per_rank) / pp, per_rank, window)


def _by_rank(intervals: Iterable[ActionInterval | tuple]) -> dict[int, list[ActionInterval]]:
    by_rank: dict[int, list[ActionInterval]] = defaultdict(list)
    for iv in intervals:
        iv = ActionInterval(*iv)
        by_rank[iv.rank].append(iv)
    if not by_rank:
        raise ValueError("no intervals")
    for ivs in by_rank.values():
        ivs.sort(key=lambda iv: iv.start_ns)
    return by_rank


def _union_ns(intervals: list[ActionInterval]) -> int:
    busy, reach = 0, None
    for iv in sorted(intervals, key=lambda iv: iv.start_ns):
        lo = iv.start_ns if reach is None else max(iv.start_ns, reach)
        if iv.end_ns > lo:
            busy += iv.end_ns - lo
        reach = iv.end_ns if reach is None else max(reach, iv.end_ns)
    return busy
