"""The hierarchical expert exchange on 4 ranks standing for 2 nodes of 2: the same losses as the flat exchange,
bit for bit (it moves the same rows into the same order), and the same rows across the nodes."""

from __future__ import annotations

import pytest

import workbench as wb
from workbench.config import ConfigError, ModelConfig

MOE = ModelConfig(dim=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, capacity_factor=2.0)
BASE = wb.Config(model=MOE, batch_size=8, seq_len=16, dp=4, ep=4)
# Dilation 1: H100 speed, so the pacing costs nothing here; what matters is where the emulated nodes are.
CLUSTER = wb.Cluster("h100-ib", nodes=2, dilation=1.0)


def network_rows() -> list[int]:
    from workbench.engine.parallel.expert import expert_modules
    from workbench.engine.session import current

    return [m.network_rows for module in current().trainer.modules for _, m in expert_modules(module)]


def test_hierarchical_exchange_trains_the_flat_exchanges_losses_bit_for_bit(pool4):
    bench = wb.Workbench(pool=pool4, cluster=CLUSTER)
    try:
        runs, rows = {}, {}
        for exchange in ("flat", "hierarchical"):
            bench.apply(BASE.replace(expert_exchange=exchange), fresh=True)
            runs[exchange] = [m.loss for m in bench.train(2).wait()]
            rows[exchange] = bench.pool.run(network_rows)
    finally:
        bench.close()
    assert runs["hierarchical"] == runs["flat"]
    # Per node (ranks 0-1, 2-3) the same rows cross to the other node; some do.
    for node in ((0, 1), (2, 3)):
        assert sum(sum(rows["hierarchical"][r]) for r in node) == sum(sum(rows["flat"][r]) for r in node) > 0


def test_hierarchical_without_experts_is_refused():
    with pytest.raises(ConfigError, match="^expert_exchange: .*ep=1"):
        wb.Config(expert_exchange="hierarchical")
