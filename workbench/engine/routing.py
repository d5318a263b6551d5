"""What one rank's routers did in one step, ready to ride the step's world all-reduce.

A rank may hold only some of the model's MoE layers (a pipeline stage), and
it sees only its dp slice of the batch, in micro-batches. The tally therefore
has one row per MoE layer of the *whole* model (`ModelConfig.moe_layers`
order): each rank fills the rows of the layers it holds, after every
micro-batch's forward, and leaves the others at zero. Summed over the world,
the rows of the pipeline stages fit together and the dp ranks' counts add up
to the global batch's; the balancing loss sums over stages to each replica's
loss, which the trainer then averages over the replicas.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.config import ModelConfig
from workbench.models.transformer import moe_layers


class RouterTally:
    """One rank's balancing loss (as a share of the step's mean), assignments per MoE layer × expert and
    assignments dropped per MoE layer, summed over the step's micro-batches."""

    def __init__(self, model: ModelConfig, micro_batches: int, device: torch.device | str = "cpu") -> None:
        self.rows = {layer: row for row, layer in enumerate(model.moe_layers)}
        self.micro_batches = micro_batches
        # On the device the routers run on: adding is then no host sync (the step's all-reduce is the one).
        self.aux_loss = torch.zeros((), device=device)
        self.load = torch.zeros(len(self.rows), model.n_experts, device=device)
        self.dropped = torch.zeros(len(self.rows), device=device)

    def reset(self) -> None:
        """Start a step: nothing routed yet."""
        self.aux_loss.zero_()
        self.load.zero_()
        self.dropped.zero_()

    def add(self, module: nn.Module) -> None:
        """Add what the MoE layers of `module` (a model, a stage, or what wraps them) routed in their last forward."""
        for moe in moe_layers(module):
            if moe.last_load is None:
                continue
            row = self.rows[moe.layer]
            # Divided by the micro-batches: the step's balancing loss is the mean over its micro-batches, like the loss.
            self.aux_loss += moe.last_aux_loss.detach().float() / self.micro_batches
            self.load[row] += moe.last_load.float()
            self.dropped[row] += moe.last_dropped.float()

    def payload(self) -> torch.Tensor:
        """[aux loss, load row by row, dropped]: 1 + layers·(experts + 1) values, the same length on every rank.
        fp32 counts are exact below 2^24."""
        return torch.cat([self.aux_loss.reshape(1), self.load.flatten(), self.dropped])
