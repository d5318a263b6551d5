"""The emulated step against the estimator's prediction for the same cluster (issue 19.4b), on 2 ranks: compute,
exposed communication and the pipeline bubble, undilated, beside what `wb.estimate` predicts for 2 H100s.

The prediction (`workbench.emulation.predict`) is the estimator's own traffic and overlap accounting with every
collective priced by `workbench.links` on the emulated topology, plus the trainer's per-step vote all-reduce.
Compute agrees by construction (the dilation is measured compute over the estimator's compute of the same step on
the target: one model of the GPU for both); the figures with content are the exposed communication, the
collectives counted, and the bubble.

Each case runs with the dilation measured every step (as a Workbench does); each paced step is undilated by the
dilation its rank paced it with, so compute and communication are divided by the same number.

Each rank's exposed communication is split (`workbench.emulation.arrivals`) into the wait for the last peer to
arrive and the transfer the pacer timed from then on. The prediction's ranks arrive together (they compute the
same work at the same speed), so outside a pipeline the transfer is what it predicts; the wait is printed apart,
with how much of it the ranks' own compute before each collective accounts for: here two ranks computing the same
work on two shared cores at different speeds (not a cluster's), and under ep also the router giving one rank's
experts more tokens (a cluster's too; the estimator assumes balanced routing). Under pp the waits are the
pipeline's and are in the prediction; its bubble is also run in time with the measured actions in the estimate's
place, which tells pacing from compute.

    .venv/bin/python benches/emulation_estimate.py
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench import links  # noqa: E402
from workbench.emulation import rank as emulation  # noqa: E402
from workbench.emulation.arrivals import compute_behind, match, split_exposed  # noqa: E402
from workbench.emulation.predict import bubble_at_measured_compute, predicted, undilated  # noqa: E402
from workbench.schedules import ActionInterval, measured_bubble  # noqa: E402
from workbench.telemetry.analysis import subtract  # noqa: E402

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


def _pacing(arrivals, dilation: float, topology) -> list[float]:
    """Each matched collective's paced transfer over what the link model gives it, dilated (1: exactly paced)."""
    out = []
    for a in arrivals:
        model = links.collective_time(a.name if a.name in links.KINDS else "all_reduce", a.bytes, (0, 1), topology)
        out.append(a.transfer_s / (dilation * model))
    return out


def _between_actions(step) -> float:
    """Seconds a pipeline rank spent between its actions neither computing nor waiting on a collective (the
    schedule's own Python, preparing a send): on a GPU the CPU runs ahead and hides it; here it widens the bubble."""
    actions = sorted((a[3], a[4]) for a in step.pipeline_actions)
    gaps = subtract([(actions[0][0], actions[-1][1])], actions)
    waits = [(iv.start_ns, iv.end_ns) for iv in step.intervals if iv.kind in ("wait", "comm")]
    return sum(end - start for start, end in subtract(gaps, waits)) * 1e-9


def _router_share(cfg, step) -> float:
    """The busiest expert-parallel rank's (token, expert) assignments over the mean, the worst layer's (1: even)."""
    per_rank = cfg.model.n_experts // cfg.ep
    worst = 1.0
    for layer in step.expert_load:
        ranks = [sum(layer[r * per_rank:(r + 1) * per_rank]) for r in range(cfg.ep)]
        worst = max(worst, max(ranks) / (sum(ranks) / cfg.ep)) if sum(ranks) else worst
    return worst


