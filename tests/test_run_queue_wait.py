"""workbench.machine.run_queue_wait_s against a wait made on purpose: two busy processes held to one core take
turns, each waiting for it about half the time; alone on a core, a process hardly waits."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from workbench.machine import run_queue_wait_s

pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/schedstat"),
                                 reason="the kernel does not report run-queue time (schedstat)")]

BUSY = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass\n"


def _busy(core: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    os.sched_setaffinity(proc.pid, {core})
    return proc


def test_two_processes_sharing_one_core_wait_for_it_and_that_wait_is_counted():
    core = min(os.sched_getaffinity(0))
    pair = [_busy(core), _busy(core)]
    time.sleep(0.2)  # both started and spinning
    before = run_queue_wait_s([p.pid for p in pair])
    time.sleep(0.8)
    waited = run_queue_wait_s([p.pid for p in pair]) - before
    for p in pair:
        p.wait(30)
    # Over 0.8 s the two share one core: together they wait ~0.8 s (each half the time), whatever else runs on it;
    # 0.3 s leaves room for interpreter start-up still under way when the span began.
    assert waited > 0.3, waited


def test_no_process_and_a_gone_one_wait_nothing():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert run_queue_wait_s([]) == 0.0 and run_queue_wait_s([gone.pid]) == 0.0
    assert run_queue_wait_s([os.getpid()]) >= 0.0
