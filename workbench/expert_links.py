"""The expert-parallel exchange on the link model (`workbench.links`): the traffic one node puts on the network
for a flat all-to-all and for the two-level one (engine/parallel/expert_exchange.py), and the two-level one's time.
Pure arithmetic, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.links import Topology, collective_time, span


@dataclass(frozen=True)
class ExchangeTraffic:
    """What one node puts on the network for one all-to-all of `nbytes` per rank, spread evenly."""

    network_bytes: float
    """Bytes the node's ranks send to other nodes: k(n-k)/n of their k·nbytes, flat or two-level alike."""
    network_messages: int
    """Messages they send to other nodes: k(n-k) flat (every remote rank), k(N-1) two-level (one per remote
    node's peer), for n ranks on N nodes of k."""
    intra_bytes: float
    """Bytes the node's ranks send each other: (k-1)/n of theirs flat; two-level adds the first level's
    (k-1)/k of theirs (everything not bound for one's own local index)."""


def expert_exchange_traffic(nbytes: float, ranks: tuple[int, ...] | list[int], topology: Topology,
                            hierarchical: bool = False) -> ExchangeTraffic:
    """The traffic of one expert-parallel all-to-all of `nbytes` per rank (engine/parallel/expert_exchange.py)."""
    s = span(ranks, topology)
    n, k = s.size, s.per_node
    network = k * (n - k) * nbytes / n
    if not hierarchical:
        return ExchangeTraffic(network, k * (n - k), k * (k - 1) * nbytes / n)
    return ExchangeTraffic(network, k * (s.nodes - 1), k * (k - 1) * nbytes / k)


def hierarchical_all_to_all_time(nbytes: float, ranks: tuple[int, ...] | list[int], topology: Topology) -> float:
    """Seconds of the two-level exchange of `nbytes` per rank over the group of `ranks` (node-contiguous, k per
    node): an all-to-all inside each node, then one among the ranks of each local index across the nodes."""
    ranks = tuple(sorted(ranks))
    k = span(ranks, topology).per_node
    first = collective_time("all_to_all", nbytes, ranks[:k], topology)
    second = collective_time("all_to_all", nbytes, ranks[::k], topology)
    return first + second
