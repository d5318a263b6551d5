"""One collective summed over a step: its payload, the bytes it puts on a rank's busiest link, and their time.

Times come from the one link model, `workbench.links` (α-β per link tier, NVLink inside a node and the network
between, ranks on nodes in mesh order), on GPU profiles; the CPU profile's ranks share one loopback link whose
measured gloo bus bandwidth prices every byte (no latency term), as the CPU runs measure it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from workbench import links
from workbench.config import Config, MeshLayout
from workbench.estimate.records import Axis, Collective, CollectiveKind, Role
from workbench.hardware import Hardware
from workbench.links import bus_factor

NCCL_CONTENTION = 0.35
"""How much longer the compute an NCCL collective hides takes while it runs, for its time: NCCL's kernels hold
whole SMs (a CTA per channel, never shared with a compute kernel: NVIDIA/nccl issue 689, its maintainer) and draw
on the same HBM, and "NCCL collectives use SMs, which makes matmuls that are overlapped by them 30-40% slower"
(pytorch/pytorch PR 179937, 2026, measured on 8 H100s over NVLink; moving FSDP's gathers and reduce-scatters to
the copy engines gave Llama 3 8B +2.4% tokens/s there). The midpoint, for every GPU profile and link."""


def contention(comm: list[Collective] | tuple[Collective, ...]) -> float:
    """Seconds the compute beside `comm`'s hidden part loses to it (GPU profiles; gloo on the CPU model runs on
    threads of its own, whose cost the CPU runs measure)."""
    return NCCL_CONTENTION * sum(c.time_s - c.exposed_s for c in comm)


@dataclass(frozen=True)
class Network:
    """How long one call of a collective takes on a layout's mesh, on a hardware profile."""

    hw: Hardware
    mesh: MeshLayout
    """The layout's DeviceMesh as the engine builds it (`Config.degrees.mesh_layout()`): its dims outermost first
    (pp, the data-parallel dims, cp, tp) and the flattened names (dp, dp_cp, dp_shard_cp, edp)."""
    topology: links.Topology | None
    """The cluster the ranks fill in mesh order (None: the CPU profile's one loopback link)."""

    def call_time(self, kind: CollectiveKind, over: str, payload: float, group: int, stage: int) -> float:
        """Seconds one call of `kind` with `payload` bytes takes among the `group` ranks of mesh axis `over`
        holding the first rank of pipeline stage `stage`."""
        if self.topology is None:
            return payload * bus_factor("send" if kind == "send_recv" else kind, group) / self.hw.link_bw
        lines = _lines(kind, over, self.mesh, stage, self.topology)
        return min(line.time(payload) for line in lines)


@functools.lru_cache(maxsize=1024)
def _lines(kind: str, over: str, mesh: MeshLayout, stage: int, topology: links.Topology) -> tuple[links.Line, ...]:
    """The link model's lines (latency, seconds per byte) for one group, cached: wb.plan asks for the same few
    groups across thousands of layouts. The group holds the first rank of pipeline stage `stage`."""
    first = stage * (mesh.world_size // mesh.size("pp"))
    group = mesh.group(first, over)
    if kind == "send_recv":
        # A rank sends to its neighbour along the axis (the next pipeline stage; the next rank of the cp ring).
        i = group.index(first)
        peer = group[i + 1] if i + 1 < len(group) else group[i - 1]
        return links.coefficients("send", (first, peer), topology)
    return links.coefficients(kind, tuple(sorted(group)), topology)


def network(cfg: Config, hw: Hardware) -> Network:
    mesh = cfg.degrees.mesh_layout()
    if hw.kind == "cpu" or not hw.cluster:
        return Network(hw, mesh, None)
    per_node = min(hw.gpus_per_node, cfg.world_size)
    topology = links.preset(hw.cluster, nodes=-(-cfg.world_size // per_node), gpus_per_node=per_node)
    return Network(hw, mesh, topology)


def collective(net: Network, stage: int, axis: Axis, kind: CollectiveKind, role: Role, what: str, calls: int,
               payload: float, group: int, hidden_by: float = 0.0, per_call: bool = False,
               over: str | None = None, pipelined: bool = False) -> Collective:
    """`calls` collectives of `payload` bytes each (the whole gathered or reduced data) among `group` ranks.

    over: the mesh axis whose groups run them (`Network.mesh`'s names: "dp_cp", "dp_shard", "dp_replicate", ...),
    when it is not `axis` itself.
    hidden_by: seconds of computation running beside them. per_call: that window is each call's own (a unit's
    compute beside its prefetched gather, or its neighbour's beside its reduce-scatter): then one call is
    always exposed (the first gather, the last reduce-scatter) and each other one hides behind its window.
    pipelined: each call runs beside its own window from its start (async TP's matmul chunks run as the shards
    arrive), so each is exposed only by what it takes beyond its window.
    """
    nbytes = payload * calls
    # send_recv counts this rank's sends; links are full duplex, so what it receives takes nothing from them.
    wire = nbytes * bus_factor("send" if kind == "send_recv" else kind, group)
    if net.topology is None:
        time_s = wire / net.hw.link_bw
        one = time_s / calls if calls else 0.0
    else:
        one = net.call_time(kind, over or axis, payload, group, stage) if calls else 0.0
        time_s = one * calls
    if pipelined:
        exposed = calls * max(0.0, one - hidden_by)
    elif per_call:
        exposed = one + (calls - 1) * max(0.0, one - hidden_by) if calls else 0.0
    else:
        exposed = max(0.0, time_s - hidden_by)
    return Collective(axis=axis, kind=kind, role=role, what=what, calls=calls, bytes=round(nbytes),
                      wire_bytes=round(wire), time_s=time_s, exposed_s=exposed)
