"""The notebook-side store of what ranks reported: every rank's StepMetrics and where the layout changed.

Events arrive on the pool's I/O thread while plots read from a timer thread
and cells read from the kernel's thread, so every access goes through one
lock, and readers get an immutable `Snapshot` instead of live lists.

A Workbench owns one, fed by the pool:

    self.store = TelemetryStore()
    self.pool.subscribe(self.store.on_event)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workbench.config import Config
from workbench.telemetry.events import StepMetrics

log = logging.getLogger("workbench.telemetry")


@dataclass(frozen=True, slots=True)
class LayoutChange:
    """Where in the run a layout took effect (the first step trained in it): the loss plot marks these."""

    step: int
    config: Config

    @property
    def layout(self) -> str:
        return self.config.layout


@dataclass(frozen=True, slots=True)
class Recovery:
    """Where a run recovered by itself from a failed rank (`train(recover=True)`): the loss plot marks these."""

    step: int
    """The step it went back to (its latest snapshot) and trained again from."""
    replayed: int
    """Steps trained after `step` before the failure: lost with the ranks, and trained again."""
    reason: str
    """The failure, in one line (which rank, what happened)."""
    seconds: float
    """From the failure's report to training again (restart, layout, snapshot restored)."""


@dataclass(frozen=True)
class Snapshot:
    """What the store held at one instant; safe to read from any thread."""

    version: int
    """Grows with every change: a reader that saw this version has nothing new to draw."""
    by_rank: dict[int, tuple[StepMetrics, ...]]
    """Each rank's metrics in step order."""
    layout_changes: tuple[LayoutChange, ...]
    recoveries: tuple[Recovery, ...] = ()

    @property
    def ranks(self) -> list[int]:
        return sorted(self.by_rank)

    def steps(self, rank: int = 0) -> tuple[StepMetrics, ...]:
        return self.by_rank.get(rank, ())

    def latest(self) -> dict[int, StepMetrics]:
        """Each rank's last reported step."""
        return {r: ms[-1] for r, ms in self.by_rank.items() if ms}

    def common_latest(self) -> dict[int, StepMetrics]:
        """The metrics of the newest step that every rank has reported, so ranks are compared on one step.

        Falls back to each rank's own latest when the ranks share no step (e.g. only one has reported).
        """
        shared = None
        for ms in self.by_rank.values():
            steps = {m.step for m in ms}
            shared = steps if shared is None else shared & steps
        if not shared:
            return self.latest()
        step = max(shared)
        return {r: next(m for m in reversed(ms) if m.step == step) for r, ms in self.by_rank.items()}

    @property
    def config(self) -> Config | None:
        """The layout in force now (the last change), if any was recorded."""
        return self.layout_changes[-1].config if self.layout_changes else None


class TelemetryStore:
    """Keeps StepMetrics per rank and layout changes; thread-safe; tells subscribers when something arrives.

    max_steps: steps kept per rank; the oldest are dropped beyond it, so a
    long session's memory stays bounded (each step may carry many intervals).
    """

    def __init__(self, max_steps: int = 20_000) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps: must be ≥ 1, got {max_steps}")
        self.max_steps = max_steps
        self._lock = threading.Lock()
        # Keyed by step: an event seen twice (a backfill racing the subscription) is stored once.
        self._by_rank: dict[int, dict[int, StepMetrics]] = {}
        self._layouts: list[LayoutChange] = []
        self._recoveries: list[Recovery] = []
        self._version = 0
        self._subscribers: list[Callable[[Any], None]] = []

    # -- writers -----------------------------------------------------------------------------------
    def on_event(self, rank: int, event: Any) -> None:
        """A `Pool.subscribe` callback: keeps StepMetrics, ignores other events. Runs on the pool's I/O thread."""
        if isinstance(event, StepMetrics):
            self.add(rank, event)

    def add(self, rank: int, metrics: StepMetrics) -> None:
        with self._lock:
            steps = self._by_rank.setdefault(rank, {})
            steps.pop(metrics.step, None)  # re-inserted last: a restarted count stays in arrival order
            steps[metrics.step] = metrics
            while len(steps) > self.max_steps:
                del steps[next(iter(steps))]
            self._version += 1
        self._notify(metrics)

    def add_layout_change(self, step: int, config: Config) -> None:
        """Record that training from `step` on runs in `config`'s layout (Workbench.apply calls this)."""
        mark = LayoutChange(step, config)
        with self._lock:
            self._layouts.append(mark)
            self._version += 1
        self._notify(mark)

    def add_recovery(self, mark: Recovery) -> None:
        """Record that the run recovered by itself (the Workbench calls this, after truncating the lost steps)."""
        with self._lock:
            self._recoveries.append(mark)
            self._version += 1
        self._notify(mark)

    def truncate(self, step: int) -> None:
        """Forget every rank's steps from `step` on (they will be trained again, e.g. after loading a checkpoint)."""
        with self._lock:
            for steps in self._by_rank.values():
                for s in [s for s in steps if s >= step]:
                    del steps[s]
            self._version += 1
        self._notify(None)

    def clear(self) -> None:
        with self._lock:
            self._by_rank.clear()
            self._layouts.clear()
            self._recoveries.clear()
            self._version += 1
        self._notify(None)

    # -- readers -----------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def snapshot(self) -> Snapshot:
        with self._lock:
            by_rank = {r: tuple(sorted(steps.values(), key=lambda m: m.step)) for r, steps in self._by_rank.items()}
            return Snapshot(self._version, by_rank, tuple(self._layouts), tuple(self._recoveries))

    def steps(self, rank: int = 0) -> list[StepMetrics]:
        """One rank's metrics in step order (a copy)."""
        return list(self.snapshot().steps(rank))

    @property
    def layout_changes(self) -> list[LayoutChange]:
        with self._lock:
            return list(self._layouts)

    @property
    def recoveries(self) -> list[Recovery]:
        with self._lock:
            return list(self._recoveries)

    def __len__(self) -> int:
        """Steps stored for rank 0."""
        with self._lock:
            return len(self._by_rank.get(0, {}))

    # -- subscribers -------------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        """Call callback(record) after each change (the new StepMetrics or LayoutChange, None on clear).

        It runs on the writer's thread (usually the pool's I/O thread): keep it short, e.g. set an Event.
        Returns a function that unsubscribes.
        """
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _notify(self, record: Any) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            # Outside the lock: a callback may read the store.
            try:
                callback(record)
            except Exception:  # noqa: BLE001 - one bad subscriber must not stop telemetry for the others
                log.exception("telemetry store subscriber failed")

    def __repr__(self) -> str:
        snap = self.snapshot()
        return f"TelemetryStore(ranks={snap.ranks}, steps={len(snap.steps(0))}, layouts={len(snap.layout_changes)})"
