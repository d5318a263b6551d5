"""Where a pipeline's idle time goes on this machine, schedule by schedule, at pp = 2 (a core a rank): the idle each
rank measured, the schedule's order replayed with each action's own measured time (no communication), the
formula at the step's mean times, and what the replay leaves unexplained per action (the runtime between actions
and the p2p hop). The same model and micro-batches for every schedule, so the milliseconds compare directly; the
ratios against 1F1B are measured in this run.

What `tests/engine/test_pipeline.py::test_each_schedule_idles_as_its_order_replayed_says_and_zero_bubble_idles_least`
bounds (at most 3 ms an action unexplained; ZB-V's order idles less than 1F1B's).

    .venv/bin/python benches/pipeline_bubble.py          # about a minute
"""

from __future__ import annotations

import dataclasses
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench.schedules import placement  # noqa: E402
from workbench.telemetry.pipeline import pipeline_bubble, pipeline_intervals  # noqa: E402

STEPS, WARMUP = 6, 2
MODEL = dataclasses.replace(wb.Config().model, n_layers=8)
SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")


def config(schedule: str) -> wb.Config:
    # 8 blocks: the V's 4 stages hold 2 each; m = 2·pp is DualPipeV's minimum.
    return wb.Config(model=MODEL, pp=2, schedule=schedule, stages_per_rank=2, micro_batches=4, batch_size=8,
                     seq_len=128)


def measure(bench: wb.Workbench, schedule: str) -> dict[str, float]:
    cfg = config(schedule)
    bench.apply(cfg, fresh=True)
    bench.train(STEPS).wait()
    steps = {r: bench.store.steps(r)[-STEPS:] for r in range(cfg.world_size)}
    rows = []
    for i in range(WARMUP, STEPS):
        intervals = pipeline_intervals({r: s[i] for r, s in steps.items()}, cfg.pp, placement(schedule))
        b = pipeline_bubble(cfg, intervals)
        rows.append({"measured": b.measured.idle_ns / 1e6, "replay": b.replay_ns / 1e6,
                     "formula": b.formula_ns / 1e6, "actions": len(intervals) / cfg.pp})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    with wb.Workbench(2) as bench:
        print(f"pipeline bubble bench: pp=2, {MODEL.n_layers} blocks of dim {MODEL.dim}, 4 micro-batches of "
              f"2×128 tokens; idle per rank, ms, medians of {STEPS - WARMUP} steps after {WARMUP}")
        results = {s: measure(bench, s) for s in SCHEDULES}
    print(f"{'schedule':>17} {'measured':>9} {'replayed':>9} {'formula':>8} {'actions':>8} {'unseen/action':>14}")
    for s, r in results.items():
        print(f"{s:>17} {r['measured']:9.1f} {r['replay']:9.1f} {r['formula']:8.1f} {r['actions']:8.0f} "
              f"{(r['measured'] - r['replay']) / r['actions']:11.2f} ms")
    one = results["1f1b"]
    for s in ("zbv", "dualpipev"):
        print(f"{s} / 1f1b: measured idle {results[s]['measured'] / one['measured']:.2f}, replayed "
              f"{results[s]['replay'] / one['replay']:.2f}")


if __name__ == "__main__":
    main()
