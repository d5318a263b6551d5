"""Local CPU ranks forked from a prepared zygote (workbench/pool/zygote.py): they train as spawned ranks do, every
start after the first is a fork (a restart too), and nothing is left running once the zygote's last pool has
closed and its linger has passed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

import workbench as wb
from workbench.pool import zygote, zygotes
from workbench.shards import prepare

pytestmark = [pytest.mark.processes, pytest.mark.mostly_waits, pytest.mark.timeout(300)]


def _rank_facts() -> dict:
    import torch

    return {"pid": os.getpid(), "ppid": os.getppid(), "threads": torch.get_num_threads(),
            "driver": os.environ.get("WORKBENCH_DRIVER_PID"), "cwd": os.getcwd(),
            "name": Path("/proc/self/comm").read_text().strip()}


def _gone(pids, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow  # a spawned Workbench beside the forked one: two cold starts
def test_forked_ranks_train_as_spawned_ones_and_a_restart_forks_again(monkeypatch):
    losses = {}
    prepare()  # the standard library's byte shard, built
    with wb.Workbench(2, standby=False) as bench:
        # Found while the ranks started, so the first apply does not look for it again.
        assert bench._prepared == (None, None)
        forks = bench.pool._zygote
        assert forks is not None and forks.alive
        facts = bench.pool.run(_rank_facts)
        # Children of the zygote, each with its own threads (the cores shared out, as a spawned rank sets them),
        # knowing which process is their notebook.
        assert {f["ppid"] for f in facts} == {forks.proc.pid}
        assert [f["threads"] for f in facts] == [max(1, (os.cpu_count() or 1) // 2)] * 2
        assert {f["driver"] for f in facts} == {str(os.getpid())}
        # Named for `top` and `pgrep -l wb-`, not a row of "python"s.
        assert [f["name"] for f in facts] == ["wb-rank-0", "wb-rank-1"]
        assert Path(f"/proc/{forks.proc.pid}/comm").read_text().strip() == "wb-zygote"
        bench.apply(wb.Config(dp=2))
        losses["forked"] = [m.loss for m in bench.train(3).wait()]
        bench.restart()
        again = bench.pool.run(_rank_facts)
        assert {f["ppid"] for f in again} == {forks.proc.pid}
        assert not {f["pid"] for f in again} & {f["pid"] for f in facts}
        assert _gone([f["pid"] for f in facts])  # the first ranks ended, reaped by the zygote
    monkeypatch.setenv("WORKBENCH_ZYGOTE", "0")
    with wb.Workbench(2, standby=False) as bench:
        assert bench.pool._zygote is None
        spawned = bench.pool.run(_rank_facts)
        assert {f["ppid"] for f in spawned} == {os.getpid()}
        assert [f["name"] for f in spawned] == ["wb-rank-0", "wb-rank-1"]
        bench.apply(wb.Config(dp=2))
        losses["spawned"] = [m.loss for m in bench.train(3).wait()]
    assert losses["forked"] == losses["spawned"]  # bit for bit


def test_a_forked_rank_starts_where_the_notebook_is_now(tmp_path, monkeypatch):
    """The zygote started in one folder; a rank forked after the notebook moved starts in the new one, as a spawned
    rank would (relative paths, and the folder `python -m` imports from)."""
    with wb.Pool(2, device="cpu", standby=False, backend_setup="workbench.telemetry.comm:register") as pool:
        monkeypatch.chdir(tmp_path)
        pool.restart()
        assert {f["cwd"] for f in pool.run(_rank_facts)} == {str(tmp_path)}


def test_the_zygote_ends_after_its_last_pool_and_leaves_nothing_running(monkeypatch):
    monkeypatch.setattr(zygotes, "LINGER_S", 0.5)
    # Preloading a module no other test's pool preloads: a zygote of its own, not one shared with the session.
    pool = wb.Pool(2, device="cpu", standby=False, preload=("json",))
    try:
        forks = pool._zygote
        assert forks is not None and forks.users == 1
        ranks = list(pool.pids)
        assert pool.run(_rank_facts)[0]["ppid"] == forks.proc.pid
        private = pool._private_dir
    finally:
        pool.close()
    assert _gone(ranks), "a rank outlived its pool"
    assert _gone([forks.proc.pid]), "the zygote outlived its linger"
    assert not os.path.exists(private)
    assert forks not in zygotes._zygotes.values()
