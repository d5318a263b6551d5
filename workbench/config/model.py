"""The model's shape (`ModelConfig`), validated when it is made, and the named presets.

Parameter counts are in `params.py`; the properties here (`num_params`,
`moe_params`, `active_params`) read them from there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from workbench.config import params
from workbench.config.refusals import at_least, check_fields, positive, refuse

BYTE_VOCAB = 256
"""Tokens are bytes (engine/data.py): a vocabulary smaller than this cannot embed the data."""
ROTARY_TABLE_LIMIT_BYTES = 256 * 2**20
"""Bound on max_seq_len through the rotary table every rank builds for it (models/transformer.py): 4·head_dim bytes per
position kept (fp32 cos and sin), about six times that while it is built (float64 angles, cos, sin, their stack).
256 MiB kept (~1.5 GiB while built) is 524,288 positions at head_dim 128, beyond the contexts published models train
with, and fails fast instead of running a rank out of memory."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a decoder-only transformer (RMSNorm, rotary positions, SwiGLU, grouped-query attention)."""

    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads; dim must be divisible by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    vocab_size: int = 256
    """Token vocabulary, at least 256: the workbench's tokens are bytes; larger ones are real models' shapes."""
    ffn_dim: int | None = None
    """Hidden width of the SwiGLU MLP; None means about 8/3·dim rounded up to a multiple of 64."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables cover (bounded by ROTARY_TABLE_LIMIT_BYTES)."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon, > 0."""
    rope_theta: float = 10000.0
    """Rotary base frequency, > 0."""
    n_experts: int = 0
    """Experts per mixture-of-experts FFN; 0 means a dense model (every FFN one SwiGLU MLP)."""
    top_k: int = 2
    """Experts each token is routed to (top-k of the router's softmax); 1 ≤ top_k ≤ n_experts."""
    capacity_factor: float = 1.25
    """Slots per expert as a multiple of a perfectly even share: ceil(capacity_factor·seq_len·top_k/n_experts)
    per sequence; assignments beyond it are dropped (the token skips that expert)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss added to the training loss (0 turns it off)."""
    moe_every: int = 1
    """Every moe_every-th block's FFN is a mixture of experts (blocks moe_every-1, 2·moe_every-1, ...)."""
    shared_expert: bool = False
    """Add one dense SwiGLU expert that every token goes through, beside the routed ones."""

    sliding_window = None
    """Not a field: the built-in attention sees the whole past (model sources with a window say so, `sources.py`)."""
    tied_embeddings = False
    """Not a field: the output head has its own weight."""

    def __post_init__(self) -> None:
        check_fields(self, _RANGES, prefix="model.")
        self._check_heads()
        self._check_experts()
        table = 4 * self.head_dim * self.max_seq_len
        if table > ROTARY_TABLE_LIMIT_BYTES:
            most = ROTARY_TABLE_LIMIT_BYTES // (4 * self.head_dim)
            raise refuse("model.max_seq_len", f"max_seq_len={self.max_seq_len} needs a {table / 2**20:,.0f} MiB rotary "
                         f"table on every rank (limit {ROTARY_TABLE_LIMIT_BYTES >> 20} MiB)",
                         f"use max_seq_len ≤ {most:,} at head_dim {self.head_dim}")

    def _check_heads(self) -> None:
        if self.dim % self.n_heads:
            raise refuse("model.n_heads", f"dim={self.dim} is not divisible by n_heads={self.n_heads}",
                         "choose n_heads dividing dim")
        if (self.dim // self.n_heads) % 2:
            raise refuse("model.n_heads", f"head dim {self.dim // self.n_heads} is odd; rotary needs it even",
                         "choose n_heads so that dim/n_heads is even")
        if self.n_heads % self.kv_heads:
            raise refuse("model.n_kv_heads", f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}",
                         "choose n_kv_heads dividing n_heads")

    def _check_experts(self) -> None:
        if self.n_experts == 0:
            return
        if self.n_experts == 1:
            raise refuse("model.n_experts", "one expert is a dense FFN with a router in front",
                         "set n_experts ≥ 2, or 0 for a dense model")
        if self.top_k > self.n_experts:
            raise refuse("model.top_k", f"top_k={self.top_k!r} must be an integer in 1..n_experts={self.n_experts}",
                         f"choose top_k between 1 and {self.n_experts}")
        if self.moe_every > self.n_layers:
            raise refuse("model.moe_every", f"moe_every={self.moe_every!r} must be an integer in 1..n_layers="
                         f"{self.n_layers}", "choose moe_every so that at least one block is a mixture of experts")

    def same_weights(self, other: ModelConfig) -> bool:
        """Whether `other` describes the same parameters: equal but for the routing settings (top_k,
        capacity_factor, aux_loss_coef), which change how experts are used, not what they are."""
        routing = {"top_k", "capacity_factor", "aux_loss_coef"}
        return isinstance(other, ModelConfig) and all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self)
                   if f.name not in routing)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer`'s FFN is a mixture of experts."""
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the blocks whose FFN is a mixture of experts."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def expert_capacity(self, seq_len: int) -> int:
        """Slots per expert per sequence (the routing group): ceil(capacity_factor·seq_len·top_k / n_experts)."""
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts) if self.n_experts else 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return -(-(8 * self.dim // 3) // 64) * 64

    @property
    def num_params(self) -> int:
        """Parameter count, from the shapes (embedding and output are not tied): `params.total_params`."""
        return params.total_params(self)

    @property
    def moe_params(self) -> int:
        """Parameters of one mixture-of-experts FFN: router, every expert, the shared expert if any."""
        return params.moe_ffn_params(self)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: a MoE FFN counts its router, top_k experts and the shared expert."""
        return params.active_params(self)

    @property
    def name(self) -> str:
        """Display name: a preset's when the shape is one (routing settings aside), else the shape in brief."""
        preset = next((n for n, m in PRESETS.items() if m.same_weights(self) and m.n_experts == self.n_experts), None)
        if preset is not None:
            return preset
        experts = f", {self.n_experts} experts" if self.n_experts else ""
        return f"dim {self.dim} × {self.n_layers} layers{experts}"

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named shape: "tiny" trains visibly in a minute on 2 CPU cores; the others are real sizes."""
        try:
            return PRESETS[name]
        except KeyError:
            raise refuse("model", f"unknown preset {name!r}", f"use one of {sorted(PRESETS)}") from None


_RANGES = {
    "dim": at_least(1), "n_layers": at_least(1), "n_heads": at_least(1), "n_kv_heads": at_least(1),
    "vocab_size": at_least(BYTE_VOCAB, "the byte vocabulary: every byte value is a token"),
    "ffn_dim": at_least(1), "max_seq_len": at_least(1), "norm_eps": positive, "rope_theta": positive,
    "n_experts": at_least(0), "top_k": at_least(1), "capacity_factor": positive, "aux_loss_coef": at_least(0),
    "moe_every": at_least(1),
}
"""Each field's range, checked after its type; rules across fields are the methods above."""


PRESETS: dict[str, ModelConfig] = {
    # byte-level, ~0.9 M parameters: a few steps per second on two CPU cores
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024),
    # tiny with a mixture of 4 SwiGLU experts (top-2) in every block: ~2.6 M parameters, ~1.4 M active per token
    "tiny-moe": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024, n_experts=4, top_k=2),
    # byte-level, ~10 M parameters: CPU experiments that need visible memory
    "small": ModelConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, max_seq_len=2048),
    # GPT-3 small shape with GPT-2's padded vocabulary
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, vocab_size=50304, ffn_dim=2048, max_seq_len=2048),
    # Llama-3.2-1B shape
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                      max_seq_len=8192, rope_theta=500000.0),
    # Llama-3-8B shape
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                      max_seq_len=8192, rope_theta=500000.0),
    # Llama-3.1-70B shape (torchtitan's llama3 "70B": dim 8192, 80 layers, 64 heads, 8 kv heads, ffn 28672)
    "70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672,
                       max_seq_len=8192, rope_theta=500000.0),
    # Llama-3.1-405B shape (torchtitan's llama3 "405B": dim 16384, 126 layers, 128 heads, 8 kv heads, ffn 53248)
    "405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248,
                        max_seq_len=8192, rope_theta=500000.0),
}
