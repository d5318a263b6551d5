"""The emulated step against the estimator's prediction for the same cluster (issue 19.4b), on 2 ranks: compute,
exposed communication and the pipeline bubble, undilated, beside what `wb.estimate` predicts for 2 H100s.

The prediction (`workbench.emulation.predict`) is the estimator's own traffic and overlap accounting with every
collective priced by `workbench.links` on the emulated topology, plus the trainer's per-step vote all-reduce.
Compute agrees by construction (the dilation is measured compute over the estimator's compute of the same step on
the target: one model of the GPU for both); the figures with content are the exposed communication, the
collectives counted, and the bubble.

Each case runs with the dilation measured every step (as a Workbench does); each paced step is undilated by the
dilation its rank paced it with, so compute and communication are divided by the same number.

    .venv/bin/python benches/emulation_estimate.py
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench.emulation.predict import predicted, undilated  # noqa: E402
from workbench.schedules import ActionInterval, ideal_bubble_fraction, measured_bubble  # noqa: E402

MODEL = wb.ModelConfig(dim=64, n_layers=2, n_heads=2)
MOE = wb.ModelConfig(dim=64, n_layers=2, n_heads=2, n_experts=4, top_k=2)
BASE = wb.Config(model=MODEL, batch_size=8, seq_len=64)
CASES = {
    "dp=2 zero=3, 2 IB nodes": (BASE.replace(dp=2, zero=3), dict(target="h100-ib", nodes=2)),
    "tp=2 inside one node": (BASE.replace(tp=2), dict(target="h100-ib", nodes=1)),
    "tp=2 across 2 IB nodes": (BASE.replace(tp=2), dict(target="h100-ib", nodes=2)),
    "pp=2 1F1B m=4, 2 IB nodes": (BASE.replace(pp=2, micro_batches=4, schedule="1f1b"), dict(target="h100-ib", nodes=2)),
    "ep=2 dp=2, 2 IB nodes": (BASE.replace(model=MOE, dp=2, ep=2), dict(target="h100-ib", nodes=2)),
}
STEPS = 6


def _run(pool, cluster, cfg, steps):
    bench = wb.Workbench(pool=pool, cluster=cluster)
    try:
        bench.apply(cfg, fresh=True)
        rank0 = bench.train(steps).wait()
        return rank0, {r: bench.store.steps(r) for r in range(pool.world_size)}
    finally:
        bench.close()


def main() -> None:
    print(f"emulated step vs estimate, 2 ranks, {MODEL.dim}-dim {MODEL.n_layers}-layer model, batch "
          f"{BASE.batch_size}×{BASE.seq_len}, fp32, target 2 × h100; undilated ms (each step by the dilation it ran "
          f"at), medians of steps 2..{STEPS - 1}, the busiest rank")
    print(f"{'case':<28}{'compute':>9}{'pred':>8}{'exposed':>9}{'pred':>8}{'ratio':>7}{'colls':>7}{'pred':>6}"
          f"{'bubble':>8}{'pred':>7}")
    with wb.Pool(2, device="cpu", preload=("workbench.engine.session",),
                 backend_setup="workbench.telemetry.comm:register") as pool:
        for name, (cfg, shape) in CASES.items():
            cluster = wb.Cluster(**shape)
            _, everyone = _run(pool, cluster, cfg, STEPS)
            per_rank = undilated(list(everyone.values()))
            paced = range(len(per_rank[0]))
            compute = statistics.median(max(r[k].compute_s for r in per_rank) for k in paced)
            exposed = statistics.median(max(r[k].exposed_s for r in per_rank) for k in paced)
            calls = max(r[-1].collectives for r in per_rank)
            pred = predicted(cfg, cluster.for_world(2).topology)
            pred_compute, pred_exposed, pred_calls = pred.compute_s, pred.exposed_s, pred.collectives
            bubble = pred_bubble = float("nan")
            if cfg.pp > 1:
                bubble = statistics.median(measured_bubble(
                    [ActionInterval(r, *a) for r, h in everyone.items() for a in h[k].pipeline_actions]).fraction
                    for k in range(2, STEPS))
                pred_bubble = ideal_bubble_fraction(cfg.pp, cfg.micro_batches)
            print(f"{name:<28}{compute * 1e3:>9.4f}{pred_compute * 1e3:>8.4f}{exposed * 1e3:>9.4f}"
                  f"{pred_exposed * 1e3:>8.4f}{exposed / pred_exposed:>7.2f}{calls:>7}{pred_calls:>6}"
                  f"{bubble:>8.0%}{pred_bubble:>7.0%}", flush=True)


if __name__ == "__main__":
    main()
