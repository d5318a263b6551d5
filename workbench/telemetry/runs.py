"""What the notebook keeps of training, as read-only records: runs (`RunRecord`), where a layout took effect
(`LayoutChange`), recoveries (`Recovery`), and `Snapshot`, the whole store at one instant, safe to read from any
thread. `workbench.telemetry.store.TelemetryStore` writes them (its docstring tells what a run is)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from workbench.config import Config
from workbench.telemetry.events import CheckpointSave, Compilation, StepMetrics


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
    (`workbench.compare.predicted_memory`); empty where there is no estimate to show."""

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
