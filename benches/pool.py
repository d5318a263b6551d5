"""The persistent pool against the usual ways to run distributed code from a notebook.

Prints, from one run on this machine: the no-op round trip to all ranks, and a
10-step DDP loop of a small model run (a) through the pool (model kept on the
ranks), (b) with accelerate's notebook_launcher (state lost every call), (c) as
a whole torchrun job — as seconds and as ratios to (a).

    .venv/bin/python benches/pool.py
"""

from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import cloudpickle  # noqa: E402
import ddp_loop  # noqa: E402

cloudpickle.register_pickle_by_value(ddp_loop)  # ranks cannot import benches/: send its functions by value

REPEATS = 5


def median(xs):
    return statistics.median(xs)


def p95(xs):
    return sorted(xs)[int(0.95 * (len(xs) - 1))]


def bench_launcher() -> list[float]:
    from accelerate import notebook_launcher

    times = []
    for _ in range(3):
        t = time.perf_counter()
        notebook_launcher(ddp_loop.launcher_fn, num_processes=2)
        times.append(time.perf_counter() - t)
    return times


def bench_torchrun() -> list[float]:
    times = []
    for _ in range(2):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                        "--master-port=29517", ddp_loop.__file__], check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return times


def _pipe_rank(conn, key: bytes | None, rank: int) -> None:
    import pickle

    from workbench.pool import protocol

    signer, verifier = protocol.Signer(key or b"", f"r{rank}", "s"), protocol.Verifier(key or b"", "s")
    while True:
        blob = conn.recv_bytes()
        if blob == b"":
            return
        if key is None:
            fn, args, kwargs = pickle.loads(blob)
            conn.send(fn(*args, **kwargs))
        else:
            _, msg = verifier.open(blob)
            fn, args, kwargs = pickle.loads(msg["call"])
            conn.send_bytes(signer.seal({"type": "result", "id": msg["id"], "ok": True,
                                         "value": protocol.dumps(fn(*args, **kwargs))}))


def bench_pipe_prototype(signed: bool) -> list[float]:
    """A pipe-based prototype pool: the call cloudpickled to two processes over multiprocessing pipes, the results
    pickled back. No health checks, no output forwarding; `signed`: every message sealed and checked with the
    pool's own protocol, as the issue asks of the pool, so the two lines show what authentication costs."""
    import multiprocessing as mp

    from workbench.pool import protocol

    key = protocol.new_key() if signed else None
    signer, verifier = protocol.Signer(key or b"", "driver", "s"), protocol.Verifier(key or b"", "s")
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(2):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_pipe_rank, args=(child, key, rank))
        p.start()
        pipes.append(parent)
        procs.append(p)
    rtts = []
    for i in range(1050):
        t = time.perf_counter()
        call = cloudpickle.dumps((int, (), {}))
        if signed:
            call = signer.seal({"type": "call", "id": i, "call": call})
        for c in pipes:
            c.send_bytes(call)
        for c in pipes:
            if signed:
                pickle.loads(verifier.open(c.recv_bytes())[1]["value"])
            else:
                c.recv()
        if i >= 50:
            rtts.append(time.perf_counter() - t)
    for c, p in zip(pipes, procs):
        c.send_bytes(b"")
        p.join()
    return rtts


def bench_pool(check_collectives: bool):
    import workbench as wb

    t = time.perf_counter()
    with wb.Pool(2, device="cpu", check_collectives=check_collectives) as pool:
        cold = time.perf_counter() - t
        for _ in range(50):
            pool.run(int)
        rtts = []
        for _ in range(1000):
            t = time.perf_counter()
            pool.run(int)
            rtts.append(time.perf_counter() - t)
        t = time.perf_counter()
        pool.run(ddp_loop.pool_build)
        pool.run(ddp_loop.pool_steps)
        first = time.perf_counter() - t
        warm = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            pool.run(ddp_loop.pool_steps)
            warm.append(time.perf_counter() - t)
    return cold, rtts, first, warm


def main() -> None:
    print(f"machine: {os.cpu_count()} cores; torch {__import__('torch').__version__}")
    pipe = bench_pipe_prototype(signed=False)
    pipe_signed = bench_pipe_prototype(signed=True)
    launcher = bench_launcher()
    torchrun = bench_torchrun()
    cold, rtts, first, warm = bench_pool(check_collectives=True)
    _, rtts_fast, _, warm_fast = bench_pool(check_collectives=False)
    a = median(warm)
    print(f"pool start (2 ranks, cold):                 {cold:.2f} s")
    print(f"no-op round trip, pipe prototype:           median {median(pipe) * 1e3:.3f} ms, p95 {p95(pipe) * 1e3:.3f} ms")
    print(f"no-op round trip, pipe prototype, signed:   median {median(pipe_signed) * 1e3:.3f} ms, "
          f"p95 {p95(pipe_signed) * 1e3:.3f} ms")
    print(f"no-op round trip to all ranks (checked):     median {median(rtts) * 1e3:.3f} ms, p95 {p95(rtts) * 1e3:.3f} ms")
    print(f"no-op round trip (check_collectives=False): median {median(rtts_fast) * 1e3:.3f} ms, "
          f"p95 {p95(rtts_fast) * 1e3:.3f} ms")
    print(f"pool round trip / pipe prototype:           {median(rtts) / median(pipe):.2f}× "
          f"(/ signed prototype: {median(rtts) / median(pipe_signed):.2f}×)")
    print(f"(a) pool, 10 DDP steps, model kept:          {a:.3f} s  (1.0×)   [first call incl. build: {first:.3f} s;"
          f" unchecked: {median(warm_fast):.3f} s]")
    print(f"(b) accelerate notebook_launcher per call:   {median(launcher):.3f} s  ({median(launcher) / a:.0f}×)")
    print(f"(c) torchrun whole job:                      {median(torchrun):.3f} s  ({median(torchrun) / a:.0f}×)")


if __name__ == "__main__":
    main()
