"""A dead, stuck or abandoned rank is reported fast and never left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import workbench as wb
from tests.pool import rank_fns


def _wait_gone(pids, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def test_sigkill_of_a_rank_raises_worker_died_within_2s_then_restart_works(pool):
    handle = pool.run_async(rank_fns.collectives_forever)
    time.sleep(0.5)
    victim = pool.pids[1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(wb.WorkerDied) as info:
        handle.result(timeout=10)
    elapsed = time.monotonic() - t0
    print(f"WorkerDied after {elapsed * 1000:.0f} ms")
    assert elapsed < 2.0
    assert info.value.rank == 1 and info.value.signal == "SIGKILL"
    assert pool.broken
    assert _wait_gone(pool.pids, 5) == [], "the other ranks are stopped"
    with pytest.raises(wb.PoolBroken):
        pool.run(rank_fns.whoami)
    pool.restart()
    assert pool.run(rank_fns.all_reduce_sum, 2) == [4.0, 4.0]


def test_a_stopped_rank_raises_collective_timeout_naming_it():
    timeout_s = 3.0
    with wb.Pool(2, device="cpu", timeout_s=timeout_s) as pool:
        pool.run(rank_fns.all_reduce_sum, 1)
        os.kill(pool.pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(wb.CollectiveTimeout) as info:
            pool.run(rank_fns.all_reduce_sum, 1)
        elapsed = time.monotonic() - t0
        print(f"CollectiveTimeout after {elapsed:.2f} s (timeout {timeout_s} s)")
        assert timeout_s <= elapsed < timeout_s + 2
        assert info.value.rank == 1
        assert "stopped or frozen" in str(info.value)
        pids = pool.pids
        assert _wait_gone(pids, 5) == [], "a stopped rank is killed too"
        pool.restart()
        assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]


def test_close_ends_every_rank():
    pool = wb.Pool(2, device="cpu")
    pids = pool.pids
    pool.run_async(rank_fns.collectives_forever)  # busy ranks must end too
    time.sleep(0.3)
    t0 = time.monotonic()
    pool.close()
    assert _wait_gone(pids, 10) == []
    print(f"close took {time.monotonic() - t0:.2f} s")
    pool.close()  # idempotent


def test_garbage_collection_and_with_blocks_end_every_rank():
    import gc

    pool = wb.Pool(2, device="cpu")
    pids = pool.pids
    del pool
    gc.collect()
    assert _wait_gone(pids, 10) == []

    with pytest.raises(ZeroDivisionError):
        with wb.Pool(2, device="cpu") as pool:
            pids = pool.pids
            1 / 0
    assert _wait_gone(pids, 10) == []


def test_killing_the_notebook_process_ends_every_rank_within_10s(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent("""
        import sys, time, workbench as wb
        pool = wb.Pool(2, device="cpu")
        print(" ".join(map(str, pool.pids)), flush=True)
        time.sleep(600)
    """))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
    pids = [int(p) for p in driver.stdout.readline().split()]
    assert len(pids) == 2
    driver.kill()
    driver.wait()
    t0 = time.monotonic()
    assert _wait_gone(pids, 10) == []
    print(f"ranks gone {time.monotonic() - t0:.2f} s after the driver was killed")
