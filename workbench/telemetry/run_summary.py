"""One line per run: what it was (layout, model, how it began) and what it measured (tokens/s, step time, memory).

Pure: from the store's frozen `RunRecord`s to `RunSummary` values and a table of them, with no widgets and no
torch. `bench.runs` and `bench.report()` show these; the report and the dashboard only lay them out.

Predictions beside the measurements: `summaries(runs, beside=fn)` adds `fn(run)`'s columns (a mapping of
column name to value) to every run's row. The estimator's comparison of a Config's prediction with a run's
measurements plugs in there, in one place (`Workbench.runs` / `Workbench.report`), when it lands.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from workbench.config import ModelConfig
from workbench.telemetry.events import MEMORY_CATEGORIES
from workbench.telemetry.runs import RunRecord

Beside = Callable[[RunRecord], Mapping[str, Any]]
"""Extra columns for a run's row, e.g. the estimator's predicted figures beside the measured ones."""


@dataclass(frozen=True)
class RunSummary:
    """A run in figures. Means are over the steps rank 0 trained in it (skipped steps left out); each memory
    category's peak is its largest over every step and rank (the rank that runs out first is what matters)."""

    id: int
    name: str
    layout: str
    model: str
    """The model's preset name, or its shape when it is none."""
    weights: int
    """The store's model number: runs sharing it continued one set of weights."""
    origin: str
    started: str
    """Local wall-clock time the run was applied, "HH:MM:SS"."""
    steps: int
    first_step: int
    last_loss: float | None
    tokens_per_s: float | None
    step_time_s: float | None
    mfu: float | None
    """Mean MFU of rank 0, or None when it was not measured."""
    mfu_basis: str
    peak_memory: dict[str, int] = field(default_factory=dict)
    """Peak bytes by category, the largest over steps and ranks; empty when telemetry was off."""
    beside: dict[str, Any] = field(default_factory=dict)
    """Columns added by a `Beside` function (predictions), in its order."""

    def row(self) -> dict[str, Any]:
        """The summary as one flat table row (column → value), memory in MiB."""
        out: dict[str, Any] = {
            "run": self.id, "name": self.name, "layout": self.layout, "model": self.model, "weights": self.weights,
            "origin": self.origin, "started": self.started, "steps": self.steps, "from step": self.first_step,
            "last loss": self.last_loss, "tokens/s": self.tokens_per_s,
            "step ms": None if self.step_time_s is None else self.step_time_s * 1e3, "MFU": self.mfu,
        }
        for cat in MEMORY_CATEGORIES:
            value = self.peak_memory.get(cat)
            out[f"peak {cat} MiB"] = None if value is None else value / 2**20
        return {**out, **self.beside}


def model_name(model: ModelConfig) -> str:
    """A preset's name when the shape is one (routing settings aside), else the shape in brief; a model source's
    own name (`HFModel`, `CustomModel`)."""
    return model.name


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(run: RunRecord, beside: Beside | None = None) -> RunSummary:
    """The figures of one run (see RunSummary for what each mean and peak covers)."""
    steps = run.steps(0)
    trained = [m for m in steps if not m.skipped]
    with_mfu = [m for m in trained if m.mfu is not None]
    peak: dict[str, int] = {}
    for metrics in run.by_rank.values():
        for m in metrics:
            for cat, value in m.peak_memory.items():
                peak[cat] = max(peak.get(cat, 0), value)
    return RunSummary(
        id=run.id, name=run.name, layout=run.layout, model=model_name(run.config.model), weights=run.model,
        origin=run.origin, started=datetime.datetime.fromtimestamp(run.started).strftime("%H:%M:%S"),
        steps=len(steps), first_step=run.first_step, last_loss=steps[-1].loss if steps else None,
        tokens_per_s=_mean([m.tokens_per_s for m in trained]), step_time_s=_mean([m.step_time_s for m in trained]),
        mfu=_mean([m.mfu for m in with_mfu]), mfu_basis=with_mfu[-1].mfu_basis if with_mfu else "",
        peak_memory=peak, beside=dict(beside(run)) if beside is not None else {})


def summaries(runs: Iterable[RunRecord], beside: Beside | None = None) -> list[RunSummary]:
    return [summarize(run, beside) for run in runs]


class RunRows(list):
    """The runs as a list of row dicts, printed as an aligned table (what `bench.runs` is without pandas)."""

    def __repr__(self) -> str:
        if not self:
            return "(no runs yet: bench.apply(wb.Config(...)) starts one)"
        columns = list(self[0])
        cells = [[cell_text(row.get(c)) for c in columns] for row in self]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
        return "\n".join(lines)


def cell_text(value: Any) -> str:
    """A table cell: "—" for a figure not measured, floats to four significant digits."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return str(value)


def table(runs: Iterable[RunSummary]) -> Any:
    """The summaries as a pandas DataFrame indexed by run id when pandas is installed, else as `RunRows`."""
    rows = [s.row() for s in runs]
    try:
        import pandas as pd
    except ImportError:
        return RunRows(rows)
    frame = pd.DataFrame(rows)
    return frame.set_index("run") if rows else frame


@dataclass(frozen=True)
class Progress:
    """How far a training run is: steps done of the total, and the time left at the pace so far."""

    done: int
    total: int
    eta_s: float | None
    """Seconds left at the wall-clock pace of the steps done so far (first steps included); None before one."""
    finished: bool = False

    def __str__(self) -> str:
        text = f"step {self.done}/{self.total}"
        if self.finished:
            return text
        if self.eta_s is None:
            return text + " · ETA after the first step"
        minutes, seconds = divmod(round(self.eta_s), 60)
        return text + f" · ETA {minutes}:{seconds:02d}"


def progress(done: int, total: int, elapsed_s: float, finished: bool = False) -> Progress:
    """`done` of `total` steps after `elapsed_s` seconds of wall time: the rest at the same pace."""
    done = min(done, total)
    eta = elapsed_s / done * (total - done) if done else None
    return Progress(done, total, eta, finished)
