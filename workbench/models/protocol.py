"""The model protocol: what the engine (and the estimator's tracer) need to know of a causal language model.

A model the workbench trains maps token ids (batch, seq) to logits (batch, seq, vocab) through four parts, each
found by its path in the module tree (`Parts`, the model's `lm_parts`):

    embedding   token ids → hidden states (batch, seq, dim)                      first pipeline stage
    blocks      an nn.ModuleDict of the decoder blocks, keyed by their index in
                the whole model ("0", "1", ...), run in key order; each maps
                hidden states to hidden states of the same shape                 split over the stages
    norm        the final norm, hidden → hidden; None when the model has none   last stage
    head        hidden states → logits                                           last stage

They are read as `embedding_module`, `block_modules`, `final_norm` and `output_head`.

How one block is called. What every block needs besides the hidden states (a rotary table or its cos/sin, position
ids, attention masks) is computed once per forward, `inputs = model.block_inputs(hidden)`, and each block then runs
as `hidden = model.call_block(block, hidden, inputs)`. Both read the positions in the sequence of the tokens the
model is given: 0..seq-1 unless `set_positions` said otherwise (`token_positions`). Context parallel gives each
rank its own, non-contiguous positions; under sequence parallel a block's input holds a slice of the tokens, so the
positions, not the hidden states' length, say how long the sequence is. `forward` is exactly

    h = embedding(tokens) if embedding else tokens
    inputs = block_inputs(h)
    for block in blocks.values(): h = call_block(block, h, inputs)
    h = norm(h) if norm else h
    return head(h) if head else h

A pipeline chunk is the model with the blocks it does not hold deleted and the parts it does not hold set to None
(`chunk`): its forward then takes hidden states instead of token ids, or returns hidden states instead of logits,
and its parameters keep the whole model's names, so a checkpoint written by any layout loads into any other.

What the parallel layouts read besides the parts:
    block_tp_plan     {path of a module inside a block, "*" for any one name: style}: the tensor-parallel plan in
                      transformers' vocabulary ("colwise", "rowwise", "replicated_with_grad_allreduce", ...); empty
                      when the model has none (tensor parallel is then refused, naming the model)
    routed_experts()  each mixture-of-experts layer's routed experts, and how they are called (`Experts`)
    use_attention()   route every attention of the model through a kernel (context parallel's ring)
    layout_support()  per layout choice, None where the model supports it, else why not (the dashboard shows it)
A model that cannot do something says so by raising `Unsupported`, naming the module and the reason, before any
rank builds it.

The names are distinctive on purpose: an adapted model is the user's own module given this class as a mixin (its
class is swapped, so its parameter names stay its own), and "blocks", "head" or "norm" are often already the names
of its children.

The model code holds no distribution code: the layouts live in `workbench.engine.parallel` and reach the model only
through this protocol, so each is written once for every family. Adapters: the built-in transformer
(`transformer.py`) implements it directly; Hugging Face causal LMs and a user's own module are adapted to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from workbench.config.support import AXES, DENSE, ONE_BLOCK  # the reasons, shared with the built-in's facts


class Unsupported(ValueError):
    """The model cannot be laid out the way asked; the message names the module (or the model) and the reason."""


@dataclass(frozen=True)
class Parts:
    """Paths of a causal LM's parts in its module tree ("model.layers"), from its root."""

    embedding: str
    """Token ids → hidden states (an nn.Embedding or a subclass)."""
    blocks: str
    """The decoder blocks: an nn.ModuleDict keyed by index (adapters turn an nn.ModuleList into one; same names)."""
    norm: str | None
    """The final norm; None when the model has none."""
    head: str
    """Hidden states → logits (an nn.Linear)."""


@dataclass(frozen=True)
class Experts:
    """One mixture-of-experts layer's routed experts: every parameter stacks the experts along dim 0."""

    path: str
    """The experts module's path from the model's root."""
    layer: int
    """Index of the block that holds it."""
    n_experts: int
    call: Literal["sorted", "routed"]
    """How the layer calls them: "sorted" `experts(tokens sorted by expert, counts per expert)` → outputs in the same
    order (the built-in model); "routed" `experts(hidden (tokens, dim), top_k_index, top_k_weights)` → the weighted
    sum per token (transformers' experts convention)."""


AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""Causal attention of q (batch, heads, seq, head_dim) to k, v (batch, kv_heads, seq, head_dim) with softmax scale
`scale`, → (batch, heads, seq, head_dim): what `use_attention` routes every attention of a model through."""


class CausalLM(nn.Module):
    """The protocol (see the module docstring). Subclasses say where their parts are and how a block is called."""

    lm_parts: Parts
    wb_positions: torch.Tensor | None = None
    """Positions of the tokens the model is given (1-D); None: 0..seq-1 of the input's length."""
    blocks_compile_whole: bool = False
    """Whether each dense block compiles to one graph (torch.compile's fullgraph): the built-in's do; another
    family's blocks may break the graph where dynamo cannot follow them, which then runs eagerly."""

    # -- the parts -------------------------------------------------------------------------------------------
    def part(self, path: str | None) -> nn.Module | None:
        """The module at `path`, None where the path is None or a chunk dropped the part."""
        if path is None:
            return None
        module: nn.Module | None = self
        for name in path.split("."):
            module = module._modules.get(name) if module is not None else None
        return module

    @property
    def embedding_module(self) -> nn.Module | None:
        return self.part(self.lm_parts.embedding)

    @property
    def block_modules(self) -> nn.ModuleDict:
        return self.part(self.lm_parts.blocks)

    @property
    def final_norm(self) -> nn.Module | None:
        return self.part(self.lm_parts.norm)

    @property
    def output_head(self) -> nn.Module | None:
        return self.part(self.lm_parts.head)

    def block_paths(self) -> Iterator[tuple[str, nn.Module]]:
        """(path from the root, block) for each block this model (or chunk) holds, in order."""
        for key, block in self.block_modules.items():
            yield f"{self.lm_parts.blocks}.{key}", block

    # -- calling ---------------------------------------------------------------------------------------------
    def token_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The positions of a sequence of `length` tokens given to this model: `positions`, else 0..length-1."""
        if self.wb_positions is not None:
            return self.wb_positions.to(device)
        return torch.arange(length, device=device)

    def block_inputs(self, hidden: torch.Tensor) -> Any:
        """What every block needs besides the hidden states, computed once per forward from the positions."""
        return None

    def call_block(self, block: nn.Module, hidden: torch.Tensor, inputs: Any) -> torch.Tensor:
        """One block: hidden states → hidden states."""
        return block(hidden)

    def set_positions(self, positions: torch.Tensor) -> None:
        """From now on the model is given the tokens at `positions` (1-D) of each sequence."""
        self.wb_positions = positions

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) → logits (batch, seq, vocab); a pipeline chunk maps hidden states in or out."""
        embedding, norm, head = self.embedding_module, self.final_norm, self.output_head
        hidden = embedding(tokens) if embedding is not None else tokens
        inputs = self.block_inputs(hidden)
        for block in self.block_modules.values():
            hidden = self.call_block(block, hidden, inputs)
        if norm is not None:
            hidden = norm(hidden)
        return head(hidden) if head is not None else hidden

    # -- what the layouts read -------------------------------------------------------------------------------
    @property
    def block_tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan of one block ({"self_attn.q_proj": "colwise", ...}); empty: none."""
        return {}

    def routed_experts(self) -> list[Experts]:
        """The routed experts of every mixture-of-experts layer this model (or chunk) holds; [] for a dense model.
        Raises `Unsupported` for a mixture of experts whose experts are not stacked tensors."""
        return []

    def use_attention(self, kernel: AttentionKernel) -> None:
        """Route every causal attention of the model through `kernel`; raises `Unsupported` saying why not."""
        raise Unsupported(f"{type(self).__name__}: its attention cannot be reached, so context parallel cannot "
                          "replace it")

    def layout_support(self) -> dict[str, str | None]:
        """Per layout choice (`AXES`): None where the model supports it, else the reason it does not."""
        out: dict[str, str | None] = dict.fromkeys(AXES)
        if not self.block_tp_plan:
            out["tp"] = f"{type(self).__name__} has no tensor-parallel plan: pass one (plan={{...}})"
        try:
            if not self.routed_experts():
                out["ep"] = DENSE
        except Unsupported as e:
            out["ep"] = str(e)
        if len(self.block_modules) < 2:
            out["pp"] = ONE_BLOCK
        return out


def chunk(model: CausalLM, keep: range, *, first: bool, last: bool) -> CausalLM:
    """A copy of `model` holding only the blocks whose index is in `keep`, plus the embedding if `first` and the norm
    and head if `last` (a pipeline stage's model). Works on the meta device: the dropped parts are never copied
    (deepcopy's memo maps each of them to None), so the copy costs only what it keeps."""
    import copy

    dropped: list[nn.Module | None] = [b for key, b in model.block_modules.items() if int(key) not in keep]
    if not first:
        dropped.append(model.embedding_module)
    if not last:
        dropped += [model.final_norm, model.output_head]
    piece = copy.deepcopy(model, {id(m): None for m in dropped if m is not None})
    blocks = piece.block_modules
    for key in [key for key, block in blocks.items() if block is None]:
        del blocks[key]
    return piece
