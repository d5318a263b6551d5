"""Expert-parallel slices in a checkpoint: each saved as what it is, a shard of the whole experts tensor.

At ep > 1 a rank holds experts [r·E/ep, (r+1)·E/ep) of every MoE layer under
the bare model's names (engine/parallel/expert.py), as a plain tensor (zero 0)
or as an FSDP2 DTensor sharded over the "edp" axis (zero 2/3); AdamW's moments
are held alike. Saved as they are, torch.distributed.checkpoint would take
the ep ranks' different slices for copies of one tensor and keep one of them.

So in the state dict each slice becomes a DTensor on the "ep" axis, Shard(0):
global shape (E, ...), each ep rank's chunk at its own offset. DCP then writes
every chunk once (replicas over edp hold identical chunks and are deduplicated)
and records the global shape, so the checkpoint looks exactly like one saved
at ep=1, where the experts are whole tensors. On load, each rank asks for the
chunk it holds now: a checkpoint from any ep loads at any other ep.

Under FSDP2 the slice is first gathered over edp (one layer's slice of experts
per tensor, briefly) and, after a load, handed back as the edp shard the rank
holds, with FSDP2's own placements.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from workbench.engine.parallel.expert import expert_shards, is_expert_slice
from workbench.engine.reshard import bare_name


def expert_names(module: nn.Module) -> set[str]:
    """Bare names of `module`'s expert-parallel parameters (empty at ep=1)."""
    return set(expert_shards(module, bare_name))


def as_global(flat: dict[str, Any], experts: set[str], ep_mesh: DeviceMesh) -> dict[str, Any]:
    """`flat` with each expert slice presented as a Shard(0) DTensor on the ep axis of global shape (E, ...)
    (collective over edp under FSDP2: every rank holds the same keys in the same order)."""
    if not experts:
        return flat
    return {k: _on_ep(_whole_slice(v), ep_mesh) if is_expert_slice(k, v, experts) else v for k, v in flat.items()}


def global_target(held: torch.Tensor, ep_mesh: DeviceMesh, dtype: torch.dtype | None = None) -> DTensor:
    """An empty load target for the chunk of the whole experts tensor that `held` (a slice, maybe edp-sharded)
    covers at this rank's ep coordinate."""
    local = held.to_local() if isinstance(held, DTensor) else held
    return _on_ep(torch.empty(tuple(held.shape), dtype=dtype or held.dtype, device=local.device), ep_mesh)


def as_held(loaded: DTensor, held: torch.Tensor) -> torch.Tensor:
    """A loaded ep chunk shaped as this layout holds the slice: plain, or FSDP2's edp shard with its placements."""
    local = loaded.to_local()
    if not isinstance(held, DTensor):
        return local
    # src_data_rank=None: each rank takes its own shard of what it already has, no communication.
    shard = distribute_tensor(local.to(held.device_mesh.device_type), held.device_mesh, held.placements,
                              src_data_rank=None)
    return shard.to(held.to_local().device)


def _whole_slice(value: torch.Tensor) -> torch.Tensor:
    """This rank's whole ep slice: an FSDP2 shard gathered over edp (on the mesh's device, for offloaded shards)."""
    if not isinstance(value, DTensor):
        return value.detach()
    device = value.to_local().device
    return value.to(value.device_mesh.device_type).full_tensor().to(device)


def _on_ep(local: torch.Tensor, ep_mesh: DeviceMesh) -> DTensor:
    # No check and no communication: every ep rank's slice has the same shape (Config: ep divides n_experts).
    return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
