"""Emulated links against the link model (issue 19.4a): every kind of collective, 1 KiB to 64 MiB, measured on
2 ranks of this machine while they emulate 2 H100 nodes over 25 GbE, beside what `workbench.links` says (× the
dilation). Prints measured / model per kind and size, the loopback time of the same collective unpaced in the
same run, and whether |measured - model| <= 5% of the model + the scheduling floor.

The floor is what this machine adds to any paced collective: waking the timer thread, returning to Python, the
barrier that lines the ranks up; FLOOR_S below, stated, not fitted. A fixed dilation makes the emulated times
5-1000× the loopback ones, so the pacing (not loopback) is what is measured.

    .venv/bin/python benches/emulation.py            # ~1 min
    .venv/bin/python benches/emulation.py --quick    # 1 KiB and 1 MiB only
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench import links  # noqa: E402
from workbench.emulation import rank as emulation  # noqa: E402
from workbench.emulation.collectives import KINDS, time_kinds  # noqa: E402

CLUSTER = wb.Cluster("h100-25gbe", nodes=2, dilation=100.0)
SIZES = (2**10, 2**15, 2**20, 2**23, 2**26)
FLOOR_S = 2e-3
TOLERANCE = 0.05
REPS = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes = (2**10, 2**20) if args.quick else SIZES
    topology = CLUSTER.for_world(2).topology
    with wb.Pool(2, device="cpu", backend_setup="workbench.telemetry.comm:register") as pool:
        loopback = pool.run(time_kinds, KINDS, sizes, REPS)
        with tempfile.TemporaryDirectory(prefix="workbench-links-") as arrivals:
            pool.run(emulation.install, CLUSTER, arrivals)
            paced = pool.run(time_kinds, KINDS, sizes, REPS)
            overruns = pool.run(emulation.status)[0]["overruns"]
            pool.run(emulation.uninstall)
    print(f"emulation bench: {CLUSTER.for_world(2).describe()}, dilation ×{CLUSTER.dilation:g}; best of {REPS}, the slower rank")
    print(f"pass: |measured - model| <= {TOLERANCE:.0%} of model + floor {FLOOR_S * 1e3:g} ms")
    print(f"{'kind':<15}{'bytes':>10}{'model ms':>11}{'measured ms':>13}{'ratio':>8}{'loopback ms':>13}  ok")
    worst, failed = 0.0, 0
    for kind in KINDS:
        for nbytes in sizes:
            model = CLUSTER.dilation * links.collective_time(kind, nbytes, (0, 1), topology)
            measured = max(r[kind, nbytes] for r in paced)
            loop = max(r[kind, nbytes] for r in loopback)
            ok = abs(measured - model) <= TOLERANCE * model + FLOOR_S
            failed += not ok
            if model > 20 * FLOOR_S:  # where the floor no longer matters
                worst = max(worst, abs(measured / model - 1))
            print(f"{kind:<15}{nbytes:>10}{model * 1e3:>11.2f}{measured * 1e3:>13.2f}{measured / model:>8.3f}"
                  f"{loop * 1e3:>13.2f}  {'yes' if ok else 'NO'}")
    print(f"{len(KINDS) * len(sizes) - failed}/{len(KINDS) * len(sizes)} within {TOLERANCE:.0%} + floor; "
          f"worst |ratio - 1| where model > {20 * FLOOR_S * 1e3:g} ms: {worst:.3f}; "
          f"collectives whose real transfer outlasted the model (rank 0): {overruns}")


if __name__ == "__main__":
    main()
