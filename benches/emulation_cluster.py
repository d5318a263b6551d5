"""What an emulated cluster lets you see on this machine (issue 19.5), as ratios measured in one run on 2 ranks:

  1. gradient compression (int8, 1-bit vs none) on 2 emulated nodes over 25 GbE, and inside one NVLink node;
  2. tensor parallel across two nodes (InfiniBand) vs inside one node (NVLink);
  3. a 2-stage 1F1B pipeline across two nodes vs inside one: its bubble and its exposed send/recv.

Each layout's time dilation is measured from its own uncompressed steps (this rank's compute over the H100's
time for the same FLOPs at 40% MFU: the small model stands for a large run, which reaches that, where the
estimator's kernel model would rightly say a 64-wide model leaves an H100 idle) and then held fixed for its
variants, so the quantisers' CPU time does not move it. Step times are medians after a warm-up; undilated = measured / dilation, what the H100s would take.

    .venv/bin/python benches/emulation_cluster.py            # a few minutes
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench.schedules import ActionInterval, measured_bubble  # noqa: E402

STEPS, WARMUP = 5, 1
# Small enough that a step over emulated 25 GbE takes about a second here (0.5 MB of gradients).
MODEL = wb.ModelConfig(dim=64, n_layers=2, n_heads=2)
BASE = wb.Config(model=MODEL, batch_size=8, seq_len=64)
MFU = 0.4  # the H100's efficiency on the large run the small model stands for
NVLINK_NODE = dict(target="h100-ib", nodes=1)
IB_NODES = dict(target="h100-ib", nodes=2)
ETH_NODES = dict(target="h100-25gbe", nodes=2)


def _run(pool, cluster: wb.Cluster, cfg: wb.Config, steps: int = STEPS):
    bench = wb.Workbench(pool=pool, cluster=cluster)
    try:
        bench.apply(cfg, fresh=True)
        rank0 = bench.train(steps).wait()
        print(f"     ({cfg.layout} on {bench.cluster.describe()}, dilation {bench.links.split('dilated ')[-1][:12]}: "
              f"steps {', '.join(f'{m.step_time_s:.2f}' for m in rank0)} s)", flush=True)
        everyone = {r: bench.store.steps(r) for r in range(pool.world_size)}
        return rank0, everyone
    finally:
        bench.close()


def _dilation(pool, shape: dict, cfg: wb.Config) -> float:
    """The measured dilation of `cfg` on `shape`, from a short run with the dilation measured every step."""
    rank0, _ = _run(pool, wb.Cluster(**shape, efficiency=MFU), cfg, steps=3)
    return rank0[-1].dilation  # what the last step was paced with, measured from the steps before it


def _median_step(rank0) -> float:
    return statistics.median(m.step_time_s for m in rank0[WARMUP:])


def compression(pool) -> None:
    cfg = BASE.replace(dp=2)
    print("1. gradient compression, dp=2 (step time vs none, same dilation within a cluster)")
    for label, shape in (("25 GbE, 2 nodes", ETH_NODES), ("NVLink, 1 node ", NVLINK_NODE)):
        d = _dilation(pool, shape, cfg)
        fixed = wb.Cluster(**shape, dilation=d)
        times = {kind: _median_step(_run(pool, fixed, cfg.replace(compression=kind))[0])
                 for kind in ("none", "int8", "1bit")}
        none = times["none"]
        print(f"   {label}: dilation ×{d:.3g}; none {none / d * 1e3:.3f} ms undilated; "
              f"int8 / none = {times['int8'] / none:.2f}, 1bit / none = {times['1bit'] / none:.2f}")


def tensor_parallel(pool) -> None:
    cfg = BASE.replace(tp=2)
    d = _dilation(pool, NVLINK_NODE, cfg)
    inside = _median_step(_run(pool, wb.Cluster(**NVLINK_NODE, dilation=d), cfg)[0])
    across = _median_step(_run(pool, wb.Cluster(**IB_NODES, dilation=d), cfg)[0])
    print(f"2. tensor parallel tp=2 (dilation ×{d:.3g}): inside one NVLink node {inside / d * 1e3:.3f} ms, across "
          f"two IB nodes {across / d * 1e3:.3f} ms undilated; throughput across / inside = {inside / across:.2f} "
          f"({1 - inside / across:.0%} lost)")


def pipeline(pool) -> None:
    cfg = BASE.replace(pp=2, micro_batches=4, schedule="1f1b")
    d = _dilation(pool, NVLINK_NODE, cfg)
    print(f"3. pipeline pp=2, 1F1B, 4 micro-batches (dilation ×{d:.3g}):")
    for label, shape in (("inside one NVLink node", NVLINK_NODE), ("across two IB nodes   ", IB_NODES),
                         ("across two 25GbE nodes", ETH_NODES)):
        rank0, everyone = _run(pool, wb.Cluster(**shape, dilation=d), cfg)
        bubbles, exposed = [], []
        for step in range(WARMUP, STEPS):
            actions = [ActionInterval(r, *a) for r, steps in everyone.items() for a in steps[step].pipeline_actions]
            bubbles.append(measured_bubble(actions).fraction)
            exposed.append(max(steps[step].exposed_comm_s for steps in everyone.values()))
        print(f"   {label}: step {_median_step(rank0) / d * 1e3:.3f} ms undilated, bubble "
              f"{statistics.median(bubbles):.0%}, exposed send/recv {statistics.median(exposed) / d * 1e3:.3f} ms "
              f"undilated (ideal bubble (p-1)/(m+p-1) = {1 / 5:.0%})")


def main() -> None:
    with wb.Pool(2, device="cpu", preload=("workbench.engine.session",),
                 backend_setup="workbench.telemetry.comm:register") as pool:
        print(f"emulation cluster bench: 2 ranks, {MODEL.dim}-dim {MODEL.n_layers}-layer model, batch "
              f"{BASE.batch_size}×{BASE.seq_len}, fp32; medians of {STEPS - WARMUP} steps after {WARMUP}")
        compression(pool)
        tensor_parallel(pool)
        pipeline(pool)


if __name__ == "__main__":
    main()
