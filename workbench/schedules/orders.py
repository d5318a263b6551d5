"""The order in which each rank runs its actions under each torch.distributed.pipelining schedule, without torch.

torch's schedule objects are the truth (their `pipeline_order`, read by
`torch_orders.py`); this is their torch-free copy for the notebook side
(config, estimator, plan and plots run without importing torch), held equal
to torch's over a grid of shapes by tests/test_schedules.py. Written from what
each schedule does, phase by phase:

- gpipe: all forwards, then all backwards.
- 1f1b (PipeDream-flush): warm up with pp-1-r forwards, then one forward, one backward.
- interleaved_1f1b (Narayanan et al. 2021): v loop-placed stages per rank;
  micro-batches go round the local stages in rounds of pp.
- interleaved_zb (ZB-H1 of Qi et al. 2024, interleaved): as interleaved 1F1B
  with split backwards: the input gradient (I) at once, its weight gradient (W)
  delayed by r steps on rank r, into what 1F1B leaves as the drain bubble.
- zbv (ZB-V, same paper, section 6): two V-placed stages per rank; every
  backward split, its W run straight after its I except in the drain.
- dualpipev (DeepSeek's DualPipe cut in half): two V-placed stages per rank; in
  the steady state a forward of one stage is paired with a full backward of the
  other (torch runs the pair one after the other, F then B); the edges split
  backwards to fill the bubble with W.
"""

from __future__ import annotations

from collections import defaultdict
from workbench.schedules.grid import Action, Grid, Kind, place
from workbench.schedules.layout import PipelineConfig, Schedule, config_stages, virtual_stages


SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")


def rank_orders(schedule: Schedule, pp: int, microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """The order in which each rank runs its actions under torch's schedule of that name.

    `stages_per_rank` is read by the interleaved schedules only (the V-shaped
    ones always hold 2). Equal to `torch_rank_orders` (see the module docstring).
    """
    if pp < 1 or microbatches < 1 or stages_per_rank < 1:
        raise ValueError(f"pp, microbatches and stages_per_rank must be ≥ 1, got {pp}, {microbatches}, "
                         f"{stages_per_rank}")
    m = microbatches
    if schedule == "gpipe":
        return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(r, pp, m) for r in range(pp)]
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        return [_interleaved(r, pp, m, stages_per_rank, schedule == "interleaved_zb") for r in range(pp)]
    if schedule == "zbv":
        return [_zbv(r, pp, m) for r in range(pp)]
    if schedule == "dualpipev":
        if m < 2 * pp:
            raise ValueError(f"DualPipeV needs at least as many micro-batches as stages (2·pp = {2 * pp}), got {m}")
        return [_dualpipev(r, pp, m) for r in range(pp)]
    raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(map(repr, SCHEDULES))}")


