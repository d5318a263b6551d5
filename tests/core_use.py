"""A pytest plugin that measures how many of the machine's cores were busy during each test (from /proc/stat
before and after it): the figures that decide which tests `make test` runs beside the others
(tests/run_suite.py, the `mostly_waits` marker).

    make test PYTEST_ARGS="-p tests.core_use"      # each pytest run writes core-use-<pid>.tsv here
    python -m tests.core_use core-use-*.tsv         # per file: wall seconds, busy cores, idle core-seconds

Linux only (elsewhere it records nothing). The machine's whole CPU is counted: run it on a quiet machine.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path

import pytest


def cpu_times() -> tuple[int, int] | None:
    """(all jiffies, idle jiffies) of the machine so far; None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[3] + fields[4]  # idle and iowait


def busy_cores(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """How many cores were busy on average between two `cpu_times` samples."""
    total, idle = after[0] - before[0], after[1] - before[1]
    return cores * (total - idle) / total if total else 0.0


_out = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _out
    before, started = cpu_times(), time.monotonic()
    yield
    after = cpu_times()
    if before is None or after is None:
        return
    if _out is None:
        _out = open(f"core-use-{os.getpid()}.tsv", "a")  # noqa: SIM115 - open for the session, closed below
    _out.write(f"{item.nodeid}\t{time.monotonic() - started:.2f}\t{busy_cores(before, after, os.cpu_count()):.2f}\n")


def pytest_unconfigure(config):
    if _out is not None:
        _out.close()


def by_file(rows: list[tuple[str, float, float]], cores: int) -> list[tuple[str, float, float, float]]:
    """(file, wall s, busy cores on average, idle core-seconds) per test file, most idle first."""
    wall, busy = collections.Counter(), collections.Counter()
    for nodeid, seconds, cores_busy in rows:
        name = nodeid.split("::")[0]
        wall[name] += seconds
        busy[name] += seconds * cores_busy
    out = [(name, wall[name], busy[name] / wall[name] if wall[name] else 0.0, cores * wall[name] - busy[name])
           for name in wall]
    return sorted(out, key=lambda r: -r[3])


if __name__ == "__main__":
    rows = []
    for path in sys.argv[1:]:
        for line in Path(path).read_text().splitlines():
            nodeid, seconds, cores_busy = line.rsplit("\t", 2)
            rows.append((nodeid, float(seconds), float(cores_busy)))
    print(f"{'wall s':>8} {'busy cores':>10} {'idle core-s':>11}  file")
    for name, seconds, cores_busy, idle in by_file(rows, os.cpu_count() or 1):
        print(f"{seconds:8.1f} {cores_busy:10.2f} {idle:11.1f}  {name}")
