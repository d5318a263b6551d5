"""The one link model: what a collective costs on a cluster, from its links (latency α, bandwidth β) and topology.

Pure arithmetic, no torch: the estimator (`wb.estimate`) prices every collective with it, and the emulation
(`workbench.emulation`) makes real collectives on this machine take that long. One model, so a prediction and
an emulated run can only disagree where execution differs, never where the arithmetic does.

A cluster is `Topology`: nodes of `gpus_per_node` GPUs joined inside a node by one `Link` (NVLink, PCIe) and
between nodes by another (InfiniBand, Ethernet) through `nics_per_node` network ports. Ranks sit on nodes in
mesh order: rank r on node r // gpus_per_node, so the innermost mesh axis (tp) stays inside a node first.

Every collective's time is a small set of `Line`s, latency + bytes × seconds_per_byte, one per algorithm that
can run it; the time is the lowest (NCCL's tuner picks the fastest algorithm the same way,
src/graph/tuning.cc: ncclTopoGetAlgoTime). `coefficients(kind, ranks, topology)` hands the lines to native
code, which then evaluates only `min(latency + bytes * seconds_per_byte)` per collective.

Sizes `nbytes` are as nccl-tests counts them and as the telemetry records them (`Interval.bytes`): the whole
buffer, i.e. all_gather's output, reduce_scatter's and all_to_all's input, the one tensor otherwise.

What it leaves out (said again where it matters): contention between concurrent groups on the same links
(two dp groups crossing one NIC each get the whole NIC), congestion and adaptive routing, NCCL's LL/LL128
protocols (small messages are priced with the Simple protocol's latencies, which NCCL beats below ~64 KiB),
NVLink SHARP and in-network reduction.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Literal

from workbench import hardware

GB = 1e9
US = 1e-6

Kind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather",
               "scatter", "send", "recv", "barrier"]
Algorithm = Literal["auto", "ring", "tree"]
KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
                          "gather", "scatter", "send", "recv", "barrier")


# --- bus bandwidth, as nccl-tests defines it --------------------------------------------------------------

# nccl-tests doc/PERFORMANCE.md ("Bus bandwidth") and the *GetBw functions of src/*.cu: busbw = algbw × factor,
# the share of the payload each rank's link carries, so busbw compares with a link's speed whatever n is.
#   all_reduce 2(n-1)/n (all_reduce.cu); all_gather, reduce_scatter (n-1)/n (all_gather.cu, reduce_scatter.cu);
#   alltoall (n-1)/n (alltoall.cu); broadcast, reduce, sendrecv 1 (broadcast.cu, reduce.cu, sendrecv.cu);
#   gather, scatter (n-1)/n (gather.cu, scatter.cu).
_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


def bus_factor(kind: str, n: int) -> float:
    """busbw / algbw of `kind` among `n` ranks (nccl-tests): the fraction of the payload on each rank's link. A
    coalesced batch ("send+recv") takes its parts' factor when they agree."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    factors = set()
    for part in kind.split("+"):
        if part not in _BUS_FACTORS:
            raise ValueError(f"no bus bandwidth factor for {part!r}; known: {sorted(_BUS_FACTORS)}")
        factors.add(_BUS_FACTORS[part](n))
    if len(factors) != 1:
        raise ValueError(f"the parts of {kind!r} have different bus factors")
    return factors.pop()


