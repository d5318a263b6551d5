"""StepMetrics as JSON lines: how a run outside the notebook records what a notebook's store would hold.

One line per StepMetrics, every field as JSON (the `rank` field tags the line), written with one `write` on a
file opened for appending, so the ranks of one machine can share a file without interleaving lines. Reading
gives back equal StepMetrics records, which the notebook's report and plots take as they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator

from workbench.telemetry.events import Interval, StepMetrics


def dumps(metrics: StepMetrics) -> str:
    """One JSON line (no newline) holding every field of `metrics`."""
    return json.dumps(dataclasses.asdict(metrics), separators=(",", ":"), allow_nan=True)


def loads(line: str) -> StepMetrics:
    """The StepMetrics a `dumps` line holds."""
    data = json.loads(line)
    for name in _TUPLE_FIELDS & data.keys():  # JSON has no tuples: every tuple field, however nested, comes back
        data[name] = _tuples(data[name])
    data["intervals"] = tuple(Interval(**i) for i in data.get("intervals", ()))
    return StepMetrics(**data)


_TUPLE_FIELDS = {f.name for f in dataclasses.fields(StepMetrics) if str(f.type).startswith("tuple")}


def _tuples(value: object) -> object:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class MetricsFile:
    """Appends StepMetrics to a JSONL file; each line one `os.write` on an O_APPEND descriptor (atomic locally)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, metrics: StepMetrics) -> None:
        os.write(self._fd, (dumps(metrics) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read(path: str | Path) -> Iterator[StepMetrics]:
    """Every StepMetrics in the file, in the order written (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield loads(line)
