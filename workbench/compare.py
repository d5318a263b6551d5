"""Predicted beside measured: an estimate and the StepMetrics of the same layout, quantity by quantity, with errors.

Pure: the dashboard and `bench.report()` show these rows; nothing here touches a rank or a widget. Measured
figures are the most loaded rank's (the largest over ranks), as the estimate's are its most loaded stage's; each
rank's last step is read (the first steps warm up). What each row compares:
- memory by category: parameters and optimizer state as they rest between steps (StepMetrics.memory, read at the
  step's end: mid-step the telemetry counts FSDP2's gathered parameters as parameters, the estimate as buffers),
  gradients and activations at their peak (StepMetrics.peak_memory); the telemetry's "other" is the rest of the
  process, which the estimate does not model, so it is left out;
- step time, its compute and its exposed communication: Estimate.step_time_s, the busiest stage's compute and the
  rest of the step against StepMetrics.step_time_s, step_time_s - exposed_comm_s, exposed_comm_s (a pipeline's
  ranks wait out the bubble as they wait for a receive, so there the bubble is part of the waiting row);
- communication bytes per collective kind: the estimate's payload per step (nccl-tests' size, `Collective.bytes`)
  against the recorded intervals' `Interval.bytes`, summed by kind (a pipeline's send_recv is its sends). The
  trainer's one world all-reduce per step (the loss and votes, a few bytes) is measured, not estimated.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Literal

from workbench.config import ConfigError
from workbench.estimate.records import Estimate
from workbench.telemetry.events import StepMetrics

if TYPE_CHECKING:
    from workbench.config import Config

log = logging.getLogger("workbench")

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
    measured_step: int | None = None
    """Set where the measured figure is older than the last step: the step it was measured at (the activation
    meter samples a settled layout's steps, `StepMetrics.activations_step`)."""

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
        most = max(steps, key=lambda m: measured_memory(m, category))
        when = most.activations_step if category == "activations" else None
        rows.append(Comparison(f"memory: {category}", "B", getattr(memory, category), measured_memory(most, category),
                               when if when is not None and when != most.step else None))
    # A rank measures its own compute and, as waiting, the communication it could not hide and (in a pipeline) the
    # bubble; the estimate's compute_s carries the bubble, so its own compute is the busiest stage's, and the
    # rest of its step is the waiting.
    own_s = max(stage.compute_s for stage in est.stages)
    waiting = "step time: exposed communication" + (" and bubble" if len(est.stages) > 1 else "")
    rows += [
        Comparison("step time", "s", est.step_time_s, max(m.step_time_s for m in steps)),
        Comparison("step time: compute", "s", own_s, max(m.step_time_s - m.exposed_comm_s for m in steps)),
        Comparison(waiting, "s", est.step_time_s - own_s, max(m.exposed_comm_s for m in steps)),
    ]
    predicted = _by_kind((c.kind, c.bytes) for c in est.comm)
    measured_by_rank = [_by_kind((iv.name, iv.bytes) for iv in m.intervals if iv.kind == "comm") for m in steps]
    kinds = sorted(set(predicted) | {k for r in measured_by_rank for k in r})
    for kind in kinds:
        rows.append(Comparison(f"bytes: {kind}", "B", predicted.get(kind, 0),
                               max(r.get(kind, 0) for r in measured_by_rank)))
    return tuple(rows)


def measured_memory(m: StepMetrics, category: str) -> int:
    """The bytes of `category` a rank measured, read as the estimate predicts them: parameters and optimizer at
    rest (the end of the step), gradients and activations at their peak."""
    return (m.memory if category in AT_REST else m.peak_memory).get(category, 0)


def predicted_memory(est: Estimate, cfg: "Config") -> dict[int, dict[str, int]]:
    """Each rank's memory in the telemetry's categories as `est` (the estimate of `cfg`) predicts it, read as
    `compare` reads the measured ones: parameters and optimizer at rest, gradients and activations at their peak.
    A rank's figures are its pipeline stage's (every rank of a stage looks the same); "other", the rest of the
    process, is not modelled and is absent. What the memory plot draws beside each rank's measured bars."""
    mesh = cfg.degrees.mesh_layout()
    return {rank: {category: getattr(est.stages[mesh.coordinate(rank)["pp"]].memory, category)
                   for category in (*AT_REST, *AT_PEAK)} for rank in range(mesh.world_size)}


def predicted_memory_on(cfg: "Config", capabilities: dict) -> dict[int, dict[str, int]]:
    """Each rank's memory as the estimator predicts it for `cfg` on ranks of `capabilities` (their device, as the
    Workbench asked it), for the memory plot; {} where no hardware profile describes the device, or the estimator
    cannot price the layout there (the ranks already hold it: a missing prediction must not undo it)."""
    from workbench.hardware import cpu_with_peak, profile_for
    from workbench.tracing.estimate import estimate  # any model: traced where it is not the built-in one

    profile = profile_for(capabilities["device"], capabilities.get("name", ""))
    if profile is None:
        return {}
    # The CPU model's memory does not read the matmul peak; the ranks measure it with their first steps.
    hardware = cpu_with_peak(cfg.precision, 1.0) if profile == "cpu" else profile
    try:
        return predicted_memory(estimate(cfg, hardware), cfg)
    except ConfigError as e:  # what the estimator says it cannot price: why, in one line
        log.warning("no memory estimate for %s: %s", cfg.layout, e)
        return {}
    except Exception:  # noqa: BLE001 - shown beside the measured memory when there is one; nothing else hangs on it
        log.warning("no memory estimate for %s", cfg.layout, exc_info=True)
        return {}


def _by_kind(pairs: Iterable[tuple[str, int]]) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for kind, nbytes in pairs:
        # A stage's sends are what it contributes to the pipeline's send_recv; what it receives is the others'.
        if kind == "recv":
            continue
        totals["send" if kind == "send_recv" else kind] += nbytes
    return dict(totals)
