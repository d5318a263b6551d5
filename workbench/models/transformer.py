"""A decoder-only transformer in the modern style: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

No distribution code lives here. Two conventions make the parallel layouts
possible without touching this file:
- attention infers its head count from the projected tensor's shape, so a
  tensor-parallel split of wq/wk/wv (local heads) runs the same code;
- blocks sit in a ModuleDict keyed by their global index and the embedding,
  final norm and output head may be None, so a pipeline stage is this model
  with the parts it does not own removed (its forward then takes and returns
  hidden states).
- attention's kernel is a module of its own (`CausalAttention`, `attention.core`), and positions come from the
  rotary table the model holds (`rope`, row i for the i-th token it is given), so context parallel swaps in a
  ring exchange of keys and values and a table of the rank's own positions (engine/parallel/context.py);
- a mixture-of-experts FFN (`MoEFeedForward`) routes tokens, then hands the
  routed tokens to its `experts` submodule as one call, `experts(tokens,
  counts)`; expert parallelism replaces that submodule with one that first
  sends the tokens to the ranks holding their experts (engine/parallel/expert.py).
  Each MoE FFN keeps what its last forward measured (balancing loss, tokens
  routed per expert, tokens dropped); `moe_aux_loss` and `moe_routing` collect it.
  The balancing loss trains itself: each MoE FFN attaches it to its output
  (`AttachAuxLoss`), so a plain `loss.backward()` also backpropagates it, on
  whichever pipeline stage the layer sits. Nothing adds it to the loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig
from workbench.config.support import MOE_WHOLE_SEQUENCES
from workbench.models.protocol import AttentionKernel, CausalLM, Experts, Parts


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


class CausalAttention(nn.Module):
    """softmax(q·kᵀ/√head_dim, causally masked)·v over the sequence it is given, grouped-query aware.

    A module of its own, holding no parameters, so that a layout can swap the
    kernel without touching the projections around it (context parallel puts a
    ring exchange of keys and values here).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (batch, heads, seq, head_dim); k, v (batch, kv_heads, seq, head_dim) → (batch, heads, seq, head_dim)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.core = CausalAttention()
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
        out = self.core(q, k, v)
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


class GroupedExperts(nn.Module):
    """n SwiGLU experts, their weights stacked along dim 0 so that an expert-parallel split is a slice of it."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """tokens (sum(counts), dim), sorted by expert, counts[e] of them for expert e → outputs, same order."""
        outs = []
        # One host sync for the split sizes; an expert with no tokens still joins the graph (zero gradient),
        # so data parallel sees every parameter used.
        for e, chunk in enumerate(tokens.split(counts.tolist())):
            outs.append((F.silu(chunk @ self.w1[e]) * (chunk @ self.w3[e])) @ self.w2[e])
        return torch.cat(outs)


class AttachAuxLoss(torch.autograd.Function):
    """Identity on the hidden states; in backward, also starts the balancing loss's backward, with gradient `scale`.

    Megatron's MoEAuxLossAutoScaler. The balancing loss then reaches its router
    wherever backward passes through the layer, with no term in the loss
    function: a pipeline stage's routers get their balancing gradient although
    the loss is computed on the last stage. `scale` must be the gradient the
    training loss itself starts backward with (1 for `loss.backward()`; the loss
    scale / micro-batches in the trainer), so the two losses are weighted alike.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        # Only the scalar's dtype and device are kept, not the tensor: nothing extra is saved for backward,
        # which matters under activation checkpointing (a saved tensor there is recomputed).
        ctx.scale, ctx.dtype, ctx.device = scale, aux_loss.dtype, aux_loss.device
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=ctx.dtype, device=ctx.device), None


