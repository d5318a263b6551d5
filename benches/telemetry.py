"""What full telemetry costs: step time of the tiny model's dp=2 run with it on vs off, in one run.

Alternates off/on several times (the machine is shared and noisy) and prints
the ratio of medians, then where the probe's own time goes on a rank.

    .venv/bin/python benches/telemetry.py
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402

CFG = wb.Config(dp=2)
WARMUP, STEPS, ROUNDS = 3, 15, 3


def step_times(bench: wb.Workbench) -> list[float]:
    bench.train(WARMUP).wait()
    return [m.step_time_s for m in bench.train(STEPS).wait()]


def probe_costs() -> dict[str, float]:
    """Time each probe piece on a rank, on the trained model (microseconds per call)."""
    from workbench.pool import rank
    from workbench.telemetry import native, probes

    from workbench.engine.session import current

    trainer = current().trainer
    modules, optimizers = trainer.modules, trainer.optimizers

    def per_call(fn, n=200):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    ivs = [wb.Interval("compute", "x", i * 10, i * 10 + 5) for i in range(50)]
    return {
        "parameter_bytes": per_call(lambda: probes.parameter_bytes(modules)),
        "gradient_bytes": per_call(lambda: probes.gradient_bytes(modules)),
        "optimizer_bytes": per_call(lambda: probes.optimizer_bytes(optimizers)),
        "process_bytes": per_call(lambda: probes.process_bytes(trainer.device)),
        "span open+close": per_call(lambda: native.span("compute", "x").__enter__() or None),
        "drain (empty)": per_call(native.drain),
        "step_summary(50 spans)": per_call(lambda: native.step_summary(ivs)),
    }


def main() -> None:
    benches = {flag: wb.Workbench(2, device="cpu", telemetry=flag) for flag in (False, True)}
    try:
        for bench in benches.values():
            bench.apply(CFG)
        times = {False: [], True: []}
        for _ in range(ROUNDS):
            for flag, bench in benches.items():
                times[flag] += step_times(bench)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"tiny model, dp=2, {ROUNDS}×{STEPS} steps each, alternating")
        print(f"step time, telemetry off: median {off * 1e3:.1f} ms")
        print(f"step time, telemetry on:  median {on * 1e3:.1f} ms")
        print(f"ratio on/off: {on / off:.3f}")
        costs = benches[True].pool.run(probe_costs)[0]
        print("probe pieces on rank 0 (µs per call):")
        for name, us in costs.items():
            print(f"  {name:24s} {us:8.1f}")
    finally:
        for bench in benches.values():
            bench.close()


if __name__ == "__main__":
    main()
