"""Memory by category, counted from the tensors themselves: what this rank's parameters, gradients and optimizer
state occupy on its device (local shards under ZeRO and tensor parallel, each storage once), and the process total."""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's shard on this rank, read without going through autograd (to_local would record a node).
    return getattr(t, "_local_tensor", t)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t`: a DTensor's local shard, a plain tensor's own elements."""
    local = local_tensor(t)
    return local.numel() * local.element_size()


def parameter_bytes(modules: list[nn.Module]) -> int:
    """Parameters held now, counting FSDP2's gathered (unsharded) copies while they are allocated."""
    total, seen = 0, set()
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += local_bytes(p)
        for fsdp_param in _fsdp_params(module):
            # While gathered, the module exposes the unsharded parameter and the shard lives on beside it.
            sharded = getattr(fsdp_param, "sharded_param", None)
            if sharded is not None and id(sharded) not in seen:
                seen.add(id(sharded))
                total += local_bytes(sharded)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and id(unsharded) not in seen:
                seen.add(id(unsharded))
                total += unsharded.untyped_storage().nbytes()  # 0 while resharded (storage freed)
    return total


def _fsdp_params(module: nn.Module) -> Iterator[Any]:
    # FSDP2 keeps the gathered parameters apart from the sharded ones the module exposes.
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        if group is not None:
            yield from group.fsdp_params


def gradient_bytes(modules: list[nn.Module]) -> int:
    return sum(local_bytes(p.grad) for m in modules for p in m.parameters() if p.grad is not None)


def optimizer_bytes(optimizers: list[torch.optim.Optimizer], device: torch.device) -> int:
    """Optimizer state held on `device`: with offload (Config.offload) a GPU rank's moments live on the host and
    are not counted; on a CPU rank the host is the device."""
    total = 0
    for opt in optimizers:
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's state in .optim
        for state in inner.state.values():
            total += sum(local_bytes(v) for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device.type == device.type)
    return total


def process_bytes(device: torch.device) -> int:
    """Everything this rank's process holds on its device: RSS on CPU, the caching allocator on CUDA."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