class MoEFeedForward(nn.Module):
    """A top-k softmax router over SwiGLU experts, with a capacity per expert and the balancing loss.

    The routing group is one sequence: each expert takes at most
    `cfg.expert_capacity(seq_len)` of a sequence's assignments (first choices of
    every token before second choices, then in token order, as GShard); the rest
    are dropped (those tokens skip that expert; the residual carries them). The
    balancing loss E·Σ_e f_e·P_e (f_e: share of the sequence's assignments that
    chose expert e, P_e: mean router probability of e) is also taken per sequence
    and averaged. Per sequence rather than per device batch (Switch's choice)
    because then routing, drops and the loss do not depend on how the batch is
    split over ranks or micro-batches: every layout trains the same model.

    The balancing loss is attached to the output (`AttachAuxLoss`): backward
    through this layer trains the router on it, with gradient `aux_grad_scale`.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        """Index of the block holding this FFN in the whole model (also inside a pipeline stage that holds a few)."""
        self.aux_grad_scale = 1.0
        """Gradient the balancing loss starts backward with: that of the training loss (see `set_moe_aux_grad_scale`)."""
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.hidden_dim)
        self.shared_expert = FeedForward(cfg) if cfg.shared_expert else None
        self.last_aux_loss: torch.Tensor | None = None
        """Balancing loss of the last forward, already times cfg.aux_loss_coef (a scalar with a graph)."""
        self.last_load: torch.Tensor | None = None
        """Assignments the router made to each expert in the last forward (n_experts,), dropped ones included."""
        self.last_dropped: torch.Tensor | None = None
        """Assignments dropped for lack of capacity in the last forward (a scalar count)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        n, k = self.cfg.n_experts, self.cfg.top_k
        # The router in fp32 whatever the autocast: softmax over experts and top-k are precision-sensitive.
        with torch.autocast(x.device.type, enabled=False):
            probs = F.linear(x.float(), self.router.weight.float()).softmax(dim=-1)  # (bsz, seq, n)
        weights, chosen = probs.topk(k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # Assignments slot-major within each sequence: every token's first choice ranks before any second choice.
        expert = chosen.transpose(1, 2).reshape(bsz, k * seq)
        weight = weights.transpose(1, 2).reshape(bsz, k * seq)
        token = torch.arange(bsz * seq, device=x.device).view(bsz, 1, seq).expand(bsz, k, seq).reshape(bsz, k * seq)
        onehot = F.one_hot(expert, n)  # (bsz, k·seq, n)
        position = ((onehot.cumsum(dim=1) - 1) * onehot).sum(dim=-1)  # place of each assignment in its expert's queue
        keep = position < self.cfg.expert_capacity(seq)

        per_seq = onehot.sum(dim=1)  # (bsz, n) assignments per expert per sequence
        f = per_seq.float() / (k * seq)
        self.last_aux_loss = self.cfg.aux_loss_coef * n * (f * probs.mean(dim=1)).sum(dim=-1).mean()
        self.last_load = per_seq.sum(dim=0).detach()
        self.last_dropped = (~keep).sum().detach()

        expert, weight, token = expert[keep], weight[keep], token[keep]
        order = torch.argsort(expert, stable=True)  # group the kept assignments by expert
        expert, weight, token = expert[order], weight[order], token[order]
        counts = torch.bincount(expert, minlength=n)
        flat = x.reshape(bsz * seq, dim)
        routed = self.experts(flat[token], counts)
        out = routed.new_zeros(flat.shape).index_add_(0, token, routed * weight.unsqueeze(-1).to(routed.dtype))
        out = out.view(bsz, seq, dim)
        out = out + self.shared_expert(x) if self.shared_expert is not None else out
        if torch.is_grad_enabled() and self.last_aux_loss.requires_grad:
            out = AttachAuxLoss.apply(out, self.last_aux_loss, self.aux_grad_scale)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MoEFeedForward(cfg, layer) if cfg.is_moe_layer(layer) else FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class KernelAttention(CausalAttention):
    """Causal attention through another kernel (`use_attention`): context parallel's ring exchange."""

    def __init__(self, kernel: AttentionKernel) -> None:
        super().__init__()
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.kernel(q, k, v, 1.0 / math.sqrt(q.shape[-1]))


class Transformer(CausalLM):
    """The built-in decoder, which implements the model protocol (`models/protocol.py`) itself: every block is
    called as `block(hidden, rope)`, with the rotary table of the positions the model is given."""

    lm_parts = Parts(embedding="tok_embeddings", blocks="layers", norm="norm", head="output")
    blocks_compile_whole = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: derived from the config, so checkpoints carry only trained state.
        self.register_buffer("rope", rotary_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        if not self.output.weight.is_meta:  # on the meta device nothing is drawn (models/init.py replays the draws)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers)."""
        for name, p in self.named_parameters():
            self.init_parameter(self.cfg, name, p)

    @staticmethod
    @torch.no_grad()
    def init_parameter(cfg: ModelConfig, name: str, p: torch.Tensor) -> None:
        """Parameter `name`'s initial value, drawn into `p` from the default generator (`init_weights`, one at a
        time: what building on the meta device replays)."""
        if p.dim() == 1:
            nn.init.ones_(p)
        elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))
        else:
            nn.init.normal_(p, std=0.02)

    # -- the model protocol -------------------------------------------------------------------------------
    def block_inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rotary table: row i for the i-th token the model is given."""
        return self.rope

    def call_block(self, block: nn.Module, hidden: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return block(hidden, rope)

    def set_positions(self, positions: torch.Tensor) -> None:
        """The rotary table's rows become those of `positions` (a table from position 0 already serves 0..n-1)."""
        super().set_positions(positions)
        if torch.equal(positions.cpu(), torch.arange(len(positions))) and len(positions) <= len(self.rope):
            return
        table = rotary_table(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta).to(self.rope.device)
        self.rope = table.index_select(0, positions.to(self.rope.device))

    @property
    def block_tp_plan(self) -> dict[str, str]:
        """Megatron's split of attention and the SwiGLU MLP; a mixture of experts has none (it stays whole)."""
        return {"attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
                "attention.wo": "rowwise", "feed_forward.w1": "colwise", "feed_forward.w3": "colwise",
                "feed_forward.w2": "rowwise"}

    def routed_experts(self) -> list[Experts]:
        return [Experts(f"layers.{key}.feed_forward.experts", int(key), self.cfg.n_experts, "sorted")
                for key in self.layers if self.cfg.is_moe_layer(int(key))]

    def use_attention(self, kernel: AttentionKernel) -> None:
        for module in self.modules():
            if isinstance(module, Attention):
                module.core = KernelAttention(kernel)

    def layout_support(self) -> dict[str, str | None]:
        support = super().layout_support()
        if self.cfg.n_experts:
            support["cp"] = MOE_WHOLE_SEQUENCES
        return support


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The full model, its initial weights a function of (cfg, seed) alone: every layout starts identical."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(cfg)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the autocast precision."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The mixture-of-experts FFNs of `model` (or of whatever wraps it), in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def set_moe_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """Make the balancing losses of `model`'s MoE FFNs start backward with gradient `scale`: the gradient the
    training loss starts with (loss scale / micro-batches when the loss is divided by them and scaled)."""
    for m in moe_layers(model):
        m.aux_grad_scale = float(scale)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the balancing losses of the last forward, to report; None for a dense model. Not to be added to the
    loss: each MoE FFN's output already carries its balancing loss into backward (`AttachAuxLoss`)."""
    losses = [m.last_aux_loss for m in moe_layers(model) if m.last_aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def moe_routing(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What the last forward's routers did: assignments per layer × expert (n_moe_layers, n_experts), and
    assignments dropped per layer (n_moe_layers,); None for a dense model."""
    layers = [m for m in moe_layers(model) if m.last_load is not None]
    if not layers:
        return None
    return torch.stack([m.last_load for m in layers]), torch.stack([m.last_dropped for m in layers])
