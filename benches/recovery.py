"""How long `train(recover=True)` takes to recover from a killed or frozen rank, and what snapshots cost.

30 steps of `tiny` at dp=2 (telemetry off), a snapshot every 5 steps: two SIGKILLs and two SIGSTOPs of a
rank, each once the standby is ready. Prints each recovery's time (from the failure's report to training
again: restart on the standby, layout, snapshot restored), the time from the signal to the failure's report,
and the cost of the snapshots: the same 30 steps with recover=True and no failure, against plain training
(the baseline, in the same run).

    .venv/bin/python benches/recovery.py
"""

from __future__ import annotations

import os
import signal
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

STEPS, EVERY = 30, 5
STANDBY_WAIT_S = 60.0


def main() -> None:
    import workbench as wb
    from workbench.engine.session import drop

    cfg = wb.Config(dp=2)
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    with wb.Workbench(2, telemetry=False, frozen_after_s=1.0) as bench:
        bench.apply(cfg)
        bench.train(3).wait()
        t = time.perf_counter()
        bench.train(STEPS).wait()
        plain = time.perf_counter() - t
        t = time.perf_counter()
        bench.train(STEPS, recover=True, snapshot_every=EVERY).wait()
        snapshotted = time.perf_counter() - t
        print(f"{STEPS} steps without a failure: plain {plain:.2f} s, recover=True {snapshotted:.2f} s "
              f"({snapshotted / plain:.3f}×: the snapshots every {EVERY} steps)", flush=True)
        t = time.perf_counter()
        snapshot = bench.session.snapshot()
        snapshot_s = time.perf_counter() - t
        size = sum(v.numel() * v.element_size() for part in ("model", "optim")
                   for v in snapshot[0]["state"][part].values() if hasattr(v, "numel"))
        print(f"snapshot of tiny: {size / 2**20:.1f} MiB held by the notebook, taken in {snapshot_s * 1e3:.0f} ms",
              flush=True)
        bench.pool.run(drop)
        bench.apply(cfg)
        # Long enough never to end by itself while the faults are injected: stopped after the last recovery.
        run = bench.train(100_000, recover=True, snapshot_every=EVERY)
        reported = []
        for i, sig in enumerate([signal.SIGKILL, signal.SIGSTOP] * 2):
            while len(bench.store.recoveries) < i or bench.pool.broken:
                time.sleep(0.01)
            deadline = time.monotonic() + STANDBY_WAIT_S  # a loaded machine leaves a niced standby little CPU
            while not bench.pool.standby.ready and time.monotonic() < deadline:
                time.sleep(0.05)
            warm = bench.pool.standby.ready
            n = len(bench.history)
            while len(bench.history) < n + 2:
                assert not run.done, "the run ended"
                time.sleep(0.005)
            os.kill(bench.pool.pids[1], sig)
            t = time.monotonic()
            while not bench.pool.broken:
                time.sleep(0.001)
            reported.append((signal.Signals(sig).name, time.monotonic() - t, warm))
        while len(bench.store.recoveries) < len(reported) or bench.pool.broken:
            time.sleep(0.01)
        metrics = run.stop()
        recoveries = bench.store.recoveries
    for (name, seen, warm), mark in zip(reported, recoveries):
        print(f"{name:8s} reported after {seen:5.2f} s; recovered in {mark.seconds:5.2f} s "
              f"({'standby ready' if warm else 'standby still preparing'}), {mark.replayed} steps replayed")
    print(f"recovery median {statistics.median(r.seconds for r in recoveries):.2f} s; every step trained once: "
          f"{[m.step for m in metrics] == list(range(len(metrics)))} ({len(metrics)} steps)")


if __name__ == "__main__":
    main()
