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
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from workbench.config import Config
from workbench.telemetry.events import CheckpointSave, Compilation, StepMetrics

log = logging.getLogger("workbench.telemetry")


@dataclass(frozen=True, slots=True)
class LayoutChange:
    """Where in a model's training a layout took effect (the first step trained in it): the loss plot marks these."""

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
    run: int | None = None
    """The id of the run it happened in (the store sets it): the loss plot marks it on that run's history only."""


@dataclass(frozen=True)
class RunRecord:
    """One run: a Config applied to a model, and every rank's steps trained in it (a frozen copy)."""

    id: int
    """1, 2, ... in the order the runs started."""
    name: str
    """The name it was given (`bench.apply(cfg, run="aux 0.1")`), else "<id> · <layout>"."""
    config: Config
    model: int
    """Which model it trained: 1, 2, ... for each new set of weights; runs continuing one another share it."""
    parent: int | None
    """The run whose weights it continues (from `first_step` on), or None for a new model."""
    origin: str
    """How it began: "new model", "resharded from run 3", "loaded <checkpoint>", "ranks restarted", ..."""
    started: float
    """Wall-clock time (time.time()) when it was applied."""
    first_step: int
    """The step it starts at (a resharded run continues its model's count; a new model starts at 0)."""
    by_rank: dict[int, tuple[StepMetrics, ...]] = field(default_factory=dict)
    """Each rank's metrics in step order."""
    predicted_memory: dict[int, dict[str, int]] = field(default_factory=dict)
    """Each rank's memory by category as the estimator predicts it for this layout on these ranks' hardware
    (`workbench.estimate.compare.predicted_memory`); empty where there is no estimate to show."""

    @property
    def layout(self) -> str:
        return self.config.layout

    def steps(self, rank: int = 0) -> tuple[StepMetrics, ...]:
        return self.by_rank.get(rank, ())

    def before(self, step: int) -> "RunRecord":
        """This run with only its steps before `step` (what a run branching off at `step` inherits)."""
        return replace(self, by_rank={r: tuple(m for m in ms if m.step < step) for r, ms in self.by_rank.items()})

    def __repr__(self) -> str:
        return f"RunRecord({self.id}, {self.name!r}, {self.origin}, steps={len(self.steps(0))})"


@dataclass(frozen=True)
class Snapshot:
    """What the store held at one instant; safe to read from any thread.

    The plain readers (`steps`, `by_rank`, `latest`, `layout_changes`, `config`) speak of the current run's
    history (`lineage`). `runs` holds every run; `picked` those a user chose to draw beside it.
    """

    version: int
    """Grows with every change: a reader that saw this version has nothing new to draw."""
    runs: tuple[RunRecord, ...] = ()
    """Every run, oldest first; the last is the current one."""
    compared: tuple[int, ...] = ()
    """Ids of runs a user picked to draw beside the current run's history (`compare`)."""
    saves: tuple[CheckpointSave, ...] = ()
    """The latest checkpoint saves every rank reported, in arrival order (each when it was durable or failed)."""
    compilations: tuple[Compilation, ...] = ()
    """The latest compilations on every rank, one record each: its end once reported, else its start."""
    recoveries: tuple[Recovery, ...] = ()
    """Where runs recovered by themselves from a failed rank (`train(recover=True)`), oldest first."""

    @property
    def current(self) -> RunRecord | None:
        return self.runs[-1] if self.runs else None

    @cached_property
    def lineage(self) -> tuple[RunRecord, ...]:
        """The current run's history, oldest first: its ancestors, each with only the steps before its child
        branched off, then the current run itself."""
        chain: list[RunRecord] = []
        run, until = self.current, None
        by_id = {r.id: r for r in self.runs}
        while run is not None:
            chain.append(run if until is None else run.before(until))
            run, until = by_id.get(run.parent) if run.parent is not None else None, run.first_step
        return tuple(reversed(chain))

    @property
    def picked(self) -> tuple[RunRecord, ...]:
        """The runs picked to compare (`compare`), whole, oldest first; the current run is drawn as the history."""
        ids = set(self.compared)
        return tuple(r for r in self.runs if r.id in ids and r is not self.current)

    def compare(self, run_ids: tuple[int, ...] | list[int]) -> "Snapshot":
        """This snapshot with `run_ids` overlaid too (what the dashboard's run picker chose)."""
        return replace(self, compared=tuple(run_ids))

    def run(self, run_id: int) -> RunRecord:
        return next(r for r in self.runs if r.id == run_id)

    @cached_property
    def by_rank(self) -> dict[int, tuple[StepMetrics, ...]]:
        """The current run's history per rank in step order (its ancestors' steps, then its own)."""
        out: dict[int, list[StepMetrics]] = {}
        for run in self.lineage:
            for rank, steps in run.by_rank.items():
                out.setdefault(rank, []).extend(steps)
        return {r: tuple(ms) for r, ms in out.items()}

    @property
    def ranks(self) -> list[int]:
        return sorted(self.by_rank)

    def steps(self, rank: int = 0) -> tuple[StepMetrics, ...]:
        return self.by_rank.get(rank, ())

    def latest(self) -> dict[int, StepMetrics]:
        """Each rank's last reported step."""
        return {r: ms[-1] for r, ms in self.by_rank.items() if ms}

    def common_latest(self, run: RunRecord | None = None) -> dict[int, StepMetrics]:
        """The metrics of the newest step that every rank has reported (in the current history, or in `run`), so
        ranks are compared on one step.

        Falls back to each rank's own latest when the ranks share no step (e.g. only one has reported).
        """
        by_rank = self.by_rank if run is None else run.by_rank
        shared = None
        for ms in by_rank.values():
            steps = {m.step for m in ms}
            shared = steps if shared is None else shared & steps
        if not shared:
            return {r: ms[-1] for r, ms in by_rank.items() if ms}
        step = max(shared)
        return {r: next(m for m in reversed(ms) if m.step == step) for r, ms in by_rank.items()}

    @property
    def layout_changes(self) -> tuple[LayoutChange, ...]:
        """Where each layout took effect in the current run's history."""
        return tuple(LayoutChange(r.first_step, r.config) for r in self.lineage)

    @property
    def config(self) -> Config | None:
        """The layout in force now (the current run's), if any was applied."""
        return self.current.config if self.current else None

    @property
    def compiling(self) -> tuple[Compilation, ...]:
        """Compilations that started and have not reported their end (a rank compiling now)."""
        return tuple(c for c in self.compilations if c.end_ns is None)


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
