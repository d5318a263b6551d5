"""What idle process groups cost a rank: CPU while nothing runs, with groups made by torch's gloo backend (a
transport device per group) and by the workbench's recording backend (one device per process), in one run.

A rank that has made many groups (meshes of many layouts, or a test suite driving one pool for an hour) pays
gloo's epoll loop for each device it has: a wake-up every 10 ms. Each rank's CPU time over a few idle seconds
is read from /proc, before any extra group, after `GROUPS` groups through the workbench backend, then after as
many more through torch's gloo.

    .venv/bin/python benches/gloo_groups.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

GROUPS = 200
IDLE_S = 4.0


def idle_cpu_share(seconds: float) -> float:
    """This process's CPU time over `seconds` of doing nothing, as a share of one core."""
    t0, c0 = time.monotonic(), sum(os.times()[:2])
    time.sleep(seconds)
    return (sum(os.times()[:2]) - c0) / (time.monotonic() - t0)


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def make_groups(n: int, backend: str | None) -> int:
    import torch
    import torch.distributed as dist

    for _ in range(n):
        group = dist.new_group(list(range(dist.get_world_size())), backend=backend)
        dist.all_reduce(torch.ones(1), group=group)
    return thread_count()


def main() -> None:
    import workbench as wb

    with wb.Pool(2, device="cpu", backend_setup="workbench.telemetry.comm:register", standby=False) as pool:
        rows = [("no extra group", pool.run(thread_count), pool.run(idle_cpu_share, IDLE_S))]
        threads = pool.run(make_groups, GROUPS, None)
        rows.append((f"+{GROUPS} workbench groups", threads, pool.run(idle_cpu_share, IDLE_S)))
        threads = pool.run(make_groups, GROUPS, "gloo")
        rows.append((f"+{GROUPS} gloo groups more", threads, pool.run(idle_cpu_share, IDLE_S)))
    print(f"idle CPU of each rank over {IDLE_S:g} s, as a share of one core (rank 0, rank 1)")
    print(f"{'':28s}{'threads':>10s}{'idle CPU':>20s}")
    for name, threads, share in rows:
        print(f"{name:28s}{threads[0]:>10d}{share[0]:>10.1%}{share[1]:>10.1%}")
    base, ours, theirs = (sum(r[2]) / 2 for r in rows)
    print(f"{GROUPS} idle groups add {ours - base:+.1%} of a core through the workbench backend, {theirs - ours:+.1%} "
          f"through torch's gloo; idle CPU with both / with the workbench's alone: {theirs / max(ours, 1e-3):.0f}×")


if __name__ == "__main__":
    main()
