"""A model as the estimator sees it, traced: per block, its parameters, FLOPs, the bytes it saves for backward and
its matmuls' shapes, for one sequence at one length and precision (`ModelProfile`).

Pure values (no torch): the notebook's tracer (`workbench.tracing`) makes one by running the model once, forward
and backward, on fake tensors (nothing allocated), and the estimator (`workbench.estimate`, which imports no
torch) reads its figures where the built-in model's own formulas would stand. So any model the workbench can
build is estimated with the same sharding, recompute, schedule and link arithmetic as the built-in one.
"""

from __future__ import annotations

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
    gemms: tuple[Gemm, ...] = ()
    """Its linears, in the order they ran."""


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
