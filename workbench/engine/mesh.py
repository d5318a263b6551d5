"""Degrees → device mesh: the arithmetic is pure, building the mesh is one call.

The mesh has three axes, ordered ("pp", "dp", "tp") from outermost to
innermost. Ranks are laid out row-major, so the tp axis varies fastest and
a tensor-parallel group is always a run of neighbouring ranks: on a GPU node
those share NVLink, and tp is the axis that communicates inside every layer.
pp is outermost because it only sends activations between neighbouring stages
once per micro-batch, the least traffic of the three. Axes of size 1 are kept,
so code can always ask for `mesh["tp"]` whatever the layout.

With expert parallel (ep > 1) the dp axis is split in two, ("edp", "ep"),
ep innermost: an ep group is neighbouring dp ranks, which exchange tokens by
all-to-all in every MoE layer, and an edp group holds the replicas of the same
experts. The pair is flattened back into "dp", so `mesh["dp"]` and the dp rank
are what they are without experts (dp rank = edp rank · ep + ep rank).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workbench.config import Config

AXES: tuple[str, str, str] = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """The shape of the device mesh, one size per axis in `AXES` order."""

    shape: tuple[int, int, int]
    axes: tuple[str, str, str] = AXES

    @property
    def world_size(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    def size(self, axis: str) -> int:
        return self.shape[self.axes.index(axis)]

    def coordinate(self, rank: int) -> dict[str, int]:
        """Where `rank` sits on each axis (row-major, tp fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        coord = {}
        for axis, size in reversed(list(zip(self.axes, self.shape))):
            rank, coord[axis] = divmod(rank, size)
        return {axis: coord[axis] for axis in self.axes}

    def rank_of(self, coordinate: dict[str, int]) -> int:
        rank = 0
        for axis, size in zip(self.axes, self.shape):
            rank = rank * size + coordinate[axis]
        return rank

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate with `rank` except the one on `axis`: its group along `axis`."""
        coord = self.coordinate(rank)
        return [self.rank_of({**coord, axis: i}) for i in range(self.size(axis))]


def mesh_layout(cfg: Config) -> MeshLayout:
    return MeshLayout(shape=(cfg.pp, cfg.dp, cfg.tp))


def build_mesh(cfg: Config, device_type: str) -> DeviceMesh:
    """The DeviceMesh for `cfg` over the current world (creates one process group per axis slice)."""
    layout = mesh_layout(cfg)
    if cfg.ep == 1:
        return init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.axes)
    mesh = init_device_mesh(device_type, (cfg.pp, cfg.dp // cfg.ep, cfg.ep, cfg.tp),
                            mesh_dim_names=("pp", "edp", "ep", "tp"))
    mesh["edp", "ep"]._flatten("dp")  # private in torch 2.13, torchtitan's way to name a merged axis
    # torch 2.13 warns on every mesh["dp"] that slicing a flattened axis from the root "will be deprecated";
    # it works (tests/engine/test_moe.py checks the groups), and the whole engine asks for mesh["dp"].
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    return mesh


def mesh_key(cfg: Config) -> tuple[int, ...]:
    """What identifies a built mesh: its shape, and how dp is split for experts."""
    return (*mesh_layout(cfg).shape, cfg.ep)