# --- links and topologies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One tier of links: its bandwidth and its latencies per algorithm step."""

    name: str
    bandwidth: float
    """Bytes/s in one direction: per GPU for a link inside a node (all of a GPU's NVLinks together), per
    network port (NIC) for the network. Ring collectives are bound by one direction."""
    latency: float
    """Seconds per step of a ring (one hop's latency, NCCL's Simple protocol)."""
    tree_latency: float
    """Seconds per level of a tree (NCCL's Simple protocol, which prices a 256 KiB chunk per level)."""
    efficiency: float = 1.0
    """Share of `bandwidth` NCCL's transfers reach on this link (measured: NVLINK_ACHIEVED); 1: the line rate."""

    @property
    def rate(self) -> float:
        """Bytes/s a transfer moves on this link: the line rate at its achieved share."""
        return self.bandwidth * self.efficiency

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"Link {self.name!r}: bandwidth must be positive bytes/s, got {self.bandwidth}")
        if self.latency < 0 or self.tree_latency < 0:
            raise ValueError(f"Link {self.name!r}: latencies must be >= 0 s")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Link {self.name!r}: efficiency is a share of the line rate in (0, 1]")

    def __str__(self) -> str:
        return f"{self.name} ({hardware.si(self.bandwidth, 'B/s')}, {self.latency / US:.3g} µs/step)"


# Latencies are NCCL's own tuning model (NVIDIA/nccl src/graph/tuning.cc, hwLat[NVLINK|PCI|NET], Simple protocol;
# ring: 3.4 / 5.7 / 9.6 µs per step, tree: 28 / 28 / 50 µs per level) and its base latency per collective
# (baseLat: ring Simple 8.4 µs, tree Simple 0). Bandwidths are line rates, one direction.
NVLINK_ACHIEVED = 783 / 900
"""Share of NVLink's line rate NCCL moves: 783 of 900 GB/s bidirectional between two GPUs of an HGX H100 SXM
(NVIDIA/nccl issue 1264, "Only ~783GByte/s out of theoretical 900GB/s", NCCL's own p2p test; the maintainers: the
protocol's headers and flow control take the rest). Taken for NVLink 3 and 5 as well: no measurement of their own
here."""
NVLINK4 = Link("NVLink 4", hardware.H100.link_bw, 3.4 * US, 28 * US,  # 18 links, 900 GB/s both ways (H100 datasheet)
               NVLINK_ACHIEVED)
NVLINK3 = Link("NVLink 3", hardware.A100.link_bw, 3.4 * US, 28 * US,  # 12 links, 600 GB/s both ways (A100 datasheet)
               NVLINK_ACHIEVED)
NVLINK5 = Link("NVLink 5", hardware.B200.link_bw, 3.4 * US, 28 * US,  # 18 links, 1.8 TB/s both ways (Blackwell)
               NVLINK_ACHIEVED)
# PCI-SIG PCIe 4.0 x16: 16 GT/s × 16 lanes × 128/130 encoding = 31.5 GB/s each way.
PCIE4 = Link("PCIe 4.0 x16", 16e9 * 16 * 128 / 130 / 8, 5.7 * US, 28 * US)
# InfiniBand NDR 400 Gb/s (ConnectX-7; DGX H100 has one per GPU) and HDR 200 Gb/s (ConnectX-6; DGX A100, one per GPU).
IB_NDR400 = Link("InfiniBand NDR 400 Gb/s", 400e9 / 8, 9.6 * US, 50 * US)
IB_HDR200 = Link("InfiniBand HDR 200 Gb/s", 200e9 / 8, 9.6 * US, 50 * US)
# InfiniBand XDR 800 Gb/s (ConnectX-8 SuperNIC, one per GPU on GB300 NVL72).
IB_XDR800 = Link("InfiniBand XDR 800 Gb/s", 800e9 / 8, 9.6 * US, 50 * US)
# 25 Gigabit Ethernet over kernel TCP (NCCL's socket transport). NCCL has no socket figure; a one-way small
# message through the kernel TCP stack is ~half a netperf TCP_RR round trip, tens of µs: 30 µs per step is an
# order of magnitude, not a measurement.
ETH_25G = Link("25 GbE (TCP)", 25e9 / 8, 30 * US, 60 * US)

RING_BASE_LATENCY = 8.4 * US
"""NCCL's base latency of a ring collective, Simple protocol (tuning.cc baseLat)."""
TREE_BASE_LATENCY = 0.0
"""NCCL's base latency of a tree all-reduce, Simple protocol (tuning.cc baseLat: 0; its hwLat carries it)."""


