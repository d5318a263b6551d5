"""The persistent pool against the other ways to run distributed code from a notebook, same loop, same machine.

Prints, from one run on this machine: the no-op round trip to all ranks, and a
10-step DDP loop of a small model (benches/ddp_loop.py) run (a) through the pool
(model kept on the ranks), beside the peers that also keep ranks between cells
(benches/peers.py: nbdistributed, Monarch; each in a fresh interpreter of its
own), (b) accelerate's notebook_launcher (state lost every call), (c) a whole
torchrun job; how soon the ranks are ready (cold, and from a standby an earlier
kernel left); and a table of them all as seconds and as ratios to the pool.
A peer that is not installed is skipped, saying so: `pip install -e ".[peers]"`.

    .venv/bin/python benches/pool.py          # about 2 minutes on 2 quiet cores
"""

from __future__ import annotations

import os
import json
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import cloudpickle  # noqa: E402
import ddp_loop  # noqa: E402
import peers  # noqa: E402
from bytecode import require_compiled  # noqa: E402  (benches/bytecode.py)

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
    # A zygote of this process's own (no standby): a cold start, as the first kernel on a machine pays.
    with wb.Pool(2, device="cpu", check_collectives=check_collectives, standby=False) as pool:
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


STANDBY_READY = """
import json, time
import workbench as wb
t = time.perf_counter()
pool = wb.Pool(2, device="cpu")
print(json.dumps({"ready": time.perf_counter() - t, "from": pool.ranks_from}))
pool.close()
"""


def bench_standby_ready() -> tuple[float, str]:
    """Pool(2) ready in a fresh interpreter when an earlier one (an earlier kernel) left its standby."""
    runs = []
    for _ in range(REPEATS + 1):  # the first one starts the standby
        out = subprocess.run([sys.executable, "-c", STANDBY_READY], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    subprocess.run([sys.executable, "-m", "workbench", "--stop-standbys"], capture_output=True, check=True)
    return median([r["ready"] for r in runs[1:]]), runs[-1]["from"]


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.1f}×" if value >= 0.95 * base else f"{base / value:.1f}× less"


def table(rows: list[tuple[str, float | None, float | None, float | None]]) -> None:
    """Ready (s), no-op (ms), 10 steps (s) per row, each with its ratio to the first row's (the pool's)."""
    units = ("s", "ms", "s")
    print(f"\n{'':62s} {'ranks ready':>20s} {'no-op to all ranks':>22s} {'10 DDP steps, model kept':>26s}")
    for name, *values in rows:
        cells = ["—" if v is None else f"{v:.3f} {unit} ({_ratio(v, base)})"
                 for v, base, unit in zip(values, rows[0][1:], units)]
        print(f"{name:62s} {cells[0]:>20s} {cells[1]:>22s} {cells[2]:>26s}")


def main() -> None:
    require_compiled("benches/pool.py")
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; torch {__import__('torch').__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    pipe = bench_pipe_prototype(signed=False)
    pipe_signed = bench_pipe_prototype(signed=True)
    launcher = bench_launcher()
    torchrun = bench_torchrun()
    cold, rtts, first, warm = bench_pool(check_collectives=True)
    _, rtts_fast, _, warm_fast = bench_pool(check_collectives=False)
    standby_ready, standby_from = bench_standby_ready()
    others = {}
    for peer in peers.PEERS:
        if not peers.installed(peer):
            print(f"{peer}: not installed, skipped (pip install -e \".[peers]\")")
            continue
        others[peer] = peers.measure(peer)
        if "error" in others[peer]:
            print(f"{peer}: failed, skipped:\n{others[peer]['error']}")
    a = median(warm)
    print(f"pool start (2 ranks, cold):                 {cold:.2f} s; from a standby an earlier interpreter left: "
          f"{standby_ready:.2f} s ({standby_from})")
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
    rows = [("workbench Pool(2), cold", cold, median(rtts) * 1e3, a),
            ("workbench Pool(2), a standby from an earlier kernel", standby_ready, None, None)]
    nbd = others.get("nbdistributed", {})
    if "ready_s" in nbd:
        rows.append((f"nbdistributed {nbd['version']} (%dist_init -n 2, %%distributed)", nbd["ready_s"],
                     nbd["noop_ms"], nbd["steps_s"]))
    mon = others.get("monarch", {})
    if "ready_s" in mon:
        rows.append((f"Monarch (torchmonarch {mon['version']}, spawn_procs, actor endpoints)", mon["ready_s"],
                     mon["noop_ms"], mon["steps_s"]))
    rows += [("accelerate notebook_launcher (state lost each call)", None, None, median(launcher)),
             ("torchrun whole job", None, None, median(torchrun))]
    table(rows)
    if "ready_s" in mon:
        print(f"  Monarch's procs import torch at the first call that needs it: its first DDP build took "
              f"{mon['first_build_s']:.2f} s (the pool's ranks come prepared: its first build took {first:.2f} s)")
    if "ready_s" in nbd:
        print(f"\nnbdistributed, measured while it ran (ss -ltnp): listening on " + "; ".join(nbd["listening"]))
        print(f"  a pickle sent to the notebook's port by another process holding no key was unpickled there: "
              f"{'yes' if nbd['unpickled_unauthenticated'] else 'no'}")
        print(f"  workers still running 2 s after %dist_shutdown: {nbd['workers_left_after_dist_shutdown']} of 2 "
              f"(ended here by pid)")


if __name__ == "__main__":
    # A runtime folder of the bench's own (set here, not at import: spawned helpers import this module again):
    # it never takes over the user's standby (workbench/pool/user_standby.py).
    RUNTIME = tempfile.mkdtemp(prefix="workbench-bench-")
    os.environ["WORKBENCH_RUNTIME_DIR"] = RUNTIME
    try:
        main()
    finally:
        shutil.rmtree(RUNTIME, ignore_errors=True)
