"""This rank's slice of a layer's experts, and the exchange that brings it the tokens routed to them.

The all-to-alls of expert parallel (engine/parallel/expert.py says how the tokens and gradients move), as a mixin
of the experts module itself: the built-in model's stacked experts (`expert.ExpertParallelExperts`) and a Hugging
Face family's (`expert_routed.RoutedSlice`) share it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from workbench.engine.parallel.expert_exchange import TwoLevel


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: rows `in_splits` go out, rows `out_splits` come in."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _Exchange(torch.autograd.Function):
    """The hierarchical exchange of a `Plan` (`expert_exchange.py`) with autograd: forward or back, and the
    other way in backward (moving rows is a permutation; its gradient is the inverse one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan, back: bool) -> torch.Tensor:
        ctx.plan, ctx.back = plan, back
        return plan.back(x) if back else plan.out(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (ctx.plan.out(grad) if ctx.back else ctx.plan.back(grad)), None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class ExpertSlice:
    """This rank's 1/ep slice of a layer's experts, taking the layer's tokens for *all* experts and exchanging them
    over the ep axis: in one all-to-all, or through `two_level` (the hierarchical exchange) when given. A mixin of
    the experts module itself, so its parameter names, and so state keys, stay the bare model's."""

    def _slice_of(self, n_experts: int, ep_mesh: DeviceMesh, two_level: "TwoLevel | None") -> None:
        self.ep_size, self.ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.n_local = n_experts // self.ep_size
        self.group = ep_mesh.get_group()
        self.two_level = two_level
        from workbench.engine.parallel.expert_exchange import node_of_rank

        node_of = node_of_rank()
        self._remote = [node_of(r) != node_of(dist.get_rank()) for r in dist.get_process_group_ranks(self.group)]
        self.network_rows = 0
        """Token rows this rank sent to ranks on other nodes in its last forward's exchange (the traffic count)."""

    def exchange(self, tokens: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """tokens sorted by (global) expert, counts (n_experts,) → their outputs, same order; `compute(rows sorted by
        local expert, counts per local expert)` runs this rank's experts on what arrives."""
        ep, n_local = self.ep_size, self.n_local
        if self.two_level is not None:
            return self._exchange_two_level(tokens, counts, compute)
        # 1. counts: after the exchange, received[s, j] = rows rank s sends for local expert j.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        received = received.view(ep, n_local)
        send_splits = counts.view(ep, n_local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()  # the host sync the variable splits need
        self.network_rows = sum(n for n, remote in zip(send_splits, self._remote) if remote)
        # 2. tokens out; what arrives is grouped by source rank, then by local expert: regroup by expert.
        arrived = _AllToAll.apply(tokens, recv_splits, send_splits, self.group)
        return self._experts_and_back(tokens, arrived, received, compute, lambda out: _AllToAll.apply(
            out, send_splits, recv_splits, self.group))

    def _exchange_two_level(self, tokens: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
        # 1. every ep rank's counts: each rank plans both levels of the exchange from the whole matrix.
        everyone = counts.new_empty(self.ep_size * counts.numel())
        dist.all_gather_into_tensor(everyone, counts.contiguous(), group=self.group)
        rows = everyone.view(self.ep_size, self.ep_size, self.n_local).sum(dim=2).tolist()  # rows[s][r]: s sends r
        plan = self.two_level.plan(rows)
        self.network_rows = plan.network_rows
        received = everyone.view(self.ep_size, self.ep_size, self.n_local)[:, self.ep_rank]
        # 2. tokens out in two levels; they arrive as the flat exchange delivers them (by source rank).
        arrived = _Exchange.apply(tokens, plan, False)
        return self._experts_and_back(tokens, arrived, received, compute,
                                      lambda out: _Exchange.apply(out, plan, True))

    def _experts_and_back(self, tokens: torch.Tensor, arrived: torch.Tensor, received: torch.Tensor, compute,
                          send_back) -> torch.Tensor:
        ep, n_local = self.ep_size, self.n_local
        expert_of_row = torch.repeat_interleave(
            torch.arange(n_local, device=tokens.device).repeat(ep), received.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True)
        # The weights' gradient summed every ep rank's tokens: 1/ep of the output's gradient makes it a mean, and
        # ep times the input's gradient leaves the tokens' gradient as it was (the experts are linear in it).
        local = _ScaleGrad.apply(arrived[by_expert], float(ep))
        out = _ScaleGrad.apply(compute(local, received.sum(dim=0)), 1.0 / ep)
        # 3. outputs back to where their tokens came from, in the arrival order.
        return send_back(out[torch.argsort(by_expert)])
