"""The emulated cluster's pure side: shaping a Cluster for a pool, what the native backend is told per group, the
dilation's arithmetic, and the one-line status a notebook shows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from workbench import hardware, links
from workbench.config import Config, ModelConfig
from workbench.estimate import estimate
from workbench.emulation import Cluster, status_line
from workbench.emulation.cluster import (REAL_BUS_BANDWIDTH, dilation_from_steps, emulation_for, fit_real,
                                         group_lines, measured_dilation)
from workbench.emulation.predict import target_compute_s
from workbench.telemetry.events import Interval, StepMetrics


def test_a_cluster_is_shaped_for_the_pool_in_mesh_order():
    assert Cluster("h100-ib", nodes=2).for_world(4).topology == links.preset("h100-ib", nodes=2, gpus_per_node=2)
    assert Cluster("h100-ib", gpus_per_node=1).for_world(2).topology.nodes == 2
    # Neither given: the preset's GPUs per node, or fewer when the pool is smaller (one node of 4).
    assert Cluster("h100-ib").for_world(4).topology.describe().startswith("1 node × 4 h100")
    custom = links.Topology(name="mine", gpu="a100", nodes=2, gpus_per_node=1, intra=links.NVLINK3,
                            network=links.ETH_25G)
    assert Cluster(custom).for_world(2).topology == custom


def test_a_cluster_that_cannot_hold_the_ranks_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="3 ranks do not fill 2 node"):
        Cluster("h100-ib", nodes=2).for_world(3)
    with pytest.raises(ValueError, match="unknown cluster 'dgx-z'"):
        Cluster("dgx-z")
    with pytest.raises(ValueError, match="dilation: must be positive"):
        Cluster(dilation=0)
    with pytest.raises(ValueError, match="needs telemetry=True"):
        emulation_for("h100-ib", 2, telemetry=False)
    assert emulation_for(Cluster("h100-ib", dilation=10), 2, telemetry=False).dilation == 10
    assert emulation_for(None, 2, telemetry=True) is None


def test_a_cluster_crosses_to_the_ranks_as_json():
    cluster = Cluster("h100-25gbe", nodes=2, efficiency=0.5).for_world(2)
    again = Cluster.from_json(cluster.to_json())
    assert again == cluster and again.topology == cluster.topology
    custom = Cluster(links.Topology(name="mine", gpu="a100", nodes=2, gpus_per_node=1, intra=links.NVLINK3,
                                    network=links.ETH_25G), dilation=5.0).for_world(2)
    assert Cluster.from_json(custom.to_json()).topology == custom.topology


def test_group_lines_are_the_link_model_and_a_slow_estimate_of_this_machine():
    topo = links.preset("h100-ib", nodes=2, gpus_per_node=2)
    lines = group_lines((0, 1, 2, 3), 1, topo)
    assert lines.target["all_reduce"] == links.coefficients("all_reduce", (0, 1, 2, 3), topo)
    assert lines.peers[0] == links.coefficients("send", (1, 0), topo)  # same node: NVLink
    assert lines.peers[2] == links.coefficients("send", (1, 2), topo)  # the other node: a network port
    assert lines.peers[1][0].seconds_per_byte == 0  # to itself
    assert lines.target["p2p"] == lines.peers[2]  # a batch is priced at the slowest pair
    assert lines.real["all_reduce"][0].seconds_per_byte == pytest.approx(1.5 / REAL_BUS_BANDWIDTH)  # 2(n-1)/n
    measured = fit_real({("all_gather", 1000): 0.002, ("all_gather", 3000): 0.006, ("send", 1000): 0.001,
                         ("send", 3000): 0.001}, 1000, 3000, n=2, margin=1.5)
    # all_gather on 2 ranks: 2 µs per byte of payload is 4 µs per bus byte (factor 1/2), 0 latency; ×1.5.
    assert measured["all_gather"] == pytest.approx((0.0, 1.5 * 4e-6))
    assert measured["recv"] == measured["send"] == pytest.approx((0.0015, 0.0))
    four = group_lines((0, 1, 2, 3), 0, topo, measured)
    assert four.real["all_gather"][0].seconds_per_byte == pytest.approx(0.75 * 1.5 * 4e-6)
    target, peers, real = lines.as_native()
    assert target["all_gather"] == [(line.latency, line.seconds_per_byte) for line in lines.target["all_gather"]]
    assert len(peers) == 4 and set(real) == set(links.KINDS)


def _step(compute_ns: list[tuple[int, int]], waits: list[tuple[int, int]], flops: float) -> StepMetrics:
    spans = [Interval("compute", "forward", s, e) for s, e in compute_ns]
    spans += [Interval("wait", "wait allreduce", s, e) for s, e in waits]
    spans += [Interval("comm", "all_reduce", 0, 10**9, bytes=8, group_size=2)]
    return StepMetrics(step=0, loss=1.0, tokens=1, step_time_s=1.0, tokens_per_s=1.0, flops=flops,
                       intervals=tuple(spans))


def test_the_dilation_is_this_ranks_compute_over_the_targets_time_for_the_step():
    # 30 ms of compute spans (one 10 ms wait inside them does not count); the target computes the step in 10 µs.
    step = _step([(0, 20_000_000), (25_000_000, 45_000_000)], [(30_000_000, 40_000_000)], 1e9)
    assert measured_dilation(0.030, 1e-5) == pytest.approx(3000)
    assert measured_dilation(0.0, 1e-5) is None and measured_dilation(0.030, 0.0) is None
    # The lowest of the latest steps, once two are measured: a warm-up or a slow step does not swing it.
    slow = _step([(0, 90_000_000)], [], 1e9)
    assert dilation_from_steps([slow], 1e-5) is None
    assert dilation_from_steps([slow, step], 1e-5) == pytest.approx(3000)
    assert dilation_from_steps([step, slow, slow], 1e-5) == pytest.approx(3000)
    assert dilation_from_steps([slow, slow, slow, step], 1e-5) == pytest.approx(3000)
    assert dilation_from_steps([replace(step, intervals=())] * 3, 1e-5) is None


def test_the_targets_compute_is_the_estimators_for_the_ranks_stage():
    """One model of the target's compute: the dilation divides by what the estimator predicts for the rank's
    pipeline stage on the cluster's GPU (pp is the mesh's outermost axis: ranks 0-1 hold stage 0 of pp=2 × dp=2),
    or by the step's FLOPs at a stated efficiency."""
    cfg = Config(model=ModelConfig(dim=64, n_layers=4, n_heads=2), batch_size=8, seq_len=64, pp=2, dp=2,
                 micro_batches=4, schedule="1f1b")
    cluster = Cluster("a100-ib", nodes=2)
    stages = estimate(cfg, "a100").stages
    assert stages[0].compute_s != stages[1].compute_s  # the embedding and the head differ
    assert [target_compute_s(cfg, cluster, r) for r in range(4)] == [stages[0].compute_s] * 2 + [stages[1].compute_s] * 2
    stated = estimate(cfg, "a100", efficiency=0.5).stages[1]
    assert target_compute_s(cfg, replace(cluster, efficiency=0.5), 3) == pytest.approx(
        stated.flops / (hardware.A100.peak("fp32") * 0.5))


