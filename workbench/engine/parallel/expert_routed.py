"""Expert parallel for transformers' experts convention: stacked 3-D weights called with the router's choices.

A transformers mixture of experts (Qwen3-MoE, Mixtral, ...) routes in its MoE block and calls its experts module as
`experts(hidden (tokens, dim), top_k_index (tokens, k), top_k_weights (tokens, k))`, which returns every token's
weighted sum of its experts' outputs; each parameter stacks the experts along dim 0. Its slice on an ep rank is the
same module (its class, its parameter names) holding experts [r·E/ep, (r+1)·E/ep) and `num_experts = E/ep`, with
`RoutedSlice` mixed in: its forward sorts the (token, choice) assignments by expert, exchanges the rows over the ep
axis as the built-in model's experts do (`ExpertSlice.exchange`), runs the family's own experts forward on the
rows that arrive (each row one assignment: local expert index, weight 1), and adds each returned row, times its
router weight, into its token, in expert order, as the family's forward does.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.engine.parallel.expert_slice import ExpertSlice

_SLICED: dict[type, type] = {}


class RoutedSlice(ExpertSlice):
    """This rank's slice of a transformers experts module (mixed into its own class by `routed_slice`)."""

    wb_family_forward = None
    """The experts class's own forward: what runs this rank's experts."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)  # assignments grouped by expert, tokens in order within each
        expert = expert[order]
        token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)[order]
        weight = top_k_weights.reshape(-1)[order]
        counts = torch.bincount(expert, minlength=self.n_local * self.ep_size)
        routed = self.exchange(hidden[token], counts, self._run_local)
        return torch.zeros_like(hidden).index_add_(0, token, (routed * weight[:, None]).to(hidden.dtype))

    def _run_local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        index = torch.repeat_interleave(torch.arange(self.n_local, device=rows.device), counts)[:, None]
        return type(self).wb_family_forward(self, rows, index, torch.ones(len(rows), 1, dtype=rows.dtype,
                                                                         device=rows.device))


def routed_slice(full: nn.Module, ep_mesh: DeviceMesh, two_level=None) -> nn.Module:
    """`full` (a transformers experts module) cut to this ep rank's experts: a slice of each stacked parameter
    (meta slices of a model laid out on the meta device)."""
    cls = type(full)
    if cls not in _SLICED:
        _SLICED[cls] = type(f"RoutedSlice[{cls.__name__}]", (RoutedSlice, cls),
                            {"__module__": cls.__module__, "wb_family_forward": cls.forward})
    piece = copy.copy(full)
    piece._parameters, piece._buffers, piece._modules = {}, dict(full._buffers), dict(full._modules)
    piece.__class__ = _SLICED[cls]
    n_experts = full.num_experts
    piece._slice_of(n_experts, ep_mesh, two_level)
    lo, n = piece.ep_rank * piece.n_local, piece.n_local
    for name, param in full._parameters.items():
        if param is not None:
            value = param.detach()[lo:lo + n]
            piece._parameters[name] = nn.Parameter(value if value.is_meta else value.clone(),
                                                   requires_grad=param.requires_grad)
    piece.num_experts = n
    return piece
