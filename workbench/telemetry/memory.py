"""Memory by category, counted from the tensors themselves: what this rank's parameters, gradients and optimizer
state occupy on its device (local shards under ZeRO and tensor parallel, each storage once), and the process total.

The functions walk the modules and optimizers each call (50-150 µs). `ModelMemory` gives the same answers for one
trainer several times a step: what its layout fixes (which parameter slots there are, which FSDP2 parameters, each
tensor's size) is found once, and each call reads only what moves (what FSDP2 has gathered, which gradients and
optimizer states exist).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's shard on this rank, read without going through autograd (to_local would record a node).
    return getattr(t, "_local_tensor", t)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t`: a DTensor's local shard, a plain tensor's own elements."""
    return local_tensor(t).nbytes  # numel * element size


def parameter_bytes(modules: list[nn.Module]) -> int:
    """Parameters held now, counting FSDP2's gathered (unsharded) copies while they are allocated."""
    total, seen = 0, set()
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += local_bytes(p)
        total += _fsdp_copies_bytes(_fsdp_params(module), seen, local_bytes)
    return total


def _fsdp_copies_bytes(fsdp_params: Iterable[Any], seen: set[int], size: Callable[[torch.Tensor], int]) -> int:
    """Bytes of FSDP2's own copies of `fsdp_params` that are not among `seen` (ids; the copies counted are added):
    while a parameter is gathered, the module exposes the unsharded parameter and the shard lives on beside it;
    the unsharded one counts its storage, 0 while resharded (freed). `size`: a tensor's bytes."""
    total = 0
    for fsdp_param in fsdp_params:
        sharded = getattr(fsdp_param, "sharded_param", None)
        if sharded is not None and id(sharded) not in seen:
            seen.add(id(sharded))
            total += size(sharded)
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None and id(unsharded) not in seen:
            seen.add(id(unsharded))
            total += unsharded.untyped_storage().nbytes()
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


class ModelMemory:
    """`parameter_bytes`, `gradient_bytes` and `optimizer_bytes` of one trainer's modules and optimizers, equal to the
    functions' answers, for the probe to call every step.

    Fixed by the layout, so found once: every module's parameter slots (FSDP2 swaps sharded and gathered parameters
    in and out of them, so the slots are read at each call, never their contents kept), the FSDP2 parameters, and
    the bytes of each tensor object (a tensor's shape and dtype never change). Optimizer state is counted again only
    when a state dict appears or its entries change in number (AdamW fills it at the first step).
    """

    def __init__(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
        self._slots = [(sub._parameters, name) for module in modules for sub in module.modules()
                       for name, p in sub._parameters.items() if p is not None]
        self._fsdp = [fp for module in modules for fp in _fsdp_params(module)]
        self._optimizers = [getattr(opt, "optim", opt) for opt in optimizers]
        self._device = device
        self._sizes: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (the tensor, kept so the id stays its, bytes)
        self._optimizer_key: tuple = ()
        self._optimizer_bytes = 0
        self._last_contents: list[torch.Tensor] = []  # the slots' contents at the last parameter count
        self._last_unique: list[torch.Tensor] = []
        self._last_bytes = 0

    def _bytes(self, t: torch.Tensor) -> int:
        entry = self._sizes.get(id(t))
        if entry is None:
            entry = self._sizes[id(t)] = (t, local_bytes(t))
        return entry[1]

    def _parameters(self) -> list[torch.Tensor]:
        """What `module.parameters()` yields now: the slots' contents, each object once."""
        contents = [slots[name] for slots, name in self._slots]
        if len(contents) != len(self._last_contents) or not all(map(operator.is_, contents, self._last_contents)):
            seen, unique = set(), []
            for p in contents:
                if id(p) not in seen:
                    seen.add(id(p))
                    unique.append(p)
            self._last_contents, self._last_unique = contents, unique
            self._last_bytes = sum(self._bytes(p) for p in unique)
        return self._last_unique

    def parameter_bytes(self) -> int:
        params = self._parameters()
        total = self._last_bytes  # the same objects as last time hold the same bytes (a tensor's size is fixed)
        if not self._fsdp:
            return total
        return total + _fsdp_copies_bytes(self._fsdp, {id(p) for p in params}, self._bytes)

    def gradient_bytes(self) -> int:
        return sum(local_tensor(g).nbytes for g in [p.grad for p in self._parameters()] if g is not None)

    def optimizer_bytes(self) -> int:
        key = tuple((id(opt.state), len(opt.state)) for opt in self._optimizers)
        if key != self._optimizer_key:
            self._optimizer_key, self._optimizer_bytes = key, optimizer_bytes(self._optimizers, self._device)
        return self._optimizer_bytes


def process_bytes(device: torch.device) -> int:
    """Everything this rank's process holds on its device: RSS on CPU, the caching allocator on CUDA."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    return int(os.pread(_statm(), 128, 0).split()[1]) * _PAGE_SIZE


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_statm_fd: tuple[int, int] | None = None  # (pid, fd): the file is opened once per process, read afresh each call


def _statm() -> int:
    global _statm_fd
    pid = os.getpid()
    if _statm_fd is None or _statm_fd[0] != pid:
        _statm_fd = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
    return _statm_fd[1]