@dataclass(frozen=True)
class Topology:
    """A cluster: `nodes` × `gpus_per_node` GPUs of hardware profile `gpu`, `intra` inside a node, `network`
    between nodes through `nics_per_node` ports (None: one per GPU, as DGX nodes have)."""

    name: str
    gpu: str
    """The hardware profile of each GPU (`workbench.hardware.profile`): what the emulation's dilation and the
    estimator's compute time are measured against."""
    nodes: int
    gpus_per_node: int
    intra: Link
    network: Link
    nics_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Topology {self.name!r}: nodes and gpus_per_node must be >= 1, "
                             f"got {self.nodes} and {self.gpus_per_node}")
        if self.nics_per_node is not None and self.nics_per_node < 1:
            raise ValueError(f"Topology {self.name!r}: nics_per_node must be >= 1 (or None: one per GPU)")
        hardware.profile(self.gpu) if self.gpu != "cpu" else None  # an unknown GPU fails here, naming the known

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nics(self) -> int:
        """Network ports per node."""
        return self.gpus_per_node if self.nics_per_node is None else self.nics_per_node

    def node_of(self, rank: int) -> int:
        """The node rank `rank` sits on: ranks fill nodes in mesh order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside {self.name} ({self.world_size} GPUs)")
        return rank // self.gpus_per_node

    def with_nodes(self, nodes: int, gpus_per_node: int | None = None) -> "Topology":
        """The same hardware in another shape (the NICs follow the GPUs when there is one per GPU)."""
        return replace(self, nodes=nodes, gpus_per_node=gpus_per_node or self.gpus_per_node)

    def describe(self) -> str:
        """One line a person reads: "2 nodes × 1 h100, NVLink 4 (450 GB/s) inside, InfiniBand ... between"."""
        inside = f"{self.intra} inside" if self.gpus_per_node > 1 else f"{self.intra.name} inside (unused)"
        nics = f"{self.nics} × " if self.nics > 1 else ""
        between = f", {nics}{self.network} between" if self.nodes > 1 else ""
        return f"{self.nodes} node{'s' * (self.nodes > 1)} × {self.gpus_per_node} {self.gpu}, {inside}{between}"

    def __str__(self) -> str:
        return f"{self.name}: {self.describe()}"


_PRESETS: dict[str, tuple[str, Link, Link, int, int | None, str]] = {
    # name: (gpu, intra, network, gpus_per_node, nics_per_node, what)
    "h100-ib": ("h100", NVLINK4, IB_NDR400, 8, None, "DGX H100: NVLink 4 inside, one 400 Gb/s InfiniBand port per GPU"),
    "a100-ib": ("a100", NVLINK3, IB_HDR200, 8, None, "DGX A100: NVLink 3 inside, one 200 Gb/s InfiniBand port per GPU"),
    "h100-25gbe": ("h100", PCIE4, ETH_25G, 8, 1, "8 PCIe H100s per node, one 25 GbE port per node"),
    "b200-ib": ("b200", NVLINK5, IB_NDR400, 8, None, "DGX B200: NVLink 5 inside, one 400 Gb/s ConnectX-7 per GPU"),
    # NVL72: the 72 GPUs of a rack are one NVLink domain (the "node" here); racks meet over one NIC per GPU.
    "gb200-nvl72": ("gb200", NVLINK5, IB_NDR400, 72, None,
                    "GB200 NVL72: 72 GPUs on NVLink 5, one 400 Gb/s ConnectX-7 per GPU between racks"),
    "gb300-nvl72": ("gb300", NVLINK5, IB_XDR800, 72, None,
                    "GB300 NVL72: 72 GPUs on NVLink 5, one 800 Gb/s ConnectX-8 per GPU between racks"),
}


def presets() -> dict[str, str]:
    """The named clusters and what each stands for."""
    return {name: spec[-1] for name, spec in _PRESETS.items()}


def preset(name: str, *, nodes: int = 1, gpus_per_node: int | None = None) -> Topology:
    """A named cluster ("h100-ib", "a100-ib", "h100-25gbe", "b200-ib", "gb200-nvl72", "gb300-nvl72") with `nodes`
    nodes (NVLink domains) of `gpus_per_node` GPUs (default: the preset's 8, or 72); an unknown name is refused
    with the list."""
    try:
        gpu, intra, network, per_node, nics, _ = _PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(_PRESETS)} (or build a Topology)") from None
    return Topology(name=name, gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node or per_node, intra=intra,
                    network=network, nics_per_node=nics)


# --- which links a group spans ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """Where a process group's ranks sit: the figures every collective's time depends on."""

    size: int
    nodes: int
    """Distinct nodes the group touches."""
    per_node: int
    """The most group ranks on one node."""

    @property
    def tier(self) -> Literal["self", "intra", "network"]:
        """The slowest tier the group crosses."""
        return "self" if self.size == 1 else "intra" if self.nodes == 1 else "network"


def span(ranks: tuple[int, ...] | list[int], topology: Topology) -> Span:
    """The span of the group of global `ranks` on `topology`."""
    ranks = tuple(ranks)
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"a group needs distinct ranks, got {ranks}")
    counts = Counter(topology.node_of(r) for r in ranks)
    return Span(size=len(ranks), nodes=len(counts), per_node=max(counts.values()))


def tier(ranks: tuple[int, ...] | list[int], topology: Topology) -> str:
    """"self", "intra" (inside one node) or "network": the slowest tier the group of `ranks` crosses."""
    return span(ranks, topology).tier


def _ring_bandwidth(s: Span, topology: Topology) -> float:
    """Bytes/s each rank of a ring moves. Crossing nodes, NCCL runs one ring channel per network port the group
    can use (its ranks on a node, at most the node's ports), so the node boundary carries k × the port speed;
    the ring is bound by the slower of that and the link inside the node."""
    if s.nodes == 1:
        return topology.intra.rate
    ports = min(s.per_node, topology.nics)
    return min(topology.intra.rate, ports * topology.network.rate)


# --- the lines of each collective -------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One algorithm's time: latency + bytes × seconds_per_byte."""

    algorithm: str
    latency: float
    seconds_per_byte: float

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes * self.seconds_per_byte


def _ring_latency(kind: str, s: Span, topology: Topology) -> float:
    # NCCL tuning.cc: a ring all-reduce takes 2(n-1) steps, all-gather/reduce-scatter n-1, of which 2(nodes-1)
    # and nodes-1 cross the network; the other steps run at the intra-node latency. Broadcast and reduce
    # pipeline along the chain; gather/scatter are n-1 point-to-point transfers, as the ring steps.
    n, nodes = s.size, s.nodes
    steps, inter = {"all_reduce": (2 * (n - 1), 2 * (nodes - 1)),
                    "barrier": (2 * (n - 1), 2 * (nodes - 1))}.get(kind, (n - 1, nodes - 1))
    return RING_BASE_LATENCY + (steps - inter) * topology.intra.latency + inter * topology.network.latency


def _tree_all_reduce(s: Span, topology: Topology) -> Line:
    # NCCL's tree: a chain through the GPUs of each node, and a double binary tree between nodes. Latency
    # (tuning.cc): 2 × ((ranks per node - 1) intra steps + log2(nodes) network levels). Bandwidth: along the
    # chain each GPU sends the whole buffer up (reduce) and again down (broadcast), 2S through its links; across
    # nodes each node sends S/2 up one tree and S/2 down the other on 2 nodes (S in all), twice that on more
    # (it is an inner node of one tree), spread over the ports its ranks use.
    levels = math.ceil(math.log2(s.nodes)) if s.nodes > 1 else 0
    latency = TREE_BASE_LATENCY + 2 * ((s.per_node - 1) * topology.intra.tree_latency
                                       + levels * topology.network.tree_latency)
    chain = 2 / topology.intra.rate if s.per_node > 1 else 0.0
    if s.nodes == 1:
        return Line("tree", latency, chain)
    ports = min(s.per_node, topology.nics)
    across = (1 if s.nodes == 2 else 2) / (ports * topology.network.rate)
    return Line("tree", latency, max(chain, across))


def _all_to_all(s: Span, topology: Topology) -> Line:
    # Each rank sends S/n to every peer at once (NCCL: grouped send/recv). Inside a node a GPU sends (k-1)S/n
    # through its own links; across nodes the node's k ranks send k(n-k)S/n through its ports together. The
    # slower of the two sets the time; one round of latency on the slowest tier.
    n, k = s.size, s.per_node
    intra = (k - 1) / n / topology.intra.rate
    if s.nodes == 1:
        return Line("direct", RING_BASE_LATENCY + topology.intra.latency, intra)
    ports = min(k, topology.nics)
    across = k * (n - k) / n / (ports * topology.network.rate)
    return Line("direct", RING_BASE_LATENCY + topology.network.latency, max(intra, across))


def point_to_point(src: int, dst: int, topology: Topology) -> Line:
    """A send from global rank `src` to `dst`: one flow on one link (one network port if they are on two nodes)."""
    link = topology.intra if topology.node_of(src) == topology.node_of(dst) else topology.network
    if src == dst:
        return Line("p2p", 0.0, 0.0)
    return Line("p2p", RING_BASE_LATENCY + link.latency, 1 / link.rate)


def coefficients(kind: str, ranks: tuple[int, ...] | list[int], topology: Topology,
                 algorithm: Algorithm = "auto") -> tuple[Line, ...]:
    """The lines whose minimum is the time of `kind` on the group of global `ranks`: one per algorithm.

    algorithm: "ring" or "tree" (all-reduce only) to price one; "auto" offers every one (NCCL picks the fastest).
    send/recv take the pair (sender, receiver) as `ranks`.
    """
    if kind not in _BUS_FACTORS:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")
    if algorithm not in ("auto", "ring", "tree"):
        raise ValueError(f"algorithm must be 'auto', 'ring' or 'tree', got {algorithm!r}")
    if algorithm == "tree" and kind != "all_reduce":
        raise ValueError(f"only all_reduce has a tree algorithm here, not {kind}")
    ranks = tuple(ranks)
    s = span(ranks, topology)
    if s.size == 1:
        return (Line("local", 0.0, 0.0),)  # nothing leaves the GPU
    if kind in ("send", "recv"):
        if s.size != 2:
            raise ValueError(f"{kind} takes the pair (sender, receiver), got {ranks}")
        return (point_to_point(ranks[0], ranks[1], topology),)
    if kind == "all_to_all":
        return (_all_to_all(s, topology),)
    ring = Line("ring", _ring_latency(kind, s, topology), bus_factor(kind, s.size) / _ring_bandwidth(s, topology))
    if kind != "all_reduce" or algorithm == "ring":
        return (ring,)
    tree = _tree_all_reduce(s, topology)
    return (tree,) if algorithm == "tree" else (ring, tree)


def collective_time(kind: str, nbytes: float, ranks: tuple[int, ...] | list[int], topology: Topology,
                    algorithm: Algorithm = "auto") -> float:
    """Seconds `kind` of `nbytes` (sized as nccl-tests counts them) takes on the group of global `ranks`."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return min(line.time(nbytes) for line in coefficients(kind, ranks, topology, algorithm))


def best_algorithm(kind: str, nbytes: float, ranks: tuple[int, ...] | list[int], topology: Topology) -> str:
    """The algorithm `collective_time` priced `kind` with ("ring", "tree", "direct", "p2p", "local")."""
    return min(coefficients(kind, ranks, topology), key=lambda line: line.time(nbytes)).algorithm
