"""What the telemetry costs: the recording backend against plain gloo, and one recorded span.

Prints ratios against baselines measured in the same run (a plain gloo group
in the same 2-rank world; a pair of time.monotonic_ns calls). Never fails on
time. Run: python benches/telemetry_native.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPS = 300


def _median_op_us(fn, reps: int = REPS) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def _rank(rank: int, store_path: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from workbench.telemetry import comm, native

    torch.set_num_threads(1)
    comm.register()
    dist.init_process_group("workbench", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    plain = dist.new_group(backend="gloo")
    rows = []
    for nbytes in (1 << 10, 1 << 20):
        x = torch.ones(nbytes // 4)
        for group in (plain, None, plain, None):  # interleaved: drift hits both alike
            dist.barrier()
            us = _median_op_us(lambda: dist.all_reduce(x, group=group))
            rows.append((nbytes, "plain" if group is plain else "recorded", us))
        native.drain()
    span_us = _median_op_us(lambda: native.end(native.begin("compute", "x")), 20_000)
    clock_us = _median_op_us(lambda: (time.monotonic_ns(), time.monotonic_ns()), 20_000)
    queue.put((rank, rows, span_us, clock_us))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from workbench.telemetry import native

    native.load()  # build before timing anything
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "s"), queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = sorted(queue.get() for _ in procs)
        for p in procs:
            p.join()
    _, rows, span_us, clock_us = results[0]
    print("all_reduce on 2 ranks, median of", REPS, "(rank 0)")
    for nbytes in sorted({r[0] for r in rows}):
        plain = min(us for n, kind, us in rows if n == nbytes and kind == "plain")
        recorded = min(us for n, kind, us in rows if n == nbytes and kind == "recorded")
        print(f"  {nbytes:>8} B: plain gloo {plain:8.1f} µs, recorded {recorded:8.1f} µs, ratio {recorded / plain:.3f}")
    print(f"one recorded span (begin+end from Python): {span_us:.2f} µs, "
          f"{span_us / clock_us:.1f}x a pair of time.monotonic_ns() calls ({clock_us:.2f} µs)")


if __name__ == "__main__":
    main()
