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
from workbench.emulation import rank as emulation  # noqa: E402
from workbench.schedules import ActionInterval, measured_bubble  # noqa: E402

MODEL = wb.ModelConfig(dim=128, n_layers=2, n_heads=4)
MOE = wb.ModelConfig(dim=128, n_layers=2, n_heads=4, n_experts=4, top_k=2)
# 1,024 tokens a step: a CPU core computes it ~1,000x slower than the estimate of an H100, so that the emulated
# collectives (tens of µs there, tens of ms here) stay well above what loopback itself takes (under 1-2 ms).
BASE = wb.Config(model=MODEL, batch_size=8, seq_len=128)
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
        bench.train(steps).wait()
        paced, overruns = map(sum, zip(*((s["paced"], s["overruns"]) for s in pool.run(emulation.status))))
        return {r: bench.store.steps(r) for r in range(pool.world_size)}, overruns / max(paced, 1)
    finally:
        bench.close()


def main() -> None:
    print(f"emulated step vs estimate, 2 ranks, {MODEL.dim}-dim {MODEL.n_layers}-layer model, batch "
          f"{BASE.batch_size}×{BASE.seq_len}, fp32, target 2 × h100; undilated µs (each step by the dilation it "
          f"was paced with), medians of the paced steps, the busiest rank. exposed: communication no compute hid "
          f"(under pp also the bubble); pred: as on the GPUs; cpu: as this engine can overlap here (FSDP2 blocks "
          f"without CUDA streams). overrun: collectives whose real transfer outlasted the emulated time")
    print(f"{'case':<27}{'compute':>8}{'pred':>7}{'ratio':>6}{'exposed':>9}{'pred':>7}{'cpu':>7}{'ratio':>6}"
          f"{'colls':>6}{'pred':>5}{'bubble':>8}{'pred':>6}{'dilation':>9}{'overrun':>8}")
    with wb.Pool(2, device="cpu", preload=("workbench.engine.session",),
                 backend_setup="workbench.telemetry.comm:register") as pool:
        for name, (cfg, shape) in CASES.items():
            cluster = wb.Cluster(**shape)
            everyone, overrun = _run(pool, cluster, cfg, STEPS)
            per_rank = undilated(list(everyone.values()))
            paced = range(len(per_rank[0]))
            compute = statistics.median(max(r[k].compute_s for r in per_rank) for k in paced)
            exposed = statistics.median(max(r[k].exposed_s for r in per_rank) for k in paced)
            calls = max(r[-1].collectives for r in per_rank)
            topology = cluster.for_world(2).topology
            pred, here = predicted(cfg, topology), predicted(cfg, topology, fsdp_overlaps=False)
            bubble = pred_bubble = float("nan")
            if cfg.pp > 1:
                bubble = statistics.median(measured_bubble(
                    [ActionInterval(r, *a) for r, h in everyone.items() for a in h[k].pipeline_actions]).fraction
                    for k in range(STEPS) if everyone[0][k].dilation)
                pred_bubble = pred.bubble
            dilation = statistics.median(m.dilation for m in everyone[0] if m.dilation)
            print(f"{name:<27}{compute * 1e6:>8.1f}{pred.compute_s * 1e6:>7.1f}{compute / pred.compute_s:>6.2f}"
                  f"{exposed * 1e6:>9.1f}{pred.exposed_s * 1e6:>7.1f}{here.exposed_s * 1e6:>7.1f}"
                  f"{exposed / here.exposed_s:>6.2f}{calls:>6}{pred.collectives:>5}{bubble:>8.0%}{pred_bubble:>6.0%}"
                  f"{dilation:>9.0f}{overrun:>8.0%}", flush=True)


if __name__ == "__main__":
    main()
