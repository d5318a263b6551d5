"""The one link model against figures computed by hand from its stated constants (NCCL's tuning latencies, line
rates) and nccl-tests' bus factors."""

from __future__ import annotations

import pytest

import workbench as wb
from workbench import expert_links, links
from workbench.links import collective_time, preset

US = 1e-6
MIB = 2**20

NVLINK = 450e9 * 783 / 900
"""NVLink 4's 450 GB/s a direction at the share NCCL moves (links.NVLINK_ACHIEVED)."""

def test_bus_factors_are_nccl_tests():
    assert links.bus_factor("all_reduce", 4) == 1.5
    assert links.bus_factor("all_gather", 4) == links.bus_factor("reduce_scatter", 4) == 0.75
    assert links.bus_factor("all_to_all", 8) == 7 / 8
    assert links.bus_factor("broadcast", 8) == links.bus_factor("send", 2) == 1.0
    with pytest.raises(ValueError, match="no bus bandwidth factor for 'gossip'"):
        links.bus_factor("gossip", 2)


def test_ring_all_reduce_inside_one_h100_node():
    node = preset("h100-ib")  # one node of 8
    nbytes = 2**30
    # 8.4 µs base + 2(n-1) = 14 NVLink steps of 3.4 µs; 2(n-1)/n · S over 450 GB/s at NCCL's achieved share
    # (783 of 900 GB/s measured, links.NVLINK_ACHIEVED).
    assert links.NVLINK4.rate == pytest.approx(450e9 * 783 / 900)
    expected = 8.4 * US + 14 * 3.4 * US + 1.75 * nbytes / NVLINK
    assert collective_time("all_reduce", nbytes, range(8), node, "ring") == pytest.approx(expected, rel=1e-12)
    # The tree's chain sends 2S per GPU: slower than the ring inside a node, so "auto" takes the ring.
    assert links.best_algorithm("all_reduce", nbytes, range(8), node) == "ring"
    assert collective_time("all_reduce", nbytes, range(8), node) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_across_two_nodes_of_one_gpu():
    cluster = preset("h100-ib", nodes=2, gpus_per_node=1)
    # 8.4 µs base + 2 network steps of 9.6 µs; 2·1/2 · 1 MiB over one 50 GB/s port.
    expected = 8.4 * US + 2 * 9.6 * US + MIB / 50e9
    assert collective_time("all_reduce", MIB, (0, 1), cluster) == pytest.approx(expected, rel=1e-12)
    assert links.tier((0, 1), cluster) == "network"


def test_25gbe_nodes_share_one_port_and_prefer_the_tree_for_large_buffers():
    cluster = preset("h100-25gbe", nodes=2, gpus_per_node=4)
    nbytes = 1e8
    ring = 8.4 * US + 12 * 5.7 * US + 2 * 30 * US + 1.75 * nbytes / (25e9 / 8)  # one 25 GbE port per node
    tree = 2 * (3 * 28 * US + 1 * 60 * US) + 1 * nbytes / (25e9 / 8)  # S across 2 nodes, chain 2S over PCIe
    assert collective_time("all_reduce", nbytes, range(8), cluster, "ring") == pytest.approx(ring, rel=1e-12)
    assert collective_time("all_reduce", nbytes, range(8), cluster, "tree") == pytest.approx(tree, rel=1e-12)
    assert collective_time("all_reduce", nbytes, range(8), cluster) == pytest.approx(tree, rel=1e-12)
    # Small buffers: the ring's lower latency wins.
    assert links.best_algorithm("all_reduce", 1024, range(8), cluster) == "ring"


def test_ring_crossing_nodes_uses_one_port_per_rank_on_the_node():
    cluster = preset("a100-ib", nodes=2, gpus_per_node=4)
    # 4 ranks per node, 4 HDR ports: the node boundary carries 4 × 25 GB/s, slower than NVLink 3's 300.
    line = links.coefficients("all_gather", range(8), cluster)[0]
    assert line.seconds_per_byte == pytest.approx((7 / 8) / (4 * 25e9), rel=1e-12)
    assert line.latency == pytest.approx(8.4 * US + 6 * 3.4 * US + 1 * 9.6 * US, rel=1e-12)


def test_tensor_parallel_inside_a_node_vs_across_nodes():
    inside = preset("h100-ib", nodes=1, gpus_per_node=2)
    across = preset("h100-ib", nodes=2, gpus_per_node=1)
    nbytes = 4 * MIB
    t_inside = collective_time("all_reduce", nbytes, (0, 1), inside)
    t_across = collective_time("all_reduce", nbytes, (0, 1), across)
    assert t_inside == pytest.approx(8.4 * US + 2 * 3.4 * US + nbytes / NVLINK, rel=1e-12)
    assert t_across / t_inside == pytest.approx((27.6 * US + nbytes / 50e9) / (15.2 * US + nbytes / NVLINK))


