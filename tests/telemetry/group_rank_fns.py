"""Rank-side functions for tests/telemetry/test_groups.py (module-level, so the pool's ranks can import them)."""

from __future__ import annotations

import os
import time


def gloo_threads() -> dict[str, int]:
    """This process's threads by name, of the two kinds gloo starts (its transport's epoll loop and a group's
    workers), once the count has settled: a thread is named a moment after it starts."""
    seen, deadline = _gloo_threads(), time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _gloo_threads()
        if now == seen:
            break
        seen = now
    return seen


def _gloo_threads() -> dict[str, int]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended while we looked
            pass
    return {kind: names.count(kind) for kind in ("gloo_tcp_loop", "pt_gloo_runloop")}


def make_groups(n: int) -> dict[str, dict[str, int]]:
    """The gloo threads before and after making `n` groups of the world's ranks (the world's backend, as a mesh's
    groups are made) and running an all-reduce on each."""
    import torch
    import torch.distributed as dist

    before = gloo_threads()
    for _ in range(n):
        group = dist.new_group(list(range(dist.get_world_size())))
        x = torch.ones(4)
        dist.all_reduce(x, group=group)
        assert x[0].item() == dist.get_world_size()
    return {"before": before, "after": gloo_threads()}


def meshes_built_twice() -> dict:
    """Whether asking twice for a mesh of one shape gives the same mesh, and the gloo threads the second ask cost."""
    from workbench.config import Degrees
    from workbench.engine.mesh import build_mesh

    first = build_mesh(Degrees(dp_replicate=2), "cpu")
    before = gloo_threads()
    again = build_mesh(Degrees(dp_replicate=2), "cpu")
    other = build_mesh(Degrees(tp=2), "cpu")
    return {"same": again is first, "other": other is not first, "before": before, "after": gloo_threads()}
