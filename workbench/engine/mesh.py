"""Degrees → DeviceMesh: the one place the engine builds a mesh (the arithmetic is `Degrees.mesh_layout()`).

Which dims the mesh has, in which order and under which names, is pure and
lives with the degrees (workbench/config/degrees.py, testable without
processes). Here is only the side effect: `init_device_mesh` creates a process
group per slice of each dim, and `_flatten` one per merged run of them.

A process builds each shape once and reuses it for as long as it lives:
process groups are not destroyed (tearing one down on some ranks while others
still use it can hang), so a session that explores layouts for hours, or a
test suite that drives one pool through hundreds of them, holds one set of
groups per distinct shape, not per apply.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workbench.config import Config, Degrees, MeshLayout


def mesh_layout(cfg: Config | Degrees) -> MeshLayout:
    """The layout of the mesh `cfg`'s degrees make."""
    return (cfg.degrees if isinstance(cfg, Config) else cfg).mesh_layout()


_BUILT: dict[tuple[MeshLayout, str], DeviceMesh] = {}
_built_in = None
"""The world `_BUILT`'s meshes belong to: a process that ends its world and starts another builds afresh."""


def build_mesh(cfg: Config | Degrees, device_type: str) -> DeviceMesh:
    """The DeviceMesh for `cfg` over the current world: built (one process group per axis slice) the first time
    this process asks for its shape, the same mesh every time after. A collective call: every rank asks alike."""
    global _built_in
    layout = mesh_layout(cfg)
    key = (layout, device_type)
    if _built_in is not dist.group.WORLD:
        _BUILT.clear()
        _built_in = dist.group.WORLD
    if key not in _BUILT:
        _BUILT[key] = _build(layout, device_type)
    return _BUILT[key]


def _build(layout: MeshLayout, device_type: str) -> DeviceMesh:
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.dims)
    for name, dims in layout.flattened:
        mesh[dims]._flatten(name)  # private in torch 2.13, torchtitan's way to name a merged axis
    if layout.flattened:
        # torch 2.13 warns on every mesh["dp"] that slicing a flattened axis from the root "will be deprecated";
        # it works (tests/engine/test_moe.py checks the groups), and the whole engine asks for mesh["dp"].
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    return mesh


def mesh_axis(mesh: DeviceMesh, cfg: Config, axis: str) -> DeviceMesh | None:
    """`mesh[axis]`, or None where `cfg`'s layout has no such axis ("ep" and "edp" without expert parallel)."""
    return mesh[axis] if axis in mesh_layout(cfg).axes else None
