"""How long wb.plan takes for a large run: every layout of Llama-3.1-70B on 256 H100s, estimated by the GPU model.

    .venv/bin/python benches/plan.py [--model 70b] [--hardware h100] [--gpus 256] [--global-batch 512]

Prints the plan's wall time, the layouts it tried, and the ratio of its time to as many single estimates of the
fastest layout, measured in the same run, as it sized (below 1: a layout that does not fit is refused on its memory,
its time never priced; above: enumeration and Config's validation), then the top layouts.
"""

from __future__ import annotations

import argparse
import time

import workbench as wb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="70b")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()

    start = time.perf_counter()
    plan = wb.plan(args.model, args.hardware, args.gpus, args.global_batch, seq_len=args.seq_len)
    plan_s = time.perf_counter() - start
    tried = len(plan.ranked) + len(plan.refused)

    best = plan.best.config
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        wb.estimate(best, args.hardware)
    one_s = (time.perf_counter() - start) / reps
    # A valid layout is sized (its memory); only one that fits is priced (its time: the whole estimate).
    sized = len(plan.ranked) + sum(c.memory is not None for c in plan.refused)
    print(f"wb.plan({args.model!r}, {args.hardware!r}, {args.gpus}, {args.global_batch}, seq_len={args.seq_len}): "
          f"{plan_s:.2f} s for {tried:,} layouts ({sized:,} sized, {len(plan.ranked):,} fit and priced)")
    print(f"one estimate of the best layout: {one_s * 1e3:.2f} ms; plan / (sized × one estimate) = "
          f"{plan_s / (sized * one_s):.2f}")
    print(plan.table(5))


if __name__ == "__main__":
    main()
