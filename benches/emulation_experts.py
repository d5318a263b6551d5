"""The hierarchical expert exchange vs the flat one (issue 19.6), on 4 ranks emulating 2 H100 nodes of 2 GPUs
(InfiniBand between them), measured in one run: rows sent to the other node per step (from the exchange's own
count), messages a node sends across per exchange (arithmetic: `expert_links.expert_exchange_traffic`), step time
(the dilation measured on the flat layout, held fixed for both), and that the losses are identical.

Expected from the arithmetic: the same rows cross (k(n-k)/n of a node's, n = 4 ranks, k = 2 a node: half), in
k(N-1) = 2 messages a node instead of k(n-k) = 4; the two-level exchange adds a hop inside the node, so with
NCCL-style concurrent sends (what the link model prices) it is not faster: it pays where per-message costs or
top-k duplicates bound for one node dominate.

    .venv/bin/python benches/emulation_experts.py
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import workbench as wb  # noqa: E402
from workbench import expert_links  # noqa: E402

MOE = wb.ModelConfig(dim=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, capacity_factor=2.0)
CFG = wb.Config(model=MOE, batch_size=8, seq_len=32, dp=4, ep=4)
SHAPE = dict(target="h100-ib", nodes=2)
MFU = 0.4  # the dilation's basis: the H100 at 40% MFU, as on the large run the small model stands for
STEPS = 5


def network_rows() -> int:
    from workbench.engine.parallel.expert import expert_modules
    from workbench.engine.session import current

    return sum(m.network_rows for module in current().trainer.modules for _, m in expert_modules(module))


def run(bench: wb.Workbench, exchange: str) -> tuple[list, list[int]]:
    bench.apply(CFG.replace(expert_exchange=exchange), fresh=True)
    steps = bench.train(STEPS).wait()
    return steps, bench.pool.run(network_rows)


def main() -> None:
    with wb.Workbench(4, cluster=wb.Cluster(**SHAPE, efficiency=MFU)) as bench:
        first, _ = run(bench, "flat")
        d = first[-1].dilation  # what the last step was paced with, measured from the steps before it
        bench.emulate(wb.Cluster(**SHAPE, dilation=d))
        results = {exchange: run(bench, exchange) for exchange in ("flat", "hierarchical")}
        topology = bench.cluster.topology
    print(f"expert exchange bench: 4 ranks as {topology.describe()}; ep=4, {MOE.n_experts} experts top-{MOE.top_k}, "
          f"dilation ×{d:.3g} (measured on flat, then fixed); medians of steps 1..{STEPS - 1}")
    flat_steps, flat_rows = results["flat"]
    for exchange, (steps, rows) in results.items():
        traffic = expert_links.expert_exchange_traffic(1.0, range(4), topology, hierarchical=exchange == "hierarchical")
        ms = statistics.median(m.step_time_s for m in steps[1:]) / d * 1e3
        node0 = rows[0] + rows[1]
        print(f"  {exchange:<13} step {ms:.3f} ms undilated ({ms / (statistics.median(m.step_time_s for m in flat_steps[1:]) / d * 1e3):.2f}× flat); "
              f"rows node 0 sent across in the last forward {node0} ({node0 / (flat_rows[0] + flat_rows[1]):.2f}× flat); "
              f"messages a node sends across per exchange {traffic.network_messages}; "
              f"losses identical to flat: {[m.loss for m in steps] == [m.loss for m in flat_steps]}")


if __name__ == "__main__":
    main()
