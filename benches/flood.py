"""`pool.run` latency while a stranger floods the control socket, against the same pool when quiet.

The floods are issue 17's drills (tests/pool/flood.py, one process each, loopback): knocks of 60 KB that
are never read, frames with a wrong MAC, and connect-knock-hang-up churn. Each is measured for a few
seconds of no-op round trips to 2 ranks; the ratios are to the quiet round trip and to a process as busy as
a flood that never connects (on 2 cores the flooding process itself takes one of them: that part of the
slowdown is CPU contention, not the pool), both measured in the same run.

    .venv/bin/python benches/flood.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
FLOODS = {"busy process, no connection": ["spin"], "60 KB knocks, never read": ["knocks", "--size", "60000"],
          "wrong-MAC frames": ["forged"], "connect-knock-hang-up churn": ["churn"]}
SECONDS = 3.0


def round_trips(pool, seconds: float) -> list[float]:
    times, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        t = time.perf_counter()
        pool.run(int)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    import workbench as wb

    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    with wb.Pool(2, device="cpu", standby=False) as pool:
        round_trips(pool, 0.5)
        quiet = statistics.median(round_trips(pool, SECONDS))
        print(f"quiet: no-op round trip median {quiet * 1e3:.3f} ms")
        busy = None
        for name, args in FLOODS.items():
            before = pool.rejected_messages
            flood = subprocess.Popen([sys.executable, "-m", "tests.pool.flood", pool.address, *args, "--seconds",
                                      str(SECONDS + 60)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            assert flood.stdout.readline().strip() == "flooding"
            time.sleep(0.2)
            times = round_trips(pool, SECONDS)
            flood.kill()
            flood.wait()
            loud = statistics.median(times)
            busy = busy or loud
            print(f"{name:30s} median {loud * 1e3:7.3f} ms  p95 {sorted(times)[int(0.95 * len(times))] * 1e3:7.3f} ms  "
                  f"{loud / quiet:5.2f}× quiet, {loud / busy:5.2f}× busy; "
                  f"{pool.rejected_messages - before} messages or connections refused")
        assert not pool.broken


if __name__ == "__main__":
    main()
