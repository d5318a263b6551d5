"""Model FLOPs of the transformer, from its shape: the one formula the estimator and the ranks' step probe both read.

Pure arithmetic with no torch import and nothing else of the workbench but the model's shape and its parameter
counts (`workbench.config.params`, their one home), so a rank can count its FLOPs without importing the
estimator, and the notebook can count them without torch.
"""

from __future__ import annotations

from workbench.config import ModelConfig
from workbench.config.params import active_matmul_params


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs of q·kᵀ and p·v for one token, over the full seq² square (PaLM's MFU convention,
    and what FlopCounterMode counts): 12 · layers · seq_len · heads · head_dim."""
    return 12 * model.n_layers * seq_len * model.n_heads * model.head_dim


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of forward + backward for one token at sequence length `seq_len`.

    6 · (weight-matrix elements a token multiplies, output head included; the embedding is a lookup; a MoE FFN
    counts its router, top_k experts and shared expert) + 12 · layers · seq_len · dim for attention's q·kᵀ and
    p·v, counted over the full square (not halved for causality), as FlopCounterMode counts them.
    """
    return 6 * active_matmul_params(model) + attention_flops_per_token(model, seq_len)
