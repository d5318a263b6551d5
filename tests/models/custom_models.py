"""Users' own modules, as a notebook would define them, for `CustomModel("tests.models.custom_models:...")`.

`tiny_gpt`: a decoder written without the workbench in mind (blocks in a ModuleList `h`, its own names, SDPA
attention, rotary cos/sin computed once per forward). It says how its blocks are called (`block_inputs`) and reads
its positions with `token_positions`; everything else the workbench finds. The others are what it must refuse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim // heads, 2) / (dim // heads)),
                             persistent=False)

    def token_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """Positions 0..length-1 (the workbench's adapter gives the ones a rank holds instead)."""
        return torch.arange(length, device=device)

    def block_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = self.token_positions(hidden.shape[1], hidden.device)[:, None].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        cos, sin = self.block_inputs(x)
        for block in self.h:
            x = block(x, cos, sin)
        return self.lm_head(self.ln_f(x))


PLAN = {"h.*.attn.q": "colwise", "h.*.attn.k": "colwise", "h.*.attn.v": "colwise", "h.*.attn.proj": "rowwise",
        "h.*.mlp.up": "colwise", "h.*.mlp.down": "rowwise"}


def tiny_gpt(vocab: int = 256, dim: int = 32, layers: int = 4, heads: int = 4) -> TinyGPT:
    return TinyGPT(vocab, dim, layers, heads)


class WithPositions(TinyGPT):
    """Adds learned positions in its own forward, between the embedding and the blocks: not embedding → blocks →
    norm → head, so the workbench must refuse it rather than train something else."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.wpe = nn.Embedding(64, self.wte.embedding_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        cos, sin = self.block_inputs(x)
        for block in self.h:
            x = block(x, cos, sin)
        return self.lm_head(self.ln_f(x))


def with_positions(vocab: int = 256, dim: int = 32, layers: int = 4, heads: int = 4) -> WithPositions:
    return WithPositions(vocab, dim, layers, heads)


class Scale(nn.Module):
    """A parameter with no reset_parameters(): its initial value cannot be drawn on a rank alone."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def unscaled(vocab: int = 256, dim: int = 32) -> nn.Module:
    model = TinyGPT(vocab, dim, 2, 4)
    model.ln_f = Scale(dim)
    return model


def no_blocks(vocab: int = 256, dim: int = 32) -> nn.Module:
    return nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, vocab))


class ListMoE(nn.Module):
    """A mixture of experts written the plain way: a router and a list of experts, each called on its tokens."""

    def __init__(self, dim: int, n: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n, bias=False)
        self.experts = nn.ModuleList(MLP(dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            out[mask] = expert(x[mask])
        return out


def list_moe(vocab: int = 256, dim: int = 32, layers: int = 2, heads: int = 4) -> TinyGPT:
    model = TinyGPT(vocab, dim, layers, heads)
    for block in model.h:
        block.mlp = ListMoE(dim)
    return model
