"""A run on the ranks, from the notebook: starting one (plain, or recovering by itself), and `Run`, its handle.

    run = bench.train(steps=200)    # returns at once
    run.progress(); run.stop(); run.wait()
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from workbench.config import ConfigError
from workbench.pool import Handle
from workbench.telemetry.events import StepMetrics

if TYPE_CHECKING:
    from workbench.checkpoints import SaveSchedule
    from workbench.workbench import Workbench


def check_steps(steps: int, recover: bool, snapshot_every: int) -> None:
    """Refuse a step count (or, recovering, a snapshot interval) that is not a positive integer."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps: must be a positive integer, got {steps!r}. Fix: pass e.g. steps=100.")
    if recover and (isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1):
        raise ConfigError(f"snapshot_every: must be a positive integer, got {snapshot_every!r}. "
                          "Fix: pass e.g. snapshot_every=10.")


def start(bench: "Workbench", steps: int, saves: "SaveSchedule | None", *, recover: bool, snapshot_every: int,
          max_failures: int) -> "Run":
    """Start `steps` steps on `bench`'s ranks in the background: one command, or the chunks, snapshots and restarts
    of a run that recovers by itself (`workbench.recovery`)."""
    # Unique beyond this Workbench: a stop request is a flag on the ranks, which outlive it.
    run_id = secrets.token_hex(8)
    if recover:
        from workbench.recovery import RecoveringRun

        handle: Any = RecoveringRun(bench, steps, run_id, saves, snapshot_every, max_failures)
    else:
        handle = bench.session.train(steps, run_id, saves)
    return Run(bench, handle, run_id, steps, next_step(bench))


def next_step(bench: "Workbench") -> int:
    """The step the model on `bench`'s ranks trains next, as its store saw it."""
    current = bench.store.snapshot().current
    if current is None:
        return 0
    steps = current.steps(0)
    return steps[-1].step + 1 if steps else current.first_step


class Run:
    """Training running in the background on the ranks; the notebook stays free."""

    def __init__(self, bench: "Workbench", handle: Handle, run_id: str, steps: int, first_step: int = 0) -> None:
        self._bench, self._handle, self.id, self.steps = bench, handle, run_id, steps
        self.first_step = first_step
        """The step it started at."""
        self._started = time.monotonic()

    def progress(self):
        """How far it is: `Progress(done, total, eta_s)`, from the steps the ranks have reported so far."""
        from workbench.telemetry.run_summary import progress

        done = sum(1 for m in self._bench.history if m.step >= self.first_step)
        return progress(done, self.steps, time.monotonic() - self._started, finished=self.done)

    @property
    def done(self) -> bool:
        return self._handle.done()

    def wait(self, timeout: float | None = None) -> list[StepMetrics]:
        """Block until the run ends; rank 0's metrics, one per step (a rank's failure is raised here)."""
        return self._handle.result(timeout)[0]

    def stop(self, timeout: float | None = None) -> list[StepMetrics]:
        """End the run at the next step boundary, every rank at the same step; returns what ran."""
        if hasattr(self._handle, "stop"):  # a run that recovers by itself: no new chunk either
            self._handle.stop()
        self._bench.pool.set_flag("stop", self.id)
        return self.wait(timeout)

    def __repr__(self) -> str:
        return f"Run(id={self.id}, steps={self.steps}, done={self.done})"
