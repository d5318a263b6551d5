"""The hierarchical (two-level) exchange of expert-parallel tokens: inside each node first, then between nodes.

Flat, every ep rank sends each other ep rank its rows in one all-to-all: across nodes, a node's k ranks send
k·(n-k) messages. Two-level (Switch/GShard style), rank (a, i) of node a first sends its node-mate (a, j)
everything bound for the j-th rank of every node; then (a, j) sends (b, j) everything its node holds for it, one
message per remote node: k·(N-1) messages a node, k times fewer and k times larger. The same rows cross the
network either way (k·(n-k)/n of a node's rows), and they arrive in the flat exchange's order (by source rank,
then by local expert), so the experts compute the same thing and the losses are bit-identical to flat.
(`workbench.expert_links.expert_exchange_traffic` is the arithmetic, for the estimator.)

Ranks sit on nodes as the pool places them (`workbench.pool.rank.node_of`: an emulated cluster's placement when one
is emulated, else `LOCAL_WORLD_SIZE` to a node, as torchrun sets it), else all on one node, where the exchange is
the flat one with an extra copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from workbench.pool import rank


def node_of_rank() -> "callable":
    """Global rank -> node, as the ranks are placed (`workbench.pool.rank.node_of`)."""
    return rank.node_of


@dataclass(frozen=True)
class TwoLevel:
    """One rank's place in its ep group's two levels: node a of N, local index i of k, and the groups."""

    node: int
    local: int
    nodes: int
    per_node: int
    intra: object
    """The process group of this rank's node (its k ep ranks)."""
    inter: object
    """The process group of the ep ranks with this local index, one per node (N ranks)."""

    def plan(self, rows: list[list[int]]) -> "Plan":
        """The exchange of one forward: `rows[s][r]` rows go from ep rank s to ep rank r (ep rank = node·k + local)."""
        return Plan(self, rows)


_cache: dict[tuple, TwoLevel] = {}


def two_level_exchange(mesh: DeviceMesh, axis: str = "ep") -> TwoLevel:
    """This rank's `TwoLevel` for the `axis` groups of `mesh`. Every rank calls it together: each node's and
    each local index's process group is created once per layout, by every rank in the same order."""
    names = mesh.mesh_dim_names
    groups = mesh.mesh.movedim(names.index(axis), -1).reshape(-1, mesh.mesh.shape[names.index(axis)]).tolist()
    node_of = node_of_rank()
    key = (tuple(map(tuple, groups)), tuple(node_of(r) for g in groups for r in g))
    if key in _cache:
        return _cache[key]
    me = dist.get_rank()
    mine = None
    for group in groups:
        nodes = [node_of(r) for r in group]
        per_node = nodes.count(nodes[0])
        if any(nodes[i] != nodes[(i // per_node) * per_node] for i in range(len(group))) or len(group) % per_node:
            raise ValueError(f"expert_exchange='hierarchical': the ep group {group} is not made of whole nodes of "
                             f"equal size (nodes {nodes}). Fix: an ep degree that is a multiple of the GPUs per node, "
                             "or expert_exchange='flat'")
        n_nodes = len(group) // per_node
        intra = [dist.new_group(group[a * per_node:(a + 1) * per_node]) for a in range(n_nodes)]
        inter = [dist.new_group(group[i::per_node]) for i in range(per_node)]
        if me in group:
            at = group.index(me)
            mine = TwoLevel(at // per_node, at % per_node, n_nodes, per_node, intra[at // per_node],
                            inter[at % per_node])
    _cache[key] = mine
    return mine


def _blocks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """The row blocks of `x` (of `sizes`, in order) rearranged into `order`."""
    if order == sorted(order):
        return x
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    index = torch.cat([torch.arange(starts[b], starts[b + 1], device=x.device) for b in order]) if order else \
        torch.zeros(0, dtype=torch.long, device=x.device)
    return x.index_select(0, index)


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class Plan:
    """Both levels of one exchange, forward (`out`) and inverse (`back`), from the row counts of every pair."""

    def __init__(self, level: TwoLevel, rows: list[list[int]]) -> None:
        k, n, a, i = level.per_node, level.nodes, level.node, level.local
        me = a * k + i
        self.level = level
        # Level 1, inside node a: to node-mate j, my rows for (b, j) for every node b. My rows are by destination
        # r = b·k + j; blocks (j, b) in that order go out.
        self.mine = [rows[me][r] for r in range(n * k)]
        self.order1 = [b * k + j for j in range(k) for b in range(n)]
        self.send1 = [sum(rows[me][b * k + j] for b in range(n)) for j in range(k)]
        self.recv1 = [sum(rows[a * k + src][b * k + i] for b in range(n)) for src in range(k)]
        # What arrived: blocks (src, b) for src of node a, b every node; level 2 sends node b its blocks, (b, src).
        self.held = [rows[a * k + src][b * k + i] for src in range(k) for b in range(n)]
        self.order2 = [src * n + b for b in range(n) for src in range(k)]
        self.send2 = [sum(rows[a * k + src][b * k + i] for src in range(k)) for b in range(n)]
        self.recv2 = [sum(rows[c * k + src][me] for src in range(k)) for c in range(n)]
        self.network_rows = sum(self.send2[b] for b in range(n) if b != a)
        """Rows this rank sends to other nodes (level 2's); over a node they add up to the flat exchange's."""

    def out(self, x: torch.Tensor) -> torch.Tensor:
        """My rows (by destination rank) → the rows for me, by source rank then expert: the flat exchange's."""
        level = self.level
        held = _all_to_all(_blocks(x, self.mine, self.order1), self.send1, self.recv1, level.intra)
        return _all_to_all(_blocks(held, self.held, self.order2), self.send2, self.recv2, level.inter)

    def back(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse: rows for me (by source rank) → back where they came from, by destination rank."""
        level = self.level
        held = _all_to_all(y, self.recv2, self.send2, level.inter)
        held = _blocks(held, [self.held[j] for j in self.order2], _inverse(self.order2))
        mine = _all_to_all(held, self.recv1, self.send1, level.intra)
        return _blocks(mine, [self.mine[j] for j in self.order1], _inverse(self.order1))


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for position, block in enumerate(order):
        inv[block] = position
    return inv
