"""Stopgap: run a function on a fresh N-rank gloo world (one spawn per call).

Used by tests until the persistent Pool lands; `run_world(fn, n, *args)` returns
the per-rank results in rank order, like `Pool.run`. fn must be importable
(defined at module level in a test helper module).
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch.multiprocessing as mp


def _entry(rank, fn, world_size, store_path, args, queue):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        queue.put((rank, True, fn(*args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_world(fn, world_size: int, *args, timeout: float = 300.0):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, fn, world_size, store, args, queue)) for r in range(world_size)]
        for p in procs:
            p.start()
        results = {}
        for _ in range(world_size):
            rank, ok, value = queue.get()
            if not ok:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
        for p in procs:
            p.join(timeout)
    return [results[r] for r in range(world_size)]
