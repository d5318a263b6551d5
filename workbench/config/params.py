"""Parameter counts of a model shape: the one home for them (the estimator, the plan, the UI and the tests read these).

Counted from the shapes the engine builds (models/transformer.py): per block
wq, wk, wv, wo and a SwiGLU (w1, w2, w3), two RMSNorm weights; an embedding
and an untied output head; a final norm. A mixture-of-experts FFN replaces the
SwiGLU by a router (dim × n_experts), n_experts SwiGLU experts and, if asked,
one shared SwiGLU expert.

Two views of a MoE model: *stored* parameters (every expert; what memory
holds) and *active* ones (what one token multiplies: the router, its top_k
experts and the shared expert; what FLOPs follow).
"""

from __future__ import annotations

from typing import Protocol


class Shape(Protocol):
    """What the counts read of a model's shape (`ModelConfig` is one). A protocol rather than ModelConfig itself:
    ModelConfig's own counts (`num_params`, ...) are these functions, so this module imports nothing back."""

    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def hidden_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def shared_expert(self) -> bool: ...
    @property
    def n_moe_layers(self) -> int: ...


def attention_params(m: Shape) -> int:
    """wq and wo (dim × heads·head_dim each), wk and wv (dim × kv_heads·head_dim each)."""
    return 2 * m.dim * m.n_heads * m.head_dim + 2 * m.dim * m.kv_heads * m.head_dim


def mlp_params(m: Shape) -> int:
    """One SwiGLU MLP, w1, w3 (dim × hidden) and w2 (hidden × dim): a dense FFN, or one expert."""
    return 3 * m.dim * m.hidden_dim


def block_linears(m: Shape, tp: int = 1) -> list[tuple[int, int]]:
    """(fan-in, fan-out) of a dense block's seven linears in the order they run, wq, wk, wv, wo, w1, w3, w2, on one
    of `tp` tensor-parallel ranks (the first three and w1, w3 split by output, wo and w2 by input)."""
    d, q, kv, f = m.dim, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden_dim
    return [(d, q // tp), (d, kv // tp), (d, kv // tp), (q // tp, d), (d, f // tp), (d, f // tp), (f // tp, d)]


def block_matmul_params(m: Shape) -> int:
    """Weight-matrix elements of one dense block (attention and SwiGLU; no norms): what tensor parallel splits."""
    return attention_params(m) + mlp_params(m)


def block_params(m: Shape) -> int:
    """Every parameter of one dense block: its matrices and its two RMSNorm weights."""
    return block_matmul_params(m) + 2 * m.dim


def embedding_params(m: Shape) -> int:
    """The token embedding, vocab_size × dim (a lookup: no FLOPs)."""
    return m.vocab_size * m.dim


def head_params(m: Shape) -> int:
    """The output head, dim × vocab_size (not tied to the embedding)."""
    return m.dim * m.vocab_size


def router_params(m: Shape) -> int:
    """A MoE FFN's router, dim × n_experts (0 for a dense model)."""
    return m.dim * m.n_experts


def moe_ffn_params(m: Shape) -> int:
    """Stored parameters of one mixture-of-experts FFN: router, every expert, the shared expert if any."""
    return router_params(m) + (m.n_experts + m.shared_expert) * mlp_params(m)


def moe_active_ffn_params(m: Shape) -> int:
    """Parameters of one MoE FFN that one token multiplies: the router, top_k experts and the shared expert."""
    return router_params(m) + (m.top_k + m.shared_expert) * mlp_params(m)


def total_params(m: Shape) -> int:
    """Every stored parameter: blocks (MoE FFNs with all their experts), embedding, head, final norm."""
    dense = m.n_layers * block_params(m) + embedding_params(m) + head_params(m) + m.dim
    return dense + m.n_moe_layers * (moe_ffn_params(m) - mlp_params(m))


def active_params(m: Shape) -> int:
    """Parameters one token uses: as `total_params`, but each MoE FFN counts only its active part."""
    return total_params(m) - m.n_moe_layers * (moe_ffn_params(m) - moe_active_ffn_params(m))


def active_matmul_params(m: Shape) -> int:
    """Weight-matrix elements one token multiplies on its way through the model (embedding excluded: a lookup;
    norms excluded: no matmul): 2 FLOPs each forward, 6 forward + backward."""
    moe = m.n_moe_layers * (moe_active_ffn_params(m) - mlp_params(m))
    return m.n_layers * block_matmul_params(m) + moe + head_params(m)
