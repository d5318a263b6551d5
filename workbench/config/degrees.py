"""Degrees → mesh, as pure arithmetic: how many ranks each parallelism spans, checked, and the mesh they make.

`Degrees` is the value torchtitan calls `ParallelDims`: every degree a run
can have (pp, dp_replicate, dp_shard, cp, tp and ep), validated against the
world size and the model with refusals that name the field and the fix.
`Degrees.mesh_layout()` says which DeviceMesh they make: its dimensions,
outermost first, and the names made by flattening runs of them. Building the
mesh (the side effect: process groups) is one call in engine/mesh.py,
`build_mesh`; everything here runs without processes.

Order of the dimensions, outermost first: pp, the data-parallel ranks, cp, tp.
Ranks are laid out row-major, so tp varies fastest and a tensor-parallel
group is a run of neighbouring ranks (on a GPU node those share NVLink; tp
communicates inside every layer). cp is next: its ring exchange of keys and
values runs in every attention. pp is outermost: it only sends activations
between neighbouring stages once per micro-batch, the least traffic of all.

The data-parallel ranks, dp = dp_replicate · dp_shard (HSDP when both exceed
1: FSDP2 shards over dp_shard and replicates over dp_replicate), are always
named "dp" as a whole. Expert parallel does not multiply the world: ep splits
the innermost ep of the data-parallel ranks, whose tokens it exchanges by
all-to-all; "edp" names the rest, the replicas of the same expert slice.
With context parallel, "dp_cp" names the data-parallel and cp ranks together:
every one of them holds the same dense weights and computes gradients from
different tokens.

The axes "pp", "dp" and "tp" exist in every layout (size 1 kept, so code can
always ask for `mesh["tp"]`); "ep", "edp", "cp", "dp_cp", "dp_replicate" and
"dp_shard" exist where their degree splits something (`MeshLayout.axes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.config.refusals import at_least, check_fields, refuse

if TYPE_CHECKING:
    from workbench.config.model import ModelConfig


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending: the degrees that split n evenly (offered in errors and in the controls)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MeshLayout:
    """The shape of a device mesh: `dims` (outermost first) with their sizes, and names for runs of them."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    flattened: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(name, the consecutive dims it merges): DeviceMesh's `_flatten`, as torchtitan names its "dp_shard_cp"."""

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.shape) or len(set(self.dims)) != len(self.dims):
            raise ValueError(f"a mesh needs one size per distinct dim, got dims {self.dims} and shape {self.shape}")

    @property
    def axes(self) -> tuple[str, ...]:
        """Every name this mesh answers to: its dims, then the flattened names."""
        return self.dims + tuple(name for name, _ in self.flattened)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def dims_of(self, axis: str) -> tuple[str, ...]:
        """The dims `axis` spans: itself, or the run a flattened name merges."""
        if axis in self.dims:
            return (axis,)
        for name, dims in self.flattened:
            if name == axis:
                return dims
        raise KeyError(f"this mesh has no axis {axis!r}; it has {self.axes}")

    def size(self, axis: str) -> int:
        return math.prod(self.shape[self.dims.index(d)] for d in self.dims_of(axis))

    def coordinate(self, rank: int) -> dict[str, int]:
        """Where `rank` sits on every axis (row-major over the dims, the last fastest; a flattened axis counts
        its dims row-major too, as DeviceMesh's local rank does)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        coord: dict[str, int] = {}
        for dim, size in reversed(list(zip(self.dims, self.shape))):
            rank, coord[dim] = divmod(rank, size)
        out = {dim: coord[dim] for dim in self.dims}
        for name, dims in self.flattened:
            local = 0
            for dim in dims:
                local = local * self.shape[self.dims.index(dim)] + coord[dim]
            out[name] = local
        return out

    def rank_of(self, coordinate: dict[str, int]) -> int:
        """The rank at a coordinate given on every dim (the inverse of `coordinate`)."""
        rank = 0
        for dim, size in zip(self.dims, self.shape):
            rank = rank * size + coordinate[dim]
        return rank

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate with `rank` except those on `axis`: its group along `axis`,
        in the order of their local rank on it."""
        coord, spanned = self.coordinate(rank), self.dims_of(axis)
        sizes = [self.shape[self.dims.index(d)] for d in spanned]
        group = []
        for local in range(math.prod(sizes)):
            point = dict(coord)
            for dim, size in reversed(list(zip(spanned, sizes))):
                local, point[dim] = divmod(local, size)
            group.append(self.rank_of(point))
        return group


