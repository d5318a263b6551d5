"""wb.estimate under context parallel and HSDP against what the ranks measure on the same steps.

Activations: within the 1% the other layouts meet (tests/test_estimate_vs_measured.py; measured here: 4 bytes
apart, the scalar loss). The K/V ring's sends, the gradient sync and the optimizer's shard: exact, as all follow
from shapes.
"""

from __future__ import annotations

import pytest

from tests.engine import context_rank_fns as cfns
from workbench.config import Config
from workbench.estimate import estimate, grad_sync_bytes_per_step

CP = Config(cp=2, batch_size=8, seq_len=256)  # each rank: 8 sequences × 128 of their 256 tokens


@pytest.mark.parametrize("cfg", [CP, CP.replace(precision="bf16", activation_checkpointing="selective"),
                                 CP.replace(zero=3, micro_batches=2, activation_checkpointing="full")],
                         ids=lambda cfg: cfg.layout.replace("·", "-"))
def test_estimated_activations_under_cp_are_the_measured_peak(pool, cfg):
    est = estimate(cfg)
    # cp divides what a rank saves: the same as one rank holding seq_len/cp of every sequence.
    whole = cfg.replace(cp=1, zero=0, seq_len=cfg.seq_len // cfg.cp)
    assert est.memory.activations == estimate(whole).memory.activations
    for r in pool.run(cfns.train_recording, cfg):
        assert est.memory.activations == pytest.approx(r["peak"]["activations"], rel=0.01)
        # The ring's sends as the recording backend saw them: every call, every byte (recomputation included).
        sends = [n for name, n, group in r["comm"] if name == "send" and group == "mesh_cp"]
        ring = [c for c in est.comm if c.axis == "cp"]
        assert (len(sends), sum(sends)) == (sum(c.calls for c in ring), sum(c.bytes for c in ring))
        # ZeRO over dp·cp: the moments of this rank's half of every parameter, and the gradients it syncs.
        assert est.memory.optimizer == r["optimizer"]
        assert grad_sync_bytes_per_step(cfg) == r["grad_sync_bytes"]


def test_estimated_hsdp_state_and_sync_are_the_measured_ones(pool4):
    cfg = Config(dp=4, zero=3, dp_replicate=2, batch_size=8, seq_len=64)
    est = estimate(cfg)
    # Sharded over the shard group of 2, not over all 4 dp ranks.
    assert est.memory.optimizer == estimate(cfg.replace(dp=2, dp_replicate=1, batch_size=4)).memory.optimizer
    for r in pool4.run(cfns.train_recording, cfg):
        assert est.memory.optimizer == r["optimizer"]
        assert grad_sync_bytes_per_step(cfg) == r["grad_sync_bytes"]
        for kind, group in (("reduce_scatter", "mesh_dp_shard"), ("all_reduce", "mesh_dp_replicate")):
            recorded = [n for name, n, g in r["comm"] if name == kind and g == group]
            (c,) = [c for c in est.comm if c.kind == kind and c.what.startswith("gradients")]
            assert (c.calls, c.bytes) == (len(recorded), sum(recorded)), kind
