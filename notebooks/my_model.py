"""A decoder of one's own, written without the workbench in mind: notebook 09 trains it as `wb.CustomModel("my_model:build",
plan=PLAN, ...)`. It sits beside the notebook, so the notebook's kernel and its ranks import it (their path starts
with the notebook's folder).

What the workbench needs of it, and finds by itself: one `nn.Embedding`, a `nn.ModuleList` of blocks of one class,
a final norm, a head onto the vocabulary, in that order, and a forward that is exactly embedding → blocks → norm →
head. Two methods say how a block is called: `block_inputs` (the rotary cos/sin, computed once per forward) and
`token_positions` (the positions of the tokens it is given; the workbench gives each context-parallel rank its own).
`PLAN` is its tensor-parallel plan, in transformers' style names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise", "blocks.*.mlp.gate": "colwise", "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.down": "rowwise"}
"""Attention split by heads and the MLP by its width (Megatron's pairing: column-, then row-parallel)."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallel each rank holds some of them, and the same code runs.
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(dim), Attention(dim, heads)
        self.mlp_norm, self.mlp = nn.RMSNorm(dim), SwiGLU(dim, 4 * dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class MyModel(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        self.register_buffer("inv_freq", 10000.0 ** -(torch.arange(half) / half), persistent=False)

    def token_positions(self, length: int, device: torch.device) -> torch.Tensor:
        return torch.arange(length, device=device)

    def block_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = self.token_positions(x.shape[1], x.device)[:, None].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.block_inputs(x)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def build(vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4) -> MyModel:
    """The factory the workbench calls (with the CustomModel's keyword arguments), on every rank."""
    return MyModel(vocab, dim, layers, heads)
