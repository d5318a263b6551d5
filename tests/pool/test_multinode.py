"""Ranks on "other machines": two torchrun launches on loopback acting as two nodes connect back."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import time

import pytest

import workbench as wb
from tests.local_launch import free_port, outputs_of
from tests.pool import rank_fns

pytestmark = pytest.mark.processes  # make check leaves these out: each starts its own processes


def test_two_torchrun_nodes_join_an_external_pool(tmp_path):
    key_file = tmp_path / "keys" / "pool.key"
    pool = wb.Pool(2, device="cpu", external=True, key_file=str(key_file), start_timeout_s=90)
    nodes = []
    try:
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        master_port = free_port()
        # TMPDIR: torchrun's agents make their log folders there, never removed (the test's folder is).
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
                   TMPDIR=str(tmp_path))
        for node_rank in (0, 1):
            cmd = pool.launch_command(nnodes=2, nproc_per_node=1, master_port=master_port)
            cmd = cmd.replace("$NODE_RANK", str(node_rank)).replace("$MASTER_ADDR", "127.0.0.1")
            cmd = cmd.replace("python -m", f"{shlex.quote(os.sys.executable)} -m", 1)
            nodes.append(subprocess.Popen(cmd, shell=True, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        pool.wait_ready(90)
        results = pool.run(rank_fns.whoami)
        assert [r[:2] for r in results] == [(0, 2), (1, 2)]
        assert pool.run(rank_fns.all_reduce_sum, 5) == [10.0, 10.0]
    finally:
        pool.close()
        outputs = outputs_of(nodes, timeout=30)
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out


HEARTBEAT_S = 60.0


def test_a_remote_rank_that_dies_is_reported_at_once_not_at_the_heartbeat_timeout(tmp_path):
    # A remote rank has no process the notebook can poll: its closed connection is the news.
    key_file = tmp_path / "pool.key"
    # The heartbeat limit is long, so that a report before half of it can only be the closed connection's.
    pool = wb.Pool(1, device="cpu", external=True, key_file=str(key_file), heartbeat_timeout_s=HEARTBEAT_S)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1")
    rank = subprocess.Popen([os.sys.executable, "-m", "workbench.pool.worker", "--connect", pool.address,
                             "--key-file", str(key_file), "--rank", "0", "--world-size", "1"], env=env)
    try:
        pool.wait_ready(90)
        handle = pool.run_async(time.sleep, 60)
        rank.kill()
        killed_at = time.monotonic()
        with pytest.raises(wb.WorkerDied) as died:
            handle.result(timeout=HEARTBEAT_S)
        elapsed = time.monotonic() - killed_at
        print(f"remote WorkerDied after {elapsed * 1e3:.0f} ms")
        assert died.value.rank == 0 and "connection" in str(died.value)
        # What the mechanism guarantees, whatever the machine's load: the news came from the connection, long
        # before any heartbeat could have told (measured here: 2-40 ms; on a loaded machine, more).
        assert elapsed < HEARTBEAT_S / 2
    finally:
        pool.close()
        rank.kill()
        rank.wait(10)
