"""What one local rank costs in memory: the figure behind `workbench.machine.RANK_MEMORY_BYTES`.

Prints, from one run on this machine, each rank's resident (RSS) and private
(USS: what one more rank adds) memory idle, with the tiny model applied and
trained 3 steps, and with the small one; each as a ratio to a bare
`python -c "import torch"` process measured in the same run.

    .venv/bin/python benches/rank_memory.py
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench.machine import RANK_MEMORY_BYTES  # noqa: E402

MB = 2**20


def memory() -> tuple[int, int]:
    """(RSS, USS) of the calling process, in bytes, from /proc (Linux)."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    with open("/proc/self/smaps_rollup") as f:
        uss = sum(int(line.split()[1]) * 1024 for line in f if line.startswith(("Private_Clean", "Private_Dirty")))
    return rss, uss


def bare_torch() -> tuple[int, int]:
    code = "import torch, sys; sys.path.insert(0, %r); import rank_memory; print(*rank_memory.memory())"
    out = subprocess.run([sys.executable, "-c", code % os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, check=True).stdout
    rss, uss = map(int, out.split())
    return rss, uss


def report(what: str, per_rank: list[tuple[int, int]], base: tuple[int, int]) -> None:
    rss = max(r for r, _ in per_rank)
    uss = max(u for _, u in per_rank)
    print(f"{what:<28} RSS {rss / MB:6.0f} MB ({rss / base[0]:.2f}× bare torch)   "
          f"USS {uss / MB:6.0f} MB ({uss / base[1]:.2f}×)")


def main() -> None:
    base = bare_torch()
    print(f"{'bare python + import torch':<28} RSS {base[0] / MB:6.0f} MB   USS {base[1] / MB:6.0f} MB")
    with wb.Workbench(2) as bench:
        report("rank, idle", bench.pool.run(memory), base)
        bench.apply(wb.Config(dp=2))
        bench.train(steps=3).wait()
        report("rank, tiny dp2 + 3 steps", bench.pool.run(memory), base)
        bench.apply(wb.Config(dp=2, model=wb.ModelConfig.preset("small")), fresh=True)
        bench.train(steps=3).wait()
        report("rank, small dp2 + 3 steps", bench.pool.run(memory), base)
    print(f"RANK_MEMORY_BYTES (the estimate Workbench warns with) = {RANK_MEMORY_BYTES / MB:.0f} MB")


if __name__ == "__main__":
    main()