def main() -> None:
    print(f"emulated step vs estimate, 2 ranks, {MODEL.dim}-dim {MODEL.n_layers}-layer model, batch "
          f"{BASE.batch_size}×{BASE.seq_len}, fp32, target 2 × h100; undilated µs (each step by the dilation it "
          f"was paced with), medians of the paced steps, the busiest rank. exposed: communication no compute hid "
          f"(under pp also the bubble) = wait (for the last peer to arrive) + xfer (the paced transfer after it); "
          f"pred: the estimate as this engine can overlap on CPU ranks (FSDP2 blocks without CUDA streams; "
          f"gpu: as on the GPUs). ratio: xfer / pred (pp: exposed / pred, its waits are the pipeline's). "
          f"bubble: measured, predicted, and the schedule run with the measured actions (at meas.)")
    print(f"{'case':<27}{'compute':>8}{'pred':>7}{'ratio':>6}{'exposed':>9}{'wait':>7}{'xfer':>7}{'pred':>7}"
          f"{'gpu':>7}{'ratio':>6}{'colls':>6}{'pred':>5}{'bubble':>8}{'pred':>6}{'meas.':>6}")
    diagnosis = []
    with wb.Pool(2, device="cpu", preload=("workbench.engine.session",),
                 backend_setup="workbench.telemetry.comm:register") as pool:
        for name, (cfg, shape) in CASES.items():
            cluster = wb.Cluster(**shape)
            topology = cluster.for_world(2).topology
            everyone, overrun = _run(pool, cluster, cfg, STEPS)
            per_rank = undilated(list(everyone.values()))
            paced_steps = [k for k in range(STEPS) if everyone[0][k].dilation]
            compute = statistics.median(max(r[k].compute_s for r in per_rank) for k in range(len(paced_steps)))
            rows, pacing, bubbles = [], [], []
            for k in paced_steps:
                steps = [everyone[r][k] for r in range(2)]
                dilation = steps[0].dilation
                arrivals = match([m.intervals for m in steps])
                split = [split_exposed(m.intervals, arrivals, r) for r, m in enumerate(steps)]
                skew = sum(a.skew_s for a in arrivals)
                rows.append((max(s.exposed_s for s in split) / dilation, max(s.waiting_s for s in split) / dilation,
                             max(s.transfer_s for s in split) / dilation, skew / dilation,
                             compute_behind([m.intervals for m in steps], arrivals) / dilation))
                pacing += _pacing(arrivals, dilation, topology)
                if cfg.pp > 1:
                    actions = [ActionInterval(r, *a) for r, m in enumerate(steps) for a in m.pipeline_actions]
                    bubbles.append((measured_bubble(actions).fraction,
                                    bubble_at_measured_compute(cfg, actions, topology, dilation),
                                    max(map(_between_actions, steps)) / dilation))
            exposed, wait, xfer, skew, behind = (statistics.median(row[i] for row in rows) for i in range(5))
            calls = max(r[-1].collectives for r in per_rank)
            pred, here = predicted(cfg, topology), predicted(cfg, topology, fsdp_overlaps=False)
            compared = exposed if cfg.pp > 1 else xfer
            bubble = at_measured = pred_bubble = between = float("nan")
            if bubbles:
                bubble, at_measured, between = (statistics.median(b[i] for b in bubbles) for i in range(3))
                pred_bubble = pred.bubble
            print(f"{name:<27}{compute * 1e6:>8.1f}{pred.compute_s * 1e6:>7.1f}{compute / pred.compute_s:>6.2f}"
                  f"{exposed * 1e6:>9.1f}{wait * 1e6:>7.1f}{xfer * 1e6:>7.1f}{here.exposed_s * 1e6:>7.1f}"
                  f"{pred.exposed_s * 1e6:>7.1f}{compared / here.exposed_s:>6.2f}{calls:>6}{pred.collectives:>5}"
                  f"{bubble:>8.0%}{pred_bubble:>6.0%}{at_measured:>6.0%}", flush=True)
            pacing.sort()
            router = (statistics.median(_router_share(cfg, everyone[0][k]) for k in paced_steps)
                      if cfg.model.n_experts else float("nan"))
            dilation = statistics.median(everyone[0][k].dilation for k in paced_steps)
            diagnosis.append((name, skew, behind, pacing[len(pacing) // 2], pacing[9 * len(pacing) // 10],
                              overrun, dilation, router, between))
    print("\nwhere the wait and the transfer come from: skew: the ranks' arrivals apart, summed over the step's "
          "collectives (µs, undilated); compute: of it, how much longer the later rank computed since the "
          "collective before; pacing: each collective's paced transfer / its dilated link-model time, median and "
          "90th percentile; overrun: collectives whose real transfer outlasted the emulated time; router: the busiest "
          "ep rank's tokens / the mean; between: a pipeline rank's time between its actions neither computing nor "
          "in a collective (µs; the schedule's Python, which a GPU's CPU hides by running ahead)")
    print(f"{'case':<27}{'skew':>7}{'compute':>9}{'share':>7}{'pacing':>8}{'p90':>6}{'overrun':>8}{'dilation':>9}"
          f"{'router':>7}{'between':>8}")
    for name, skew, behind, median, p90, overrun, dilation, router, between in diagnosis:
        print(f"{name:<27}{skew * 1e6:>7.1f}{behind * 1e6:>9.1f}{behind / skew if skew else 0:>7.0%}{median:>8.3f}"
              f"{p90:>6.2f}{overrun:>8.0%}{dilation:>9.0f}{router:>7.2f}{between * 1e6:>8.1f}")


if __name__ == "__main__":
    main()
