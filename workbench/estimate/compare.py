"""Predicted beside measured: an estimate and the StepMetrics of the same layout, quantity by quantity, with errors.

Pure: the dashboard and `bench.report()` show these rows; nothing here touches a rank or a widget. Measured
figures are the most loaded rank's (the largest over ranks), as the estimate's are its most loaded stage's; each
rank's last step is read (the first steps warm up). What each row compares:
- memory by category: parameters and optimizer state as they rest between steps (StepMetrics.memory, read at the
  step's end: mid-step the telemetry counts FSDP2's gathered parameters as parameters, the estimate as buffers),
  gradients and activations at their peak (StepMetrics.peak_memory); the telemetry's "other" is the rest of the
  process, which the estimate does not model, so it is left out;
- step time, its compute and its exposed communication: Estimate.step_time_s, compute_s, exposed_comm_s against
  StepMetrics.step_time_s, step_time_s - exposed_comm_s, exposed_comm_s;
- communication bytes per collective kind: the estimate's payload per step (nccl-tests' size, `Collective.bytes`)
  against the recorded intervals' `Interval.bytes`, summed by kind (a pipeline's send_recv is its sends). The
  trainer's one world all-reduce per step (the loss and votes, a few bytes) is measured, not estimated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Literal

from workbench.estimate.records import Estimate
from workbench.telemetry.events import StepMetrics

AT_REST = ("parameters", "optimizer")
AT_PEAK = ("gradients", "activations")


@dataclass(frozen=True)
class Comparison:
    """One quantity, predicted and measured."""

    quantity: str
    """What is compared, e.g. "memory: activations", "step time: compute", "bytes: all_gather"."""
    unit: Literal["B", "s"]
    predicted: float
    measured: float

    @property
    def error(self) -> float | None:
        """predicted / measured - 1; None where either side is zero (nothing to compare against)."""
        if not self.predicted or not self.measured:
            return None
        return self.predicted / self.measured - 1

    @property
    def error_pct(self) -> float | None:
        return None if self.error is None else 100 * self.error


def compare(est: Estimate, metrics: Iterable[StepMetrics]) -> tuple[Comparison, ...]:
    """Rows of (quantity, predicted, measured, error) for `est` and the measured steps of its layout."""
    last: dict[int, StepMetrics] = {}
    for m in metrics:
        if m.rank not in last or m.step >= last[m.rank].step:
            last[m.rank] = m
    if not last:
        raise ValueError("compare needs the StepMetrics of at least one step")
    steps = list(last.values())
    rows = []
    memory = est.memory
    for category in (*AT_REST, *AT_PEAK):
        read = (lambda m: m.memory) if category in AT_REST else (lambda m: m.peak_memory)
        measured = max(read(m).get(category, 0) for m in steps)
        rows.append(Comparison(f"memory: {category}", "B", getattr(memory, category), measured))
    slowest = max(steps, key=lambda m: m.step_time_s)
    rows += [
        Comparison("step time", "s", est.step_time_s, slowest.step_time_s),
        Comparison("step time: compute", "s", est.compute_s, slowest.step_time_s - slowest.exposed_comm_s),
        Comparison("step time: exposed communication", "s", est.exposed_comm_s,
                   max(m.exposed_comm_s for m in steps)),
    ]
    predicted = _by_kind((c.kind, c.bytes) for c in est.comm)
    measured_by_rank = [_by_kind((iv.name, iv.bytes) for iv in m.intervals if iv.kind == "comm") for m in steps]
    kinds = sorted(set(predicted) | {k for r in measured_by_rank for k in r})
    for kind in kinds:
        rows.append(Comparison(f"bytes: {kind}", "B", predicted.get(kind, 0),
                               max(r.get(kind, 0) for r in measured_by_rank)))
    return tuple(rows)


def _by_kind(pairs: Iterable[tuple[str, int]]) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for kind, nbytes in pairs:
        # A stage's sends are what it contributes to the pipeline's send_recv; what it receives is the others'.
        if kind == "recv":
            continue
        totals["send" if kind == "send_recv" else kind] += nbytes
    return dict(totals)