_RANGES = {name: at_least(1) for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """How many ranks each parallelism spans; the world is pp · dp_replicate · dp_shard · cp · tp."""

    pp: int = 1
    """Pipeline stages (ranks along "pp")."""
    dp_replicate: int = 1
    """Data-parallel ranks that hold whole replicas of the parameters (DDP; HSDP's replicate axis)."""
    dp_shard: int = 1
    """Data-parallel ranks FSDP2 shards parameters, gradients and optimizer state over."""
    cp: int = 1
    """Context parallel: ranks that split each sequence (and exchange keys and values in attention)."""
    tp: int = 1
    """Tensor parallel: ranks that split every weight matrix."""
    ep: int = 1
    """Expert parallel: splits the innermost ep of the dp ranks (not a factor of the world)."""

    def __post_init__(self) -> None:
        check_fields(self, _RANGES)
        if self.dp % self.ep:
            raise refuse("ep", f"experts are split across data-parallel ranks, and ep={self.ep} does not divide "
                         f"dp={self.dp}", f"set dp to a multiple of {self.ep} (the world stays {self._product_name}), "
                         f"or ep among {divisors(self.dp)}")
        if self.hsdp and self.dp_shard % self.ep:
            # Expert slices are exchanged within a shard group; a replica group holds the same slices.
            raise refuse("ep", f"under HSDP ep={self.ep} must divide dp_shard={self.dp_shard}",
                         f"choose ep among {divisors(self.dp_shard)}")

    # -- derived sizes ----------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel ranks: dp_replicate · dp_shard (each sees its own slice of the batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Replicas of one expert slice: dp / ep (expert gradients are synchronised over these)."""
        return self.dp // self.ep

    @property
    def hsdp(self) -> bool:
        """Replicated and sharded at once: FSDP2 on a 2-D (dp_replicate, dp_shard) mesh."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def _product_name(self) -> str:
        return "dp·cp·tp·pp" if self.cp > 1 else "dp·tp·pp"

    # -- checks against the world and the model ---------------------------------------------------------
    def check_world(self, world_size: int) -> None:
        """Refuse degrees that do not fill a pool of `world_size` ranks."""
        if self.world_size != world_size:
            values = (self.dp, self.cp, self.tp, self.pp) if self.cp > 1 else (self.dp, self.tp, self.pp)
            raise refuse(self._product_name, f"{self._product_name} = {'·'.join(map(str, values))} = "
                         f"{self.world_size}, but the pool has {world_size} ranks",
                         f"choose degrees whose product is {world_size} "
                         "(changing the number of ranks needs a new Workbench(world_size=...))")

    def check_model(self, model: ModelConfig, stages_per_rank: int = 1, uneven: bool = False) -> None:
        """Refuse degrees that do not split `model` evenly; `stages_per_rank` is the pipeline chunks per rank;
        `uneven`: the stages' sizes are given (Config.stage_layers, checked by its own rule), not an even split.
        A shape a model source does not know before it is built (None: a user's factory) is checked on the built
        model instead (`workbench.models.check`)."""
        tp = self.tp
        if model.n_heads is not None and model.n_heads % tp:
            raise refuse("tp", f"tp={tp} does not divide model.n_heads={model.n_heads}",
                         f"choose tp among {divisors(model.n_heads)}")
        if model.kv_heads is not None and model.kv_heads % tp:
            raise refuse("tp", f"tp={tp} does not divide the key/value heads ({model.kv_heads})",
                         f"choose tp among {divisors(model.kv_heads)}")
        if model.hidden_dim is not None and model.hidden_dim % tp:
            raise refuse("tp", f"tp={tp} does not divide the MLP width ({model.hidden_dim})",
                         "choose a tp dividing model.hidden_dim")
        chunks = self.pp * stages_per_rank
        if model.n_layers is not None and model.n_layers % chunks and not uneven:
            what = f"pp={self.pp}" if chunks == self.pp else f"pp·stages_per_rank={chunks}"
            raise refuse("pp", f"{what} does not divide model.n_layers={model.n_layers}",
                         f"choose pp (times stages_per_rank for interleaved) among {divisors(model.n_layers)}")
        if self.ep > 1 and model.n_experts == 0:
            raise refuse("ep", f"ep={self.ep} splits experts, but the model is dense (model.n_experts=0)",
                         'set ep=1, or use a mixture-of-experts model (e.g. ModelConfig.preset("tiny-moe"))')
        if model.n_experts and model.n_experts % self.ep:
            raise refuse("ep", f"ep={self.ep} does not divide model.n_experts={model.n_experts}",
                         f"choose ep among {[d for d in divisors(model.n_experts) if self.dp % d == 0]}")

    def check_sequence(self, seq_len: int) -> None:
        """Refuse a sequence length the sequence-splitting axes cannot cut evenly."""
        if self.tp > 1 and seq_len % self.tp:
            raise refuse("seq_len", f"sequence parallel splits seq_len={seq_len} across tp={self.tp}",
                         f"make seq_len a multiple of {self.tp}")
        if self.cp > 1 and seq_len % (2 * self.cp * self.tp):
            # Causal load balancing cuts the sequence in 2·cp chunks, rank r taking chunks r and 2·cp-1-r, and
            # sequence parallel then splits each rank's share across tp.
            raise refuse("seq_len", f"context parallel cuts seq_len={seq_len} into 2·cp={2 * self.cp} balanced "
                         f"chunks (each split across tp={self.tp})",
                         f"make seq_len a multiple of {2 * self.cp * self.tp}")

    # -- the mesh ---------------------------------------------------------------------------------------
    def mesh_layout(self) -> MeshLayout:
        """The DeviceMesh these degrees make (see the module docstring for the order and the names)."""
        dims: list[tuple[str, int]] = [("pp", self.pp)]
        flattened: list[tuple[str, tuple[str, ...]]] = []
        if self.ep > 1 and self.hsdp:
            inner = self.dp_shard // self.ep
            dims += [("dp_replicate", self.dp_replicate), ("dp_shard_mod_ep", inner), ("ep", self.ep)]
            flattened += [("dp", ("dp_replicate", "dp_shard_mod_ep", "ep")), ("dp_shard", ("dp_shard_mod_ep", "ep")),
                          ("edp", ("dp_replicate", "dp_shard_mod_ep"))]
        elif self.ep > 1:
            dims += [("edp", self.edp), ("ep", self.ep)]
            flattened += [("dp", ("edp", "ep"))]
        elif self.hsdp:
            dims += [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)]
            flattened += [("dp", ("dp_replicate", "dp_shard"))]
        else:
            dims += [("dp", self.dp)]
        data = tuple(name for name, _ in dims[1:])
        if self.cp > 1:
            dims += [("cp", self.cp)]
            flattened += [("dp_cp", (*data, "cp"))]
            if self.hsdp:
                flattened += [("dp_shard_cp", (*data[1:], "cp"))]
        dims += [("tp", self.tp)]
        return MeshLayout(dims=tuple(n for n, _ in dims), shape=tuple(s for _, s in dims), flattened=tuple(flattened))

