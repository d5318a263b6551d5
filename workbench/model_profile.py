"""A model as the estimator sees it, traced: per block, its parameters, FLOPs, the bytes it saves for backward and
its matmuls' shapes, for one sequence at one length and precision (`ModelProfile`).

Pure values (no torch): the notebook's tracer (`workbench.tracing`) makes one by running the model once, forward
and backward, on fake tensors (nothing allocated), and the estimator (`workbench.estimate`, which imports no
torch) reads its figures where the built-in model's own formulas would stand. So any model the workbench can
build is estimated with the same sharding, recompute, schedule and link arithmetic as the built-in one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Gemm:
    """A forward matmul of one sequence: (tokens, k) × (k, n), `count` times, as the GPU kernel model prices it."""

    n: int
    k: int
    count: int = 1
    split: str | None = None
    """How tensor parallel splits it (the module's style in the plan): "column" (n ÷ tp), "row" (k ÷ tp), or None
    (whole on every tp rank)."""

    def fans(self, tp: int) -> tuple[int, int]:
        """(fan_in, fan_out) on one tp rank."""
        if self.split == "column":
            return self.k, -(-self.n // tp)
        if self.split == "row":
            return -(-self.k // tp), self.n
        return self.k, self.n


@dataclass(frozen=True)
class BlockProfile:
    """One kind of block: what one of them holds and does for one sequence of `ModelProfile.seq_len` tokens."""

    params: int
    """Parameter elements."""
    split_params: int
    """Of which tensor parallel splits (the weights of modules in the plan)."""
    expert_params: int
    """Of which are routed experts (stacked per expert: what expert parallel splits; whole on every tp rank)."""
    tensors: int
    """Parameter tensors."""
    forward_flops: float
    backward_flops: float
    replicated_flops: float
    """Of forward + backward, what runs whole on every tp rank (a mixture-of-experts FFN)."""
    replicated_forward_flops: float
    saved_bytes: int
    """Bytes saved for backward by one sequence (parameters and the model's buffers excluded; each storage once)."""
    gathered_bytes: int
    """Of which: inputs of column-parallel matmuls, saved whole under sequence parallel (the rest is ÷tp)."""
    weight_copies: int
    """Of which: low-precision copies of its weights under autocast (once per micro-batch, not per token)."""
    replicated_bytes: int = 0
    """Of which: what its mixture of experts saves, weight copies aside (whole on every tp rank, as the FFN runs)."""
    whole_copies: int = 0
    """Of the weight copies: its mixture of experts' (whole on every tp rank; the experts' ÷ep)."""
    gemms: tuple[Gemm, ...] = ()
    """Its linears, in the order they ran."""
    attention_flops: float = 0.0
    """Forward FLOPs of its attention (q·kᵀ and p·v over the whole square, every query head), one sequence: what
    context parallel's ring hides its exchange behind. 0 where the model's attention cannot be reached."""
    kv_width: int = 0
    """Key and value elements per token its attention reads (kv heads × head dim, keys plus values), as the model
    hands them to its attention kernel: what context parallel's ring passes round the cp ranks."""
    heads: int = 0
    """Query heads of its attention, as handed to the kernel (0 where it cannot be reached)."""
    kv_heads: int = 0
    """Key/value heads (fewer than `heads` under grouped-query attention)."""
    head_dim: int = 0
    """Width of one head."""
    experts: int = 0
    """Routed experts of its mixture of experts (0: a dense block)."""
    top_k: int = 0
    """Experts each token is routed to (transformers' routing keeps every assignment: no capacity)."""
    op_kept_bytes: int = 0
    """Bytes the per-op recompute policy (Config.activation_checkpointing="op") keeps of its forward, one sequence:
    the outputs of every other matmul and of attention; its input aside."""
    op_whole_bytes: int = 0
    """Of which: outputs of matmuls tensor parallel does not split by columns (whole on every tp rank)."""
    op_recomputed_flops: float = 0.0
    """Forward FLOPs of the matmuls that policy recomputes in backward (every other one), one sequence."""
    op_recomputed_whole_flops: float = 0.0
    """Of which: matmuls of modules tensor parallel does not split (run whole on every tp rank)."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Its parameters' shapes, in order (what PowerSGD compresses matrix by matrix)."""


@dataclass(frozen=True)
class TracedShape:
    """A traced model's shape under the built-in `ModelConfig`'s names, for the estimator's formulas that read a
    shape (the GPU model's fused kernels, by their sizes): what the trace saw, not what a config says."""

    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int
    head_dim: int
    hidden_dim: int
    """The dense FFN's width (a mixture of experts': one expert's)."""
    vocab_size: int
    n_experts: int
    top_k: int
    moe: tuple[bool, ...]
    """Per block, whether its FFN is a mixture of experts."""
    shared_expert: bool = False
    """Not traced: a shared expert's linears are counted with the block's own."""

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe[layer]

    def expert_capacity(self, seq_len: int) -> int:
        """Every assignment is kept (transformers' routers drop none): a whole sequence's, top_k each."""
        return seq_len * self.top_k


@dataclass(frozen=True)
class ModelProfile:
    """A model traced at one sequence length and precision: its blocks and what lies around them."""

    name: str
    seq_len: int
    precision: str
    """"fp32"; "low", traced under bf16 autocast (what bf16, fp16 and fp8's bf16 save); "bf16_params", bf16
    parameters without autocast (FSDP2's mixed precision)."""
    dim: int
    """Width of the residual stream (the embedding's output)."""
    vocab_size: int
    """Columns of the head's output (its logits)."""
    kinds: tuple[BlockProfile, ...]
    """The distinct blocks."""
    blocks: tuple[int, ...]
    """Each block's kind (an index into `kinds`), in order."""
    embedding_params: int
    norm_params: int
    head_params: int
    """The head's own parameters: 0 when it is tied to the embedding."""
    head_split: bool
    """Whether tensor parallel splits the embedding and head (vocab-parallel)."""
    head_forward_flops: float
    head_backward_flops: float
    """The head and the loss, one sequence (the final norm's FLOPs are negligible and counted here too)."""
    first_saved: int
    """Saved for backward outside the blocks on the first stage (the embedding: its token ids), one sequence."""
    shared_saved: int
    """Saved by the blocks of what the model makes once per forward between its parts (rotary cos/sin, attention
    masks): once per micro-batch, whatever its number of sequences, on every pipeline stage whose blocks save
    anything of its own."""
    shared_handed: int
    """Of what the model makes once per forward between its parts, the tensors its blocks are handed as positional
    arguments (bytes, once per micro-batch): what a stage keeps of them where every block recomputes (non-reentrant
    checkpointing saves a block's positional inputs, not its keyword ones)."""
    last_saved: int
    """Saved on the last stage (final norm, head input, log-probabilities, targets), one sequence."""
    last_sharded: int
    """Of which the final norm's, sequence-sharded under tensor parallel."""
    last_copies: int
    """Of which the head's weight copy under autocast (once per micro-batch)."""
    params: int
    """Every parameter element, a tied weight once: the model's numel."""
    trace_s: float = 0.0
    """What the trace cost (s): building the model on fake tensors and one forward and backward."""

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    def block(self, layer: int) -> BlockProfile:
        return self.kinds[self.blocks[layer]]

    @functools.cached_property
    def shape(self) -> TracedShape:
        """The traced model under the built-in shape's names (`TracedShape`)."""
        attention = next((b for b in self.kinds if b.heads), None)
        moe = next((b for b in self.kinds if b.experts), None)
        dense = next((b for b in self.kinds if not b.experts), None)
        return TracedShape(
            dim=self.dim, n_layers=self.n_layers, vocab_size=self.vocab_size,
            n_heads=attention.heads if attention else 0, kv_heads=attention.kv_heads if attention else 0,
            head_dim=attention.head_dim if attention else 0,
            hidden_dim=_expert_width(moe, self.dim) if dense is None else _ffn_width(dense),
            n_experts=moe.experts if moe else 0, top_k=moe.top_k if moe else 0,
            moe=tuple(bool(self.block(i).expert_params) for i in range(self.n_layers)))

    @property
    def model_flops(self) -> float:
        """Model FLOPs of one sequence (what MFU divides by): every block's forward and backward once, the head's,
        no recomputation."""
        blocks = sum(self.block(i).forward_flops + self.block(i).backward_flops for i in range(self.n_layers))
        return blocks + self.head_forward_flops + self.head_backward_flops

    def per_token(self, figure: float) -> float:
        """A per-sequence figure per token."""
        return figure / self.seq_len

    def stage_params(self, layers: tuple[int, ...], first: bool, last: bool, tp: int, ep: int) -> int:
        """Parameter elements one rank holds for these blocks (and the embedding, norm and head where it holds
        them) after tensor parallel (the plan's weights ÷tp) and expert parallel (routed experts ÷ep). A tied head
        holds nothing of its own (tied models keep embedding and head on one stage)."""
        head_tp = tp if self.head_split else 1
        root = first * -(-self.embedding_params // head_tp) + last * (self.norm_params
                                                                      + -(-self.head_params // head_tp))
        return sum(self.block_params(i, tp, ep) for i in layers) + root

    def block_params(self, layer: int, tp: int = 1, ep: int = 1) -> int:
        """Parameter elements of block `layer` on one rank: the plan's weights ÷tp, routed experts ÷ep."""
        b = self.block(layer)
        return (b.params - b.split_params - b.expert_params) + -(-b.split_params // tp) + b.expert_params // ep


def _ffn_width(block: BlockProfile) -> int:
    """A dense block's FFN width: the input width of its last row-parallel linear (the FFN's down projection runs
    last in a decoder block), else its widest linear."""
    rows = [g.k for g in block.gemms if g.split == "row"]
    return rows[-1] if rows else max((g.n for g in block.gemms), default=0)


def _expert_width(block: BlockProfile | None, dim: int) -> int:
    """One routed expert's width: the narrowest side of its stacked weights other than the model's width."""
    if block is None:
        return 0
    sides = [side for shape in block.shapes if len(shape) == 3 for side in shape[1:] if side != dim]
    return min(sides, default=0)
