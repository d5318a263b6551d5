"""What the flight recorder costs per collective, in one process (no network in the way).

Over torch's in-process FakeProcessGroup (its collectives do nothing and complete at once), three ways of
issuing one all_reduce, interleaved: the fake group itself (the baseline), the recording backend around it with
span recording off (forwarding + the flight-recorder entry and its completion), and with span recording on.
Also one read of a full ring (256 entries), as a hang report's provider does it. Prints ratios against the
baseline measured in the same run; never fails on time. Run: python benches/flight.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPS = 20_000
ROUNDS = 5


def _mean_us(fn, reps: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        fn()
    return (time.perf_counter_ns() - t0) / reps / 1e3


def main() -> None:
    import torch
    from torch._C._distributed_c10d import FakeProcessGroup

    from workbench.telemetry import flight, native

    ext = native.load()
    fake = FakeProcessGroup._create_internal(0, 2)
    wrapped = ext.recording_backend(0, 2, FakeProcessGroup._create_internal(0, 2), None, "bench")
    x = [torch.ones(256)]
    recorder = native.recorder()
    timings: dict[str, list[float]] = {"fake group": [], "spans off": [], "spans on": []}
    for _ in range(ROUNDS):  # interleaved: drift on a loaded machine hits every row alike
        timings["fake group"].append(_mean_us(lambda: fake.allreduce(x).wait(), REPS))
        recorder.set_enabled(False)
        timings["spans off"].append(_mean_us(lambda: wrapped.allreduce(x).wait(), REPS))
        recorder.set_enabled(True)
        timings["spans on"].append(_mean_us(lambda: wrapped.allreduce(x).wait(), REPS))
        native.drain()
    read_us = statistics.median(_mean_us(flight.snapshot, 200) for _ in range(ROUNDS))
    base = statistics.median(timings["fake group"])
    print(f"one all_reduce (1 KiB) issued and waited from Python, the mean of {REPS} calls, median of {ROUNDS} rounds:")
    for name, values in timings.items():
        us = statistics.median(values)
        print(f"  {name:<10} {us:6.2f} µs  ({us / base:.2f}x the fake group, +{us - base:.2f} µs)")
    print(f"reading the full ring ({len(flight.snapshot().collectives)} entries) into Python: {read_us:.0f} µs")


if __name__ == "__main__":
    main()
