"""A decoder-only transformer in the modern style: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

No distribution code lives here. Two conventions make the parallel layouts
possible without touching this file:
- attention infers its head count from the projected tensor's shape, so a
  tensor-parallel split of wq/wk/wv (local heads) runs the same code;
- blocks sit in a ModuleDict keyed by their global index and the embedding,
  final norm and output head may be None, so a pipeline stage is this model
  with the parts it does not own removed (its forward then takes and returns
  hidden states).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig


def rotary_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of every position × frequency, stacked as (max_seq_len, head_dim // 2, 2)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by position-dependent angles."""
    seq = x.shape[1]
    cos, sin = table[:seq, :, 0], table[:seq, :, 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1, not n_heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: derived from the config, so checkpoints carry only trained state.
        self.register_buffer("rope", rotary_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) → logits (batch, seq, vocab); a pipeline stage maps hidden → hidden."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The full model, its initial weights a function of (cfg, seed) alone: every layout starts identical."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(cfg)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the autocast precision."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