def test_all_to_all_is_bound_by_what_a_node_sends_through_its_ports():
    cluster = preset("h100-ib", nodes=2, gpus_per_node=2)
    nbytes = 1e8
    # Each node's 2 ranks send 2·(4-2)/4 · S to the other node through 2 ports of 50 GB/s; inside, (2-1)/4 · S
    # per GPU over NVLink is far less.
    expected = 8.4 * US + 9.6 * US + nbytes / 100e9
    assert collective_time("all_to_all", nbytes, range(4), cluster) == pytest.approx(expected, rel=1e-12)


def test_point_to_point_takes_the_link_between_the_pair():
    cluster = preset("h100-ib", nodes=2, gpus_per_node=2)
    assert collective_time("send", 1e6, (0, 1), cluster) == pytest.approx(8.4 * US + 3.4 * US + 1e6 / NVLINK)
    assert collective_time("recv", 1e6, (1, 2), cluster) == pytest.approx(8.4 * US + 9.6 * US + 1e6 / 50e9)
    with pytest.raises(ValueError, match="takes the pair"):
        collective_time("send", 1e6, (0, 1, 2), cluster)


def test_large_buffers_reach_the_links_achieved_speed_as_bus_bandwidth():
    node = preset("h100-ib")
    nbytes = 2**36
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        seconds = collective_time(kind, nbytes, range(8), node)
        busbw = links.bus_factor(kind, 8) * nbytes / seconds
        assert busbw == pytest.approx(NVLINK, rel=1e-3), kind


def test_a_group_of_one_costs_nothing_and_lines_are_the_time():
    cluster = preset("h100-ib", nodes=2, gpus_per_node=1)
    assert collective_time("all_reduce", 1e9, (1,), cluster) == 0.0
    for kind in links.KINDS:
        ranks = (0, 1)
        lines = links.coefficients(kind, ranks, cluster)
        assert collective_time(kind, 12345, ranks, cluster) == min(l.latency + 12345 * l.seconds_per_byte for l in lines)


def test_ranks_fill_nodes_in_mesh_order():
    cluster = preset("h100-ib", nodes=2, gpus_per_node=2)
    assert [cluster.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    mesh = wb.Config(dp=2, tp=2).degrees.mesh_layout()  # the ranks' DeviceMesh: tp innermost
    assert mesh.group(3, "tp") == [2, 3] and links.tier((2, 3), cluster) == "intra"
    assert mesh.group(3, "dp") == [1, 3] and links.tier((1, 3), cluster) == "network"
    moe = wb.Config(model=wb.ModelConfig.preset("tiny-moe"), pp=2, dp=4, ep=2, micro_batches=2)
    assert moe.degrees.mesh_layout().group(5, "dp") == [4, 5, 6, 7]  # gradients sync over edp × ep
    assert links.span((0, 1, 2), cluster) == links.Span(size=3, nodes=2, per_node=2)


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="unknown cluster 'h200-magic'; presets: h100-ib"):
        preset("h200-magic")
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        collective_time("gossip", 1, (0, 1), preset("h100-ib"))
    with pytest.raises(ValueError, match="only all_reduce has a tree"):
        links.coefficients("all_gather", (0, 1), preset("h100-ib"), "tree")
    with pytest.raises(ValueError, match="rank 9 is outside"):
        links.span((0, 9), preset("h100-ib"))
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        links.Topology(name="x", gpu="tpu", nodes=1, gpus_per_node=1, intra=links.NVLINK4, network=links.IB_NDR400)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        links.Link("broken", 0, 1e-6, 1e-6)


def test_describe_says_what_the_cluster_is():
    text = preset("h100-25gbe", nodes=2, gpus_per_node=2).describe()
    assert text.startswith("2 nodes × 2 h100, PCIe 4.0 x16 (31.5 GB/s")
    assert "25 GbE (TCP) (3.12 GB/s, 30 µs/step) between" in text


def test_the_two_level_expert_exchange_sends_the_same_bytes_in_fewer_messages():
    cluster = preset("h100-ib", nodes=2, gpus_per_node=4)
    flat = expert_links.expert_exchange_traffic(8e6, range(8), cluster)
    two = expert_links.expert_exchange_traffic(8e6, range(8), cluster, hierarchical=True)
    # 4 ranks a node, each sending half of its 8 MB to the 4 ranks of the other node: 16 MB either way.
    assert flat.network_bytes == two.network_bytes == 16e6
    assert (flat.network_messages, two.network_messages) == (16, 4)
    assert flat.intra_bytes == 4 * 3 * 8e6 / 8 and two.intra_bytes == 4 * 3 * 8e6 / 4
    expected = collective_time("all_to_all", 8e6, (0, 1, 2, 3), cluster) + collective_time(
        "all_to_all", 8e6, (0, 4), cluster)
    assert expert_links.hierarchical_all_to_all_time(8e6, range(8), cluster) == pytest.approx(expected)
