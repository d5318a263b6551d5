"""Expert parallel: each MoE layer's experts split over the "ep" axis, tokens sent to them by all-to-all.

GShard / DeepSpeed-MoE / torchtitan style: the ep ranks are data-parallel
ranks (the dp axis is ("edp", "ep"), see engine/mesh.py). Each holds a
contiguous 1/ep slice of every MoE layer's experts, routes its own tokens,
and in each MoE layer
    1. all-to-all the token counts per expert (every rank learns how many rows
       it will receive from each other rank, for each of its experts),
    2. all-to-all the routed tokens (variable-size splits) to the ranks holding
       their experts, run the local experts on them,
    3. all-to-all the outputs back, in the same splits reversed.
Backward runs the two token exchanges in reverse (the gradient of an
all-to-all is the all-to-all with the splits swapped).

Gradients: a local expert's gradient sums the contributions of all ep ranks'
tokens (the all-to-all backward brings them home), where a dense parameter's
holds one rank's. So the expert slices' gradient is scaled by 1/ep (in backward
only, exact for a power of two), then averaged over "edp" (the replicas of the
same experts: a gradient hook under DDP, FSDP2's own mean over edp under ZeRO
2/3), as the dense gradients are averaged over dp: both then hold the gradient
of the mean loss over the global batch.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import Config
from workbench.engine.parallel.expert_slice import ExpertSlice
from workbench.models.protocol import CausalLM
from workbench.models.transformer import GroupedExperts

if TYPE_CHECKING:
    from workbench.engine.parallel.expert_exchange import TwoLevel


class ExpertParallelExperts(ExpertSlice, GroupedExperts):
    """The built-in model's experts ("sorted" call: tokens sorted by expert, counts) as this rank's slice."""

    def __init__(self, full: GroupedExperts, ep_mesh: DeviceMesh, two_level: "TwoLevel | None" = None) -> None:
        n_experts, dim, hidden = full.w1.shape
        with torch.device(full.w1.device):  # a model laid out on the meta device gets meta slices
            GroupedExperts.__init__(self, n_experts // ep_mesh.size(), dim, hidden)
        self._slice_of(n_experts, ep_mesh, two_level)
        if not full.w1.is_meta:
            lo = self.ep_rank * self.n_local
            with torch.no_grad():
                for name in ("w1", "w2", "w3"):
                    getattr(self, name).copy_(getattr(full, name)[lo:lo + self.n_local])

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """tokens sorted by (global) expert, counts (n_experts,) → their outputs, same order."""
        return self.exchange(tokens, counts, super().forward)


def apply_ep(model: CausalLM, mesh: DeviceMesh, cfg: Config) -> CausalLM:
    """Replace every MoE layer's experts (the model protocol's `routed_experts`) by this rank's 1/ep slice that
    exchanges tokens over `mesh["ep"]` (in two levels, node by node, when cfg.expert_exchange is "hierarchical")."""
    if cfg.ep == 1:
        return model
    two_level = None
    if cfg.expert_exchange == "hierarchical":
        from workbench.engine.parallel.expert_exchange import two_level_exchange

        two_level = two_level_exchange(mesh, "ep")
    for experts in model.routed_experts():
        parent, _, name = experts.path.rpartition(".")
        owner = model.get_submodule(parent)
        full = owner._modules[name]
        if isinstance(full, ExpertSlice):
            continue
        if experts.call == "sorted":
            owner._modules[name] = ExpertParallelExperts(full, mesh["ep"], two_level)
        else:
            from workbench.engine.parallel.expert_routed import routed_slice

            owner._modules[name] = routed_slice(full, mesh["ep"], two_level)
    return model


def expert_modules(model: nn.Module) -> list[tuple[str, ExpertSlice]]:
    """(name in `model`, module) of every expert-parallel slice: what data parallel and state export treat apart."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertSlice)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, m in expert_modules(model) for p in m.parameters()]


def sync_expert_gradients_with_hooks(model: nn.Module, edp_mesh: DeviceMesh) -> None:
    """For DDP (zero 0), which ignores the expert slices: average each expert gradient over edp as autograd
    produces it (every micro-batch: a sum of all-reduces is the all-reduce of the sum)."""
    group, replicas = edp_mesh.get_group(), edp_mesh.size()
    if replicas == 1:
        return  # dp == ep: every expert slice is held once, nothing to average

    def sync(grad: torch.Tensor) -> torch.Tensor:
        grad = grad / replicas
        dist.all_reduce(grad, group=group)
        return grad

    for p in expert_parameters(model):
        p.register_hook(sync)


@dataclass(frozen=True)
class ExpertShard:
    """Where a bare parameter name's tensor is a slice along dim 0 of the full experts tensor."""

    rank: int
    size: int
    group: object

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """All ep slices, concatenated along dim 0 (collective over the ep axis)."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        n = full.shape[0] // self.size
        return full[self.rank * n:(self.rank + 1) * n]


def param_of_key(key: str) -> str:
    """The parameter name in a flat model ("<fqn>") or optimizer ("state.<fqn>.<key>") key."""
    return key.removeprefix("state.").rsplit(".", 1)[0] if key.startswith("state.") else key


def is_expert_slice(key: str, value: Any, experts: Container[str]) -> bool:
    """Whether `value` under flat `key` is an expert slice along dim 0 (AdamW's step counter is a scalar, the same
    on every ep rank: not one)."""
    return param_of_key(key) in experts and isinstance(value, torch.Tensor) and value.dim() > 0


def expert_shards(model: nn.Module, bare_name) -> dict[str, ExpertShard]:
    """Bare parameter name → its ep slicing, for every expert-parallel parameter of `model`."""
    return {bare_name(f"{name}.{pname}"): ExpertShard(m.ep_rank, m.ep_size, m.group)
            for name, m in expert_modules(model) for pname, _ in m.named_parameters()}
