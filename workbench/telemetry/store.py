"""The notebook-side store of what ranks reported, as runs: every apply of a Config starts one, none is erased.

A run is one Config trained on one model: `Workbench.apply` opens it, and the steps trained until the next
apply (or restart, or checkpoint load) belong to it. A run that continues another's weights names it as its
`parent` from its `first_step` on: a reshard continues the run before it; a loaded checkpoint continues the
run that was current, from the checkpoint's step (two branches from one checkpoint are two runs whose steps
share numbers and never mix); a new model (fresh weights, a new shape, a restart) has none. A run's
history is its own steps after its ancestors' steps before each branch point: what the loss plot draws.
Restart and model changes add runs; nothing but `clear()` removes one, except that a run which trained no
step is replaced by the next (applying twice in a row leaves one run, so no two markers share a step).

Beside the steps it keeps the spans ranks report between or across them: checkpoint saves (`CheckpointSave`:
the part that held training, and an asynchronous save's background write) and torch.compile compilations
(`Compilation`, sent when one starts and again when it ends), the latest `max_spans` of each, so the timeline
can draw them and the status line can say "compiling".

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
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from workbench.config import Config
from workbench.telemetry.events import CheckpointSave, Compilation, StepMetrics
from workbench.telemetry.runs import LayoutChange, Recovery, RunRecord, Snapshot

log = logging.getLogger("workbench.telemetry")


class _OpenRun:
    """A run being written: the store's mutable form of a RunRecord."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record  # id, name, config, ...: fixed; by_rank comes from `steps`
        self.steps: dict[int, dict[int, StepMetrics]] = {}
        self.frozen: RunRecord | None = None  # the last copy handed out, until a step changes it

    def freeze(self) -> RunRecord:
        if self.frozen is None:
            by_rank = {r: tuple(sorted(s.values(), key=lambda m: m.step)) for r, s in sorted(self.steps.items())}
            self.frozen = replace(self.record, by_rank=by_rank)
        return self.frozen

    def count(self, rank: int) -> int:
        return len(self.steps.get(rank, {}))


