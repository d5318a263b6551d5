"""Model FLOPs of the transformer, from its shape: the one formula the estimator and the ranks' step probe both read.

Pure arithmetic with no torch import and nothing else of the workbench but the model's shape, so a rank can
count its FLOPs without importing the estimator, and the notebook can count them without torch.
"""

from __future__ import annotations

from workbench.config import ModelConfig


def matmul_params(m: ModelConfig) -> tuple[int, int]:
    """Elements of one dense block's weight matrices, and of the output head."""
    attn = 2 * m.dim * m.n_heads * m.head_dim + 2 * m.dim * m.kv_heads * m.head_dim
    return attn + 3 * m.dim * m.hidden_dim, m.dim * m.vocab_size


def moe_matmul_delta(m: ModelConfig) -> int:
    """Weight elements one token multiplies in a MoE FFN beyond those of the dense FFN it replaces: the router,
    top_k experts and the shared expert instead of one SwiGLU."""
    mlp = 3 * m.dim * m.hidden_dim
    return m.dim * m.n_experts + (m.top_k + m.shared_expert - 1) * mlp


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs of q·kᵀ and p·v for one token, over the full seq² square (PaLM's MFU convention,
    and what FlopCounterMode counts): 12 · layers · seq_len · heads · head_dim."""
    return 12 * model.n_layers * seq_len * model.n_heads * model.head_dim


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of forward + backward for one token at sequence length `seq_len`.

    6 · (weight-matrix elements, output head included; the embedding is a lookup)
    + 12 · layers · seq_len · dim for attention's q·kᵀ and p·v, counted over the
    full square (not halved for causality), as FlopCounterMode counts them.
    """
    block, head = matmul_params(model)
    moe = model.n_moe_layers * moe_matmul_delta(model)  # a MoE FFN counts the experts a token goes through
    return 6 * (model.n_layers * block + moe + head) + attention_flops_per_token(model, seq_len)
