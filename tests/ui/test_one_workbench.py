"""One live Workbench per kernel: a new one closes the previous one, whose ranks end and whose dashboard stops."""

from __future__ import annotations

import time

import psutil
import pytest

import workbench as wb
from workbench import kernel
from workbench.ui.dashboard import dashboard

pytestmark = [pytest.mark.processes, pytest.mark.mostly_waits]  # make check leaves these out: each starts its own
# processes; make test runs them beside the tests that compute (tests/run_suite.py)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_second_workbench_closes_the_first_and_leaves_no_orphan_rank():
    first = wb.Workbench(1, exclusive=True, telemetry=False)
    board = dashboard(first)
    pids = first.pool.pids
    with pytest.warns(UserWarning, match=r"closed the previous Workbench \(1 ranks, layout none, 0 steps"):
        second = wb.Workbench(1, exclusive=True, telemetry=False)
    try:
        assert first.closed and not second.closed
        assert all(_gone(pid) for pid in pids), "the first Workbench's ranks still run"
        deadline = time.monotonic() + 10
        while board.ticker.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not board.ticker.alive and board.controls.train_button.disabled  # its dashboard stopped
        assert second.pool.run(lambda: 1 + 1) == [2]
    finally:
        second.close()
    assert all(_gone(pid) for pid in second.pool.pids or [])


def test_exclusive_by_default_only_in_a_kernel(monkeypatch, pool):
    monkeypatch.setattr(kernel, "in_kernel", lambda: True)
    before = kernel.live()
    shared = wb.Workbench(pool=pool)  # over a given pool: never exclusive, never closes another
    assert kernel.live() is before and not shared.closed
    shared.close()
    assert not pool.broken  # the pool it was given outlives it
