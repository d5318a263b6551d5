"""Does anything pile up on the ranks across layout changes? Rank memory per apply, for `tiny` and `small`.

Re-applies a cycle of layouts (tp, ZeRO-1, FSDP2, a pipeline, DDP; one training step per round) with
telemetry on, and after each apply counts what every rank holds (`workbench.engine.session.held`: RSS,
open fds, Trainers and parameters alive). Prints the growth per apply after the first round (every mesh built
by then) beside the bound it must stay under: what one leaked model weighs (parameters, gradients and AdamW's
two moments, 4x the parameters' bytes), the size of the leak this watched for (issue 17).

    .venv/bin/python benches/soak.py                     # tiny x 30 applies, small x 10
    .venv/bin/python benches/soak.py --presets tiny --applies 60
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench.engine.session import held  # noqa: E402

MIB = 2**20


def layouts(preset: str) -> list[wb.Config]:
    base = wb.Config(model=wb.ModelConfig.preset(preset), batch_size=8, seq_len=64)
    return [base.replace(tp=2), base.replace(dp=2, zero=1), base.replace(dp=2, zero=3),
            base.replace(pp=2, micro_batches=2), base.replace(dp=2)]


def full_parameter_bytes(preset: str) -> int:
    from workbench.models.transformer import build_model

    return sum(p.numel() * p.element_size() for p in build_model(wb.ModelConfig.preset(preset), 0).parameters())


def soak(bench: wb.Workbench, preset: str, applies: int) -> None:
    cycle = layouts(preset)
    leaked_model = 4 * full_parameter_bytes(preset)  # weights, gradients, two AdamW moments: all on one rank at dp
    print(f"\n{preset}: {applies} applies over {', '.join(c.layout for c in cycle)}; "
          f"a leaked model would add up to {leaked_model / MIB:.0f} MiB per apply on a rank")
    print(f"{'apply':>5} {'layout':>14} {'RSS r0 MiB':>11} {'RSS r1 MiB':>11} {'fds':>4} {'trainers':>8} "
          f"{'params alive':>12}")
    rows = []
    for i in range(applies):
        cfg = cycle[i % len(cycle)]
        bench.apply(cfg)
        if i % len(cycle) == len(cycle) - 1:
            bench.train(1).wait()
        per_rank = bench.pool.run(held)
        rows.append(per_rank)
        h = per_rank[0]
        print(f"{i + 1:>5} {cfg.layout:>14} {per_rank[0].rss_bytes / MIB:>11.1f} {per_rank[1].rss_bytes / MIB:>11.1f} "
              f"{h.open_fds:>4} {h.trainers:>8} {h.parameter_bytes / MIB:>9.1f} MiB", flush=True)
    warm = len(cycle)
    if applies <= warm:
        print("too few applies to measure growth after the first round")
        return
    for r in range(2):
        grow = (rows[-1][r].rss_bytes - rows[warm - 1][r].rss_bytes) / (applies - warm)
        fds = (rows[-1][r].open_fds - rows[warm - 1][r].open_fds) / (applies - warm)
        print(f"rank {r}: RSS growth after apply {warm}: {grow / MIB:+.2f} MiB per apply "
              f"({grow / leaked_model:+.3f} of a leaked model), fds {fds:+.2f} per apply, "
              f"trainers alive at the end {rows[-1][r].trainers}")
    print(f"SOAK_{preset.upper()}_MIB_PER_APPLY="
          f"{max(rows[-1][r].rss_bytes - rows[warm - 1][r].rss_bytes for r in range(2)) / (applies - warm) / MIB:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--applies", type=int, default=None, help="default: 30 for tiny, 10 for larger presets")
    args = parser.parse_args(argv)
    with wb.Workbench(2) as bench:
        for preset in args.presets:
            soak(bench, preset, args.applies or (30 if preset == "tiny" else 10))


if __name__ == "__main__":
    main(sys.argv[1:])