def test_the_status_line_says_plainly_what_is_emulated():
    assert status_line(None) == "links: this machine's own (loopback); no cluster emulated"
    cluster = Cluster("h100-25gbe", nodes=2).for_world(2)
    line = status_line(cluster, 1234.5)
    assert line.startswith("EMULATED cluster h100-25gbe: 2 nodes × 1 h100")
    assert "25 GbE (TCP)" in line
    assert "time dilated ×1.23e+03 (this rank's compute ÷ the estimate of its stage's on the h100)" in line
    assert "(this rank's compute ÷ the h100's at 40% MFU)" in status_line(replace(cluster, efficiency=0.4), 9.0)
    assert "measured from the first steps" in status_line(cluster)
    assert status_line(replace(cluster, dilation=50.0)).endswith("time dilated ×50 (fixed)")


def test_the_dashboard_header_carries_the_links_line():
    from workbench.ui.dashboard import _links_line

    class Bench:
        links = status_line(Cluster("h100-25gbe", nodes=2).for_world(2), 1234.5)

    assert "EMULATED cluster h100-25gbe: 2 nodes" in _links_line(Bench())
    assert _links_line(object()) == ""  # a fake without the property shows nothing


def test_the_prediction_runs_the_pipeline_in_time_with_each_hop_on_the_links():
    """pp=2 1F1B: the prediction's bubble is the schedule run in time with every hop priced by the link model, so
    a slower network between the stages widens it; the ranks record each send and each receive."""
    from workbench.emulation.predict import predicted

    cfg = Config(model=ModelConfig(dim=64, n_layers=2, n_heads=2), batch_size=8, seq_len=64, pp=2,
                 micro_batches=4, schedule="1f1b")
    ib, eth = (Cluster(target, nodes=2).for_world(2).topology for target in ("h100-ib", "h100-25gbe"))
    over_ib, over_eth = predicted(cfg, ib), predicted(cfg, eth)
    assert over_ib.collectives == 2 * 4 + 1  # 4 sends, 4 receives, the step's vote
    assert 1 / 5 < over_ib.bubble < over_eth.bubble  # above the formula (p-1)/(m+p-1): each hop costs
    assert over_ib.exposed_s < over_eth.exposed_s
    assert over_ib.compute_s == over_eth.compute_s


