"""ZeRO-Offload for zero 0/1: the optimizer's state and step on the host, parameters copied back to the device.

`HostOffload.of(torch.optim.AdamW)` (or Lion, or SGD: any torch optimizer
class) is an optimizer that looks like any other over the device parameters
(so GradScaler, zero_grad, torch.distributed.checkpoint's state dicts and
ZeroRedundancyOptimizer's `optimizer_class` all work on it unchanged), but owns
a second, separate optimizer of that class (`.host`) over fp32 master copies of
the parameters in host memory. A step:

    1. copies each gradient to the host (into pinned memory on CUDA),
    2. runs the host optimizer there: its state and the master weights never touch the device,
    3. copies the updated master weights back into the device parameters.

`state` (what checkpoints and reshards read) is keyed by the device parameters, as torch expects, and
holds the host optimizer's very own tensors: the same objects, on the CPU. Anything that loads state
(DCP, a reshard) may hand in device tensors; the next step moves them to the host first. If a device
parameter is written from outside (a checkpoint load), its version counter changes and the next step
refreshes the master copy from it.

zero 2/3 use FSDP2's own CPUOffloadPolicy instead (see data_parallel.apply_fsdp): its sharded
parameters already live on the host there, so a plain optimizer steps on the host by itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch


class HostOffload(torch.optim.Optimizer):
    """An optimizer (`inner`, set by `HostOffload.of`) whose state, master weights and step live in host memory."""

    inner: type[torch.optim.Optimizer] = torch.optim.AdamW

    @classmethod
    @functools.cache
    def of(cls, optimizer_class: type[torch.optim.Optimizer]) -> type[HostOffload]:
        """The offloading version of `optimizer_class`, a class (one per optimizer class) that
        ZeroRedundancyOptimizer can construct as its `optimizer_class`."""
        return type(f"HostOffload{optimizer_class.__name__}", (cls,), {"inner": optimizer_class})

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], **hyper: Any) -> None:
        # The inner class's own defaults, so param_groups and state dicts read exactly as a plain one's.
        defaults = self.inner([torch.zeros(1)], **hyper).defaults
        super().__init__(params, dict(defaults))
        self._master: dict[torch.Tensor, torch.Tensor] = {}
        self._grad_buffer: dict[torch.Tensor, torch.Tensor] = {}  # pinned host gradients, reused (CUDA only)
        self._seen_version: dict[torch.Tensor, int] = {}
        groups = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                self._master[p] = _host_copy(p.detach())
                self._seen_version[p] = p._version
                masters.append(self._master[p])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        self.host = self.inner(groups)
        """The host optimizer: a plain one over the master copies; its state is this optimizer's state."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError(f"{type(self).__name__} does not take a closure")
        for group, host_group in zip(self.param_groups, self.host.param_groups):
            # Hyperparameters set on this optimizer (a reshard, an lr schedule) apply to the host one.
            host_group.update({k: v for k, v in group.items() if k != "params"})
            for p in group["params"]:
                master = self._master[p]
                if p._version != self._seen_version[p]:
                    master.copy_(p.detach())  # written from outside since our last step: follow it
                master.grad = None if p.grad is None else self._host_grad(p)
                self._adopt_state(p, master)
        self.host.step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(self._master[p], non_blocking=True)
                    self._seen_version[p] = p._version
                self._master[p].grad = None
        self._link_states()
        return None

    def _host_grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad.device.type == "cpu":
            return p.grad if p.grad.dtype == torch.float32 else p.grad.float()  # the step only reads it
        buffer = self._grad_buffer.get(p)
        if buffer is None:
            buffer = self._grad_buffer[p] = _host_copy(p.grad)
        else:
            buffer.copy_(p.grad)
        return buffer

    def _adopt_state(self, p: torch.Tensor, master: torch.Tensor) -> None:
        """Make `state[p]` and the host optimizer's `state[master]` one dict of host tensors."""
        state = self.state.get(p)
        if state is None:
            return  # the first step creates it in the host optimizer; `_link_states` shares it
        if self.host.state.get(master) is not state:
            state = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            self.state[p] = state
            self.host.state[master] = state

    def state_dict(self) -> dict[str, Any]:
        self._link_states()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # torch moves the moments to the parameters' device ...
        for group in self.param_groups:
            for p in group["params"]:
                self._adopt_state(p, self._master[p])  # ... and we move them back to the host

    def _link_states(self) -> None:
        for p, master in self._master.items():
            if master in self.host.state:
                self.state[p] = self.host.state[master]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host fp32 copy of `t`; pinned when it comes from a GPU, so the copies run at full bus speed."""
    if t.device.type == "cpu":
        return t.detach().to(torch.float32, copy=True)
    out = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
    out.copy_(t.detach())
    return out


HostOffloadAdamW = HostOffload.of(torch.optim.AdamW)
