"""Bytes the data-parallel gradient sync sent in one step, from the collectives the recording backend saw.

Pure arithmetic over a step's `Interval`s (no torch), so it is tested without processes and the
step probe attaches the figure to `StepMetrics.grad_sync_bytes`; the UI only draws it.

Which collectives are the gradient sync: those on the dp group, of the kinds the layout's gradient
sync issues. DDP (zero 0/1), with or without a compression hook: every collective on the dp group but
"broadcast" (ZeRO-1's parameter broadcast after its sharded step). FSDP2 (zero 2/3): "reduce_scatter"
only (its "all_gather"s gather parameters). The step's closing vote (a world all-reduce)
may share the dp group (a 1-D mesh reuses the world group), so only collectives that started before
`before_ns` (the step probe passes the vote's start) count; ZeRO-1's broadcasts come after it too.
"""

from __future__ import annotations

from collections.abc import Iterable

from workbench.telemetry.analysis import bus_factor
from workbench.telemetry.events import Interval

_NOT_GRADIENT_SYNC = {"broadcast"}


def is_gradient_sync(iv: Interval, dp_group: str, zero: int, before_ns: int | None = None) -> bool:
    if iv.kind != "comm" or iv.group != dp_group or (before_ns is not None and iv.start_ns >= before_ns):
        return False
    if zero >= 2:
        return iv.name == "reduce_scatter"
    return iv.name not in _NOT_GRADIENT_SYNC


def grad_sync_payload_bytes(intervals: Iterable[Interval], dp_group: str, zero: int,
                            before_ns: int | None = None) -> int:
    """Sum of the gradient-sync collectives' sizes as nccl-tests counts them (`Interval.bytes`)."""
    return sum(iv.bytes for iv in intervals if is_gradient_sync(iv, dp_group, zero, before_ns))


def grad_sync_bytes(intervals: Iterable[Interval], dp_group: str, zero: int, before_ns: int | None = None) -> int:
    """Bytes this rank sent for the gradient sync: each collective's size times its bus factor."""
    return round(sum(iv.bytes * bus_factor(iv.name, iv.group_size)
                     for iv in intervals if is_gradient_sync(iv, dp_group, zero, before_ns)))