def test_the_prediction_says_what_fsdp_hides_on_gpus_and_not_here():
    """FSDP2 overlaps its gathers and reduce-scatters through CUDA streams; on CPU ranks each one blocks: priced
    without the overlap, ZeRO-3's exposed communication is its whole traffic plus the vote."""
    from workbench.emulation.predict import VOTE_BYTES, predicted

    cfg = Config(model=ModelConfig(dim=64, n_layers=2, n_heads=2), batch_size=8, seq_len=64, dp=2, zero=3)
    topology = Cluster("h100-ib", nodes=2).for_world(2).topology
    gpu, cpu = predicted(cfg, topology), predicted(cfg, topology, fsdp_overlaps=False)
    whole = sum(c.calls * links.collective_time(c.kind, c.bytes / c.calls, (0, 1), topology)
                for c in estimate(cfg, "h100").stages[0].comm)
    assert cpu.exposed_s == pytest.approx(whole + links.collective_time("all_reduce", VOTE_BYTES, (0, 1), topology))
    assert gpu.exposed_s < 0.8 * cpu.exposed_s


def test_a_layout_whose_target_compute_cannot_be_estimated_is_refused_before_the_ranks():
    """The measured dilation divides by the cluster GPU's estimated compute: where the estimator cannot price the
    layout there (Float8 on an A100, which has no fp8 peak), apply refuses it up front, naming the fix."""
    from types import SimpleNamespace

    import workbench as wb

    gpus = SimpleNamespace(world_size=8)
    caps = {"name": "NVIDIA H100", "fp16": True, "bf16": True, "fp8": True, "device": "cuda:0"}
    cfg = Config(dp=8, zero=2, precision="fp8_tensorwise")
    bench = SimpleNamespace(pool=gpus, capabilities=caps, cluster=Cluster("a100-ib").for_world(8))
    with pytest.raises(wb.ConfigError, match=r"cluster: the a100's compute .* cannot be estimated.*dilation="):
        wb.Workbench.check(bench, cfg)
    wb.Workbench.check(SimpleNamespace(pool=gpus, capabilities=caps, cluster=Cluster("h100-ib").for_world(8)), cfg)
    fixed = Cluster("a100-ib", dilation=100.0).for_world(8)
    wb.Workbench.check(SimpleNamespace(pool=gpus, capabilities=caps, cluster=fixed), cfg)
