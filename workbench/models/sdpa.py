"""Attention reached through `F.scaled_dot_product_attention`: every causal call inside a module routed to a kernel.

A model whose attention has no hook of its own (a user's module) still computes it with torch's SDPA. While the
module runs forward (and again when activation checkpointing recomputes it: the hooks sit on the module, which the
recomputation calls again), a TorchFunctionMode answers every `scaled_dot_product_attention` call with
`kernel(q, k, v, scale)`. Only causal attention with no mask and no dropout can be replaced: anything else is
refused, naming the call, since a kernel that ignored it would compute another model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from workbench.models.protocol import AttentionKernel, Unsupported


class _RouteSDPA(TorchFunctionMode):
    def __init__(self, kernel: AttentionKernel, where: str) -> None:
        super().__init__()
        self.kernel, self.where, self.calls = kernel, where, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        options = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), args[3:]), **kwargs)
        if not options.get("is_causal") or options.get("attn_mask") is not None or options.get("dropout_p"):
            raise Unsupported(f"{self.where}: scaled_dot_product_attention without is_causal=True, or with a mask "
                              "or dropout, cannot go through context parallel's ring (it computes causal attention)")
        self.calls += 1
        scale = options.get("scale")
        return self.kernel(q, k, v, scale if scale is not None else q.shape[-1] ** -0.5)


def route_sdpa(module: nn.Module, kernel: AttentionKernel, where: str = "") -> None:
    """Route every SDPA call inside `module`'s forward to `kernel` (module docstring)."""
    active: list[_RouteSDPA] = []
    where = where or type(module).__name__

    def enter(_module: nn.Module, _args: Any) -> None:
        mode = _RouteSDPA(kernel, where)
        mode.__enter__()
        active.append(mode)

    def seen(_module: nn.Module, _args: Any, _output: Any) -> None:
        if active[-1].calls == 0:
            raise Unsupported(f"{where}: its forward made no causal scaled_dot_product_attention call, so context "
                              "parallel cannot reach its attention. Fix: set cp=1, or define use_attention(kernel) on "
                              "the model")

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(seen)
    module.register_forward_hook(leave, always_call=True)


def sdpa_calls(module: nn.Module, *args: Any, **kwargs: Any) -> int:
    """How many SDPA calls one forward of `module` makes (run on the meta device: nothing computed)."""
    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])

    mode = _RouteSDPA(plain, type(module).__name__)
    with mode, torch.no_grad():
        module(*args, **kwargs)
    return mode.calls
