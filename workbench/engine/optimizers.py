"""The optimizers a Config names (`Config.optimizer`): AdamW and SGD from torch, Lion written here (torch has none).

    "adamw"  torch.optim.AdamW: two moments per parameter (exp_avg, exp_avg_sq) and a step count
    "lion"   Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one moment, a sign update
    "sgd"    torch.optim.SGD with momentum 0.9: one buffer per parameter (momentum_buffer)

Each is a torch.optim.Optimizer, so every ZeRO stage (ZeroRedundancyOptimizer's
`optimizer_class`, FSDP2's sharded DTensor parameters), offload (`HostOffload.of`),
GradScaler and torch.distributed.checkpoint's state dicts take it unchanged.
Learning rate and weight decay come from the Config for all three.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

LION_BETAS = (0.9, 0.99)
"""The paper's defaults: β1 interpolates the update's direction, β2 the moment kept."""
SGD_MOMENTUM = 0.9


class Lion(torch.optim.Optimizer):
    """Lion: update = sign(β1·m + (1-β1)·g); p ← p·(1 - lr·wd) - lr·update; m ← β2·m + (1-β2)·g.

    One moment per parameter where AdamW keeps two, so its state is half of AdamW's;
    every element moves by exactly lr (times the sign), so its lr is usually 3-10×
    smaller than AdamW's for the same run. Works on DTensor parameters (tensor
    parallel, FSDP2 shards): every operation is elementwise.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = LION_BETAS,
                 weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr: must be > 0, got {lr}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas: must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                moment, grad = state["exp_avg"], p.grad
                if decay:
                    p.mul_(1 - lr * decay)  # decoupled, as AdamW's
                p.add_(moment.mul(beta1).add_(grad, alpha=1 - beta1).sign_(), alpha=-lr)
                moment.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "lion": Lion,
                                                      "sgd": torch.optim.SGD}
"""Config.optimizer → the class."""


def hyperparameters(cfg: Any) -> dict[str, Any]:
    """The keyword arguments the Config's optimizer takes (lr and weight decay for all; SGD's momentum)."""
    extra = {"momentum": SGD_MOMENTUM} if cfg.optimizer == "sgd" else {}
    return dict(lr=cfg.lr, weight_decay=cfg.weight_decay, **extra)
