"""torch's own order: a schedule object's `pipeline_order`, read as our actions.

`orders_from_torch` reads it without importing torch (the engine's runner has
the schedule object); `torch_rank_orders` builds the schedule object over
stand-in stages, without processes, to ask it (imports torch, so it is never
on the notebook kernel's path).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workbench.schedules.grid import Action
from workbench.schedules.layout import Schedule, placement, stages_of_rank, virtual_stages
from workbench.schedules.orders import SCHEDULES


TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                 "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                 "dualpipev": "ScheduleDualPipeV"}
"""Our schedule names → torch.distributed.pipelining's classes."""
SINGLE_STAGE = ("gpipe", "1f1b")
"""Schedules whose torch class takes one stage (the others take this rank's list of stages)."""


def orders_from_torch(pipeline_order: Mapping[int, Sequence[Any]]) -> list[list[Action]]:
    """Each rank's compute actions in a torch schedule's `pipeline_order` (its IR: `_Action`s, None for idle
    steps, and actions this grid does not draw, such as REDUCE_GRAD or sends), read without importing torch.

    An OVERLAP_F_B action (DualPipeV's forward paired with a backward) becomes its two sub-actions in the order
    torch's runtime runs them, the first marked `paired` (torch sends both results after the pair). Forwards
    are numbered by order of appearance per stage: every torch schedule runs a stage's forwards in micro-batch
    order, and torch 2.13's Schedule1F1B IR numbers the last rank's forwards 1..m although it runs 0..m-1
    (where the IR is right this changes nothing). Backwards and their halves keep the IR's micro-batch, which
    is what the runtime passes to the stage.
    """
    orders = []
    for rank in sorted(pipeline_order):
        forwards: dict[int, int] = defaultdict(int)
        order = []
        for action, paired in _compute_actions(pipeline_order[rank]):
            kind = action.computation_type.value
            if kind == "F":
                order.append(Action(action.stage_index, "F", forwards[action.stage_index], paired))
                forwards[action.stage_index] += 1
            else:
                order.append(Action(action.stage_index, kind, action.microbatch_index, paired))
        orders.append(order)
    return orders


def _compute_actions(actions: Sequence[Any]) -> list[tuple[Any, bool]]:
    """(action, paired) for each compute action, OVERLAP_F_B's sub-actions in the order torch runs them."""
    out = []
    for action in actions:
        kind = getattr(getattr(action, "computation_type", None), "value", None)
        if kind == "OVERLAP_F_B":
            subs = _compute_actions(action.sub_actions)
            out += [(sub, i < len(subs) - 1) for i, (sub, _) in enumerate(subs)]
        elif kind in ("F", "B", "I", "W"):
            out.append((action, False))
    return out


@functools.lru_cache(maxsize=256)
def torch_rank_orders(schedule: Schedule, pp: int, microbatches: int,
                      stages_per_rank: int = 1) -> tuple[tuple[Action, ...], ...]:
    """What torch.distributed.pipelining's schedule of that name orders, asked of the schedule object itself.

    Built over stand-in stages (a schedule computes `pipeline_order` in its
    constructor from the stages' indices and group size, before any
    communication), so it needs no process group; it imports torch (seconds
    on first use), which is why the kernel-side callers use `rank_orders`.
    """
    if schedule not in TORCH_CLASSES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(map(repr, SCHEDULES))}")
    import torch.distributed.pipelining as pipelining

    v = virtual_stages(schedule, max(pp, 2), stages_per_rank)
    stages = [_StandInStage(s, pp * v, pp) for s in stages_of_rank(0, pp, v, placement(schedule))]
    cls = getattr(pipelining, TORCH_CLASSES[schedule])
    built = cls(stages[0] if schedule in SINGLE_STAGE else stages, microbatches)
    return tuple(tuple(order) for order in orders_from_torch(built.pipeline_order))


@dataclass
class _StandInStage:
    """What a torch schedule's constructor reads of rank 0's stage(s) to lay out every rank's order."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: Any = None
    stage_index_to_group_rank: Any = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1