class _Emitter:
    """A rank's order as it is written: numbers each (stage, kind)'s micro-batches in order, as torch does."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self.next: dict[tuple[int, str], int] = defaultdict(int)

    def __call__(self, stage: int, kind: Kind, counter: str | None = None, paired: bool = False) -> Action:
        # `counter` lets a full backward and an input-gradient backward of one stage share their numbering.
        key = (stage, counter or kind)
        action = Action(stage, kind, self.next[key], paired)
        self.next[key] += 1
        self.order.append(action)
        return action


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    # Warm up with enough forwards to fill the pipe below this rank, then alternate
    # (one F, one B) so at most pp - rank micro-batches hold activations, then drain.
    warmup = min(m, pp - rank - 1)
    order = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    return order + [Action(rank, "B", i) for i in range(m - warmup, m)]


def _interleaved(rank: int, pp: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    # Micro-batches go round the v local stages in rounds of `per_round`; forwards walk the local stages
    # upwards, backwards downwards. The warm-up is one round per extra local stage plus, per hop from the last
    # rank, 2 forwards (1F1B: a forward and its backward must cross each hop) or 1 (zero bubble: the backward
    # that comes back is only the short input-gradient half).
    rounds = max(1, m // pp)
    if m % rounds:
        raise ValueError(f"interleaved schedules need microbatches ({m}) to be a multiple of {rounds} (= m // pp)")
    per_round = m // rounds
    hop = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + hop * (pp - 1 - rank), m * v)
    total = m * v

    def fwd_stage(op: int) -> int:
        return (op // per_round) % v * pp + rank

    def bwd_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    emit = _Emitter()
    backwards: list[Action] = []
    weights_done = 0
    for op in range(total + warmup):
        if op < total:
            emit(fwd_stage(op), "F")
        if op >= warmup:
            backwards.append(emit(bwd_stage(op), "I" if zero_bubble else "B"))
            # Rank r holds back its first r weight gradients: they fill the drain at the end.
            if zero_bubble and op - warmup >= rank:
                emit(backwards[weights_done].stage, "W")
                weights_done += 1
    for action in backwards[weights_done:] if zero_bubble else ():
        emit(action.stage, "W")
    return emit.order


def _zbv(rank: int, pp: int, m: int) -> list[Action]:
    # Rank r holds stage `down` = r (on the way down the V) and `up` = 2pp-1-r (on the way back up).
    down, up = rank, 2 * pp - 1 - rank
    n = max(2 * pp - 1, m)  # the phases are written for at least 2pp-1 micro-batches; extras are dropped below
    emit = _Emitter()
    count = emit.next

    def forward_backward(stage: int) -> None:
        emit(stage, "I")
        emit(stage, "W")

    for _ in range(2 * (pp - rank) - 1):
        emit(down, "F")
    for _ in range(rank):
        emit(up, "F")
        emit(down, "F")
    for _ in range(pp - rank):
        emit(up, "F")
        forward_backward(up)
    while count[(up, "F")] < count[(down, "F")] or count[(down, "F")] < n:
        if count[(down, "F")] < n:
            emit(down, "F")
        forward_backward(down)
        emit(up, "F")
        forward_backward(up)
    for _ in range(rank):
        emit(down, "I")
        emit(up, "I")
    for _ in range(pp - rank):
        forward_backward(down)
    for stage in (up, down):
        while count[(stage, "W")] < count[(stage, "I")]:
            emit(stage, "W")
    return [a for a in emit.order if a.microbatch < m]


def _dualpipev(rank: int, pp: int, m: int) -> list[Action]:
    down, up = rank, 2 * pp - 1 - rank
    emit = _Emitter()
    pending_w: list[Action] = []  # input-gradient halves whose weight half is still to run, oldest first

    def backward(stage: int, split: bool) -> None:
        # Full and split backwards of a stage share one micro-batch count; a split one leaves its W pending.
        action = emit(stage, "I" if split else "B", counter="backward")
        if split:
            pending_w.append(action)

    def weight_if_pending() -> None:
        if pending_w:
            done = pending_w.pop(0)
            emit.order.append(Action(done.stage, "W", done.microbatch))

    for _ in range(2 * (pp - rank - 1)):
        emit(down, "F")
    for _ in range(rank + 1):
        emit(down, "F")
        emit(up, "F")
    for _ in range(pp - rank - 1):
        backward(up, split=True)
        weight_if_pending()
        emit(up, "F")
    def pair(forward: int, backward_stage: int) -> None:
        # Run as one unit: the forward's output is sent once the backward is done too.
        emit(forward, "F", paired=True)
        backward(backward_stage, split=False)

    # Steady state: pairs of a forward of one stage and a full backward of the other (the last rank's very
    # first two run unpaired, so the turn of the V is not held up).
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:
            emit(down, "F")
            backward(up, split=False)
        else:
            pair(down, up)
        pair(up, down)
    for _ in range(pp - rank - 1):
        backward(up, split=False)
        pair(up, down)
    # The drain: from its middle on (rank parity decides which stage switches first), backwards split.
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(up, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(down, split)
    for _ in range(pp - rank - 1):
        weight_if_pending()
        backward(down, split)
    for _ in range(rank + 1):
        weight_if_pending()
    return emit.order


def schedule_grid(schedule: Schedule, pp: int, microbatches: int, stages_per_rank: int = 1) -> Grid:
    """The ideal time-step × rank grid of a schedule (each action one step)."""
    v = virtual_stages(schedule, pp, stages_per_rank)
    return place(rank_orders(schedule, pp, microbatches, v), v)


def config_grid(cfg: PipelineConfig) -> Grid:
    """The ideal grid of a Config's pipeline."""
    return schedule_grid(cfg.schedule, cfg.pp, cfg.micro_batches, config_stages(cfg))