class TelemetryStore:
    """Keeps runs and their StepMetrics per rank; thread-safe; tells subscribers when something arrives.

    max_steps: steps kept per rank over all runs; the oldest runs' oldest steps are dropped beyond it, so a
    long session's memory stays bounded (each step may carry many intervals).
    """

    def __init__(self, max_steps: int = 20_000, max_spans: int = 512) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps: must be ≥ 1, got {max_steps}")
        if max_spans < 1:
            raise ValueError(f"max_spans: must be ≥ 1, got {max_spans}")
        self.max_steps, self.max_spans = max_steps, max_spans
        self._lock = threading.Lock()
        self._runs: list[_OpenRun] = []
        self._models = 0
        self._recoveries: list[Recovery] = []
        self._version = 0
        self._subscribers: list[Callable[[Any], None]] = []
        self._saves: deque[CheckpointSave] = deque(maxlen=max_spans)
        self._compilations: OrderedDict[tuple[int, str, str], Compilation] = OrderedDict()

    # -- writers -----------------------------------------------------------------------------------
    def on_event(self, rank: int, event: Any) -> None:
        """A `Pool.subscribe` callback: keeps StepMetrics, checkpoint saves and compilations, ignores other
        events. Runs on the pool's I/O thread."""
        if isinstance(event, StepMetrics):
            self.add(rank, event)
        elif isinstance(event, (CheckpointSave, Compilation)):
            self.add_span(event)

    def add_span(self, event: CheckpointSave | Compilation) -> None:
        """Keep a checkpoint save, or a compilation's start or end (its end replaces its start)."""
        with self._lock:
            if isinstance(event, CheckpointSave):
                self._saves.append(event)
            else:
                key = (event.rank, event.compile_id, event.trigger)
                self._compilations.pop(key, None)
                self._compilations[key] = event
                while len(self._compilations) > self.max_spans:
                    self._compilations.popitem(last=False)
            self._version += 1
        self._notify(event)

    def start_run(self, config: Config, first_step: int, *, continues: bool, origin: str | None = None,
                  name: str | None = None, predicted_memory: dict[int, dict[str, int]] | None = None) -> RunRecord:
        """Open a run of `config` from `first_step` (Workbench.apply and load call this); later steps belong to it.

        continues: its weights continue the current run's (a reshard; a checkpoint loaded into this lineage),
        which becomes its parent; else it is a new model. A current run that trained nothing is replaced
        rather than kept (its parent and its model are the new run's to continue). predicted_memory: the
        estimate the memory plot draws beside the measurement (`RunRecord.predicted_memory`).
        """
        with self._lock:
            current = self._runs[-1].record if self._runs else None
            replaced = current if current is not None and not self._runs[-1].steps else None
            if replaced is not None:
                self._runs.pop()  # it trained nothing: this run takes its place and its id
                run_id = replaced.id
                parent = self._find(replaced.parent) if continues else None
                model = replaced.model if continues or replaced.parent is None else None
                how = origin or (replaced.origin if continues else None)
            else:
                run_id = current.id + 1 if current is not None else 1
                parent = current if continues else None
                model = current.model if continues and current is not None else None
                how = origin or (f"resharded from run {current.id}" if continues and current is not None else None)
            if model is None:
                self._models += 1
                model = self._models
            record = RunRecord(id=run_id, name=name or f"{run_id} · {config.layout}", config=config, model=model,
                               parent=parent.id if parent is not None else None, origin=how or "new model",
                               started=time.time(), first_step=first_step,
                               predicted_memory=dict(predicted_memory or {}))
            self._runs.append(_OpenRun(record))
            self._version += 1
        self._notify(record)
        return record

    def add_layout_change(self, step: int, config: Config) -> RunRecord:
        """Record that training from `step` on runs in `config`'s layout, continuing the current weights."""
        return self.start_run(config, step, continues=True)

    def _find(self, run_id: int | None) -> RunRecord | None:
        return next((run.record for run in self._runs if run.record.id == run_id), None)

    def add(self, rank: int, metrics: StepMetrics) -> None:
        with self._lock:
            if not self._runs:  # steps before any apply (a pool driven by hand): they still have a home
                self._models += 1
                self._runs.append(_OpenRun(RunRecord(1, f"1 · {metrics.layout or 'unnamed'}", Config(), 1, None,
                                                     "not applied through this store", time.time(), metrics.step)))
            run = self._runs[-1]
            steps = run.steps.setdefault(rank, {})
            # Keyed by step: an event seen twice (a backfill racing the subscription) is stored once.
            steps.pop(metrics.step, None)  # re-inserted last: a restarted count stays in arrival order
            steps[metrics.step] = metrics
            run.frozen = None
            self._evict(rank)
            self._version += 1
        self._notify(metrics)

    def _evict(self, rank: int) -> None:
        total = sum(run.count(rank) for run in self._runs)
        for run in self._runs:
            steps = run.steps.get(rank)
            while steps and total > self.max_steps:
                del steps[next(iter(steps))]
                run.frozen, total = None, total - 1
            if total <= self.max_steps:
                return

    def add_recovery(self, mark: Recovery) -> None:
        """Record that the run recovered by itself (the Workbench calls this, after truncating the lost steps)."""
        with self._lock:
            mark = replace(mark, run=self._runs[-1].record.id if self._runs else None)
            self._recoveries.append(mark)
            self._version += 1
        self._notify(mark)

    def truncate(self, step: int) -> None:
        """Forget the current run's steps from `step` on, on every rank."""
        with self._lock:
            if self._runs:
                run = self._runs[-1]
                for steps in run.steps.values():
                    for s in [s for s in steps if s >= step]:
                        del steps[s]
                run.frozen = None
            self._version += 1
        self._notify(None)

    def clear(self) -> None:
        """Forget every run and span."""
        with self._lock:
            self._runs.clear()
            self._saves.clear()
            self._compilations.clear()
            self._recoveries.clear()
            self._version += 1
        self._notify(None)

    # -- readers -----------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self._version, tuple(run.freeze() for run in self._runs), saves=tuple(self._saves),
                            compilations=tuple(self._compilations.values()), recoveries=tuple(self._recoveries))

    @property
    def runs(self) -> tuple[RunRecord, ...]:
        """Every run, oldest first (frozen copies)."""
        return self.snapshot().runs

    def steps(self, rank: int = 0) -> list[StepMetrics]:
        """One rank's metrics of the current model in step order (a copy)."""
        return list(self.snapshot().steps(rank))

    @property
    def layout_changes(self) -> list[LayoutChange]:
        return list(self.snapshot().layout_changes)

    def compiling(self) -> tuple[Compilation, ...]:
        """Compilations running now (started, no end yet), without copying the runs: the status line's timer asks."""
        with self._lock:
            return tuple(c for c in self._compilations.values() if c.end_ns is None)

    @property
    def recoveries(self) -> list[Recovery]:
        with self._lock:
            return list(self._recoveries)

    def __len__(self) -> int:
        """Steps stored for rank 0, for the current model."""
        return len(self.snapshot().steps(0))

    # -- subscribers -------------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        """Call callback(record) after each change (the new StepMetrics, RunRecord, CheckpointSave or
        Compilation; None on clear).

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
        return f"TelemetryStore(runs={len(snap.runs)}, ranks={snap.ranks}, steps={len(snap.steps(0))})"
