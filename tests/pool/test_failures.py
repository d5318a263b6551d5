"""A dead, stuck or abandoned rank is reported fast and never left running."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import workbench as wb
from workbench.telemetry.flight import explain_diagnostics
from tests.pool import rank_fns

pytestmark = [pytest.mark.processes, pytest.mark.mostly_waits]  # make check leaves these out: each starts its own
# processes; make test runs them beside the tests that compute (tests/run_suite.py)


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


@contextlib.contextmanager
def limits(pool, **values):
    """The shared pool with other limits for one test."""
    before = {name: getattr(pool._transport.limits, name) for name in values}
    pool.set_limits(**values)
    try:
        yield pool
    finally:
        pool.set_limits(**before)


def test_sigkill_of_a_rank_raises_worker_died_at_once_then_restart_works(pool):
    handle = pool.run_async(rank_fns.collectives_forever)
    time.sleep(0.5)
    victim = pool.pids[1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(wb.WorkerDied) as info:
        handle.result(timeout=10)  # a hang bound; the figure is printed (0.06-0.13 s measured)
    print(f"WorkerDied after {(time.monotonic() - t0) * 1000:.0f} ms")
    assert info.value.rank == 1 and info.value.signal == "SIGKILL"
    assert pool.broken
    assert _wait_gone(pool.pids, 5) == [], "the other ranks are stopped"
    with pytest.raises(wb.PoolBroken):
        pool.run(rank_fns.whoami)
    pool.restart()
    assert pool.run(rank_fns.all_reduce_sum, 2) == [4.0, 4.0]


def test_a_rank_that_crashes_in_native_code_is_reported_with_the_python_stack_it_crashed_in(pool):
    # A segmentation fault leaves no Python exception to send: the rank's faulthandler prints every thread's stack
    # to its stderr file descriptor, and the pool's WorkerDied carries those last words.
    with pytest.raises(wb.WorkerDied) as info:
        pool.run(rank_fns.crash_in_native_code_on_rank_1)
    print(info.value)
    assert info.value.rank == 1 and info.value.signal == "SIGSEGV"
    words = "\n".join(info.value.last_words)
    assert "Fatal Python error: Segmentation fault" in words
    assert "crash_in_native_code_on_rank_1" in words and "rank_fns.py" in words  # where it was, by Python frame
    assert "Its last words on stderr:" in str(info.value)
    pool.restart()
    assert pool.run(rank_fns.all_reduce_sum, 2) == [4.0, 4.0]


def test_a_rank_that_crashes_in_a_thread_that_runs_no_python_is_reported_with_that_threads_native_frames(pool):
    # faulthandler's Python stacks only show the main thread waiting; torch's fatal-signal handler (world.prepare)
    # prints every thread's native stack, the recording extension the crashing thread's without allocating, and
    # the report keeps the crashing thread's.
    with pytest.raises(wb.WorkerDied) as info:
        pool.run(rank_fns.crash_in_a_native_thread_on_rank_1)
    print(info.value)
    assert info.value.rank == 1 and info.value.signal == "SIGSEGV"
    words = info.value.last_words
    assert words[0].startswith("The native stack of the thread that crashed") and "runs no Python" in words[0]
    assert words[1].startswith("frame #") and "libc.so" in words[1]  # strlen's frame, in the C library
    assert not any("gsignal" in line for line in words[1:3])  # faulthandler's second raise is not the crash
    assert "Fatal Python error: Segmentation fault" in words  # and the Python stacks after it
    assert not any("native frames of the crashing thread" in line for line in words)  # one copy of them
    pool.restart()
    assert pool.run(rank_fns.all_reduce_sum, 2) == [4.0, 4.0]


def test_a_stopped_rank_is_reported_frozen_in_seconds_naming_it_and_what_everyone_was_doing(pool):
    # timeout_s stays 180 s: the freeze must be found by the heartbeats, not by the timeout.
    pool.run(rank_fns.add_fake_provider)
    pool.run(rank_fns.all_reduce_sum, 1)
    frozen = pool.pids[1]
    os.kill(frozen, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(wb.RankFrozen) as info:
        pool.run(rank_fns.all_reduce_sum, 1)
    print(f"RankFrozen after {time.monotonic() - t0:.2f} s (frozen_after_s "
          f"{pool._transport.limits.frozen_after_s} s):\n{info.value}")
    message = str(info.value)
    assert time.monotonic() - t0 < 30, "a hang bound: the default timeout is 180 s"
    assert info.value.rank == 1 and "rank 1 is not responding" in message and "stopped" in message
    assert "all_reduce_sum" in message, "what the frozen rank was running"
    assert "rank 0: waiting" in message and "dist.all_reduce" in message, "where the other rank waits"
    assert set(info.value.diagnostics) == {0}  # the frozen rank cannot answer
    assert info.value.diagnostics[0]["last collective"] == "rank 0: all_reduce #41 of world, waiting"
    assert _wait_gone([frozen], 5) == [], "a stopped rank is killed too"
    pool.restart()
    assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]


@pytest.mark.parametrize("work", ["hold the GIL", "matmul", "python loop"])
def test_a_rank_busy_for_longer_than_the_freeze_limit_is_never_taken_for_frozen(pool, work):
    with limits(pool, frozen_after_s=0.5):
        if work == "hold the GIL":
            # Heartbeats stop while C code holds the GIL, but the process runs: slow, not frozen.
            held = pool.run(rank_fns.hold_the_gil, 1.5)
            print(f"held the GIL for {held[0]:.2f} / {held[1]:.2f} s")
            assert min(held) >= 1.5
        else:
            assert pool.run(rank_fns.busy_for, 2.0, work) == [work, work]
    assert not pool.broken


def test_a_rank_alive_but_stuck_in_a_collective_is_reported_at_the_timeout_with_where_each_rank_is(pool):
    pool.run(rank_fns.add_fake_provider)
    # The ranks' flight rings (the recording backend registers them) make the summary line: who waits where.
    pool.explain = explain_diagnostics
    try:
        with limits(pool, timeout_s=2.0):
            t0 = time.monotonic()
            with pytest.raises(wb.CollectiveTimeout) as info:
                pool.run(rank_fns.sleep_or_wait_unchecked, 1, 60)
            elapsed = time.monotonic() - t0
    finally:
        pool.explain = None
    message = str(info.value)
    print(f"CollectiveTimeout after {elapsed:.2f} s (timeout 2 s):\n{message}")
    assert 2.0 <= elapsed < 30
    assert info.value.ranks == [0, 1]
    assert "rank 0: waiting" in message and "dist.all_reduce" in message
    assert "rank 1: waiting" in message and "time.sleep" in message
    # Rank 0 waits in the world group's all-reduce; rank 1, asleep, never issued it.
    assert re.search(r"rank 0 waits in all_reduce #\d+ of the world group; rank 1 has issued (nothing|only up to #\d+) there",
                     message), message
    assert "flight recorder: (data: error.diagnostics[0]['flight recorder'])" in message
    assert set(info.value.diagnostics) == {0, 1}
    assert "all_reduce #41" in info.value.diagnostics[1]["last collective"]
    pool.restart()


# One rank where the count does not matter: each of these starts a pool of its own.
def test_close_ends_every_rank_and_the_standby_and_removes_the_private_folder():
    pool = wb.Pool(1, device="cpu", standby=True)
    pids = pool.pids + list(pool.standby.pids)
    folder = pool._private_dir
    assert len(pids) == 2, "a rank, and one standing by (still preparing)"
    pool.run_async(rank_fns.collectives_forever)  # busy ranks must end too
    time.sleep(0.3)
    t0 = time.monotonic()
    pool.close()
    assert _wait_gone(pids, 10) == []
    print(f"close took {time.monotonic() - t0:.2f} s")
    assert not os.path.exists(folder)
    pool.close()  # idempotent


def test_garbage_collection_and_with_blocks_end_every_rank():
    import gc

    pool = wb.Pool(1, device="cpu", standby=True)
    pids = pool.pids + list(pool.standby.pids)
    del pool
    gc.collect()
    assert _wait_gone(pids, 10) == []

    with pytest.raises(ZeroDivisionError):
        with wb.Pool(1, device="cpu", standby=False) as pool:
            pids = pool.pids
            assert pool.standby.ranks == 0 and "standby off" in repr(pool)
            1 / 0
    assert _wait_gone(pids, 10) == []


def test_killing_the_notebook_process_ends_every_rank_and_removes_its_private_folder(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent("""
        import sys, time, workbench as wb
        pool = wb.Pool(1, device="cpu", standby=True)
        print(" ".join(map(str, pool.pids + list(pool.standby.pids))), pool._private_dir, flush=True)
        time.sleep(600)
    """))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
    *pids, folder = driver.stdout.readline().split()
    pids = [int(p) for p in pids]
    assert len(pids) == 2 and os.path.isdir(folder), "a rank and one standing by"
    driver.kill()
    driver.wait()
    t0 = time.monotonic()
    assert _wait_gone(pids, 10) == []
    print(f"ranks gone {time.monotonic() - t0:.2f} s after the driver was killed")
    deadline = time.monotonic() + 10
    while os.path.exists(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*")) if os.path.exists(folder) else None
    assert left is None, f"the ranks removed their dead driver's private folder; left in it: {left}"


def test_the_next_pool_sweeps_private_folders_of_dead_drivers(tmp_path):
    from workbench.pool import private_dir

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"workbench-{dead.pid}-abc"
    stale.mkdir()
    (stale / "driver").write_text(f"{dead.pid} 12345\n")
    (stale / "control.sock").write_text("")
    recycled = tmp_path / f"workbench-{os.getpid()}-def"  # a live pid, but another process's start time
    recycled.mkdir()
    (recycled / "driver").write_text(f"{os.getpid()} 1\n")
    live = tmp_path / f"workbench-{os.getpid()}-ghi"
    live.mkdir()
    (live / "driver").write_text(f"{os.getpid()} {private_dir._start_time(os.getpid())}\n")
    other = tmp_path / "workbench-notes"  # not a pool's folder: no driver file
    other.mkdir()
    assert sorted(private_dir.sweep(str(tmp_path))) == sorted([str(stale), str(recycled)])
    assert live.exists() and other.exists()


def test_a_rank_that_cannot_prepare_reports_why_and_leaves_nothing_running():
    # Preparation (imports, warm-up) happens before a local rank connects; its failure still reaches the notebook.
    with pytest.raises(wb.RemoteError) as info:
        wb.Pool(1, device="cpu", preload=("a_module_that_does_not_exist",), standby=False)
    assert info.value.exc_type == "StartupError" and "a_module_that_does_not_exist" in str(info.value)
    assert "import_module" in info.value.remote_traceback
