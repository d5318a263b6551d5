"""Model states per rank: parameters, gradients and optimizer state, as ZeRO shards them over dp."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.estimate.stage import ceil_div


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the model states ZeRO shards: the parameters, their gradients, the optimizer's state."""

    parameters: int
    gradients: int
    optimizer: int


ENGINE_STATE_BYTES = StateBytes(parameters=4, gradients=4, optimizer=8)
"""How the engine holds them: fp32 parameters (the master copy; bf16/fp16 come from autocast), fp32 gradients,
AdamW's two fp32 moments."""
ZERO_PAPER_STATE_BYTES = StateBytes(parameters=2, gradients=2, optimizer=12)
"""Rajbhandari et al. 2020 (ZeRO), section 3.1: mixed-precision Adam keeps fp16 parameters and gradients (2+2 B)
and K = 12 B of optimizer state (fp32 master parameters, momentum, variance)."""

OPTIMIZER_STATE_BYTES = {"adamw": 8, "lion": 4, "sgd": 4}
"""fp32 optimizer state per parameter by Config.optimizer: AdamW's two moments, Lion's one, SGD's momentum buffer."""


def engine_state_bytes(optimizer: str) -> StateBytes:
    """What the engine keeps per parameter with `optimizer` (ENGINE_STATE_BYTES is AdamW's)."""
    return StateBytes(parameters=4, gradients=4, optimizer=OPTIMIZER_STATE_BYTES[optimizer])


def model_state_memory(params: int, dp: int, zero: int,
                       state: StateBytes = ENGINE_STATE_BYTES) -> tuple[int, int, int]:
    """Bytes of (parameters, gradients, optimizer state) on one rank for `params` parameter elements, with ZeRO
    stage `zero` across `dp` ranks: stage 1 shards the optimizer state, 2 also the gradients, 3 also the parameters.
    The estimator's own arithmetic for these categories, whatever the bytes per parameter."""
    return (ceil_div(state.parameters * params, dp if zero == 3 else 1),
            ceil_div(state.gradients * params, dp if zero >= 2 else 1),
            ceil_div(state.optimizer * params, dp if zero >= 1 else 1))


def zero_paper_memory(params: int, dp: int) -> dict[int, int]:
    """Model-state bytes per rank at ZeRO stages 0-3 under the ZeRO paper's convention (2+2+12 B per parameter):
    what its Figure 1 tabulates as baseline, P_os, P_os+g and P_os+g+p."""
    return {zero: sum(model_state_memory(params, dp, zero, ZERO_PAPER_STATE_BYTES)) for zero in range(4)}
