"""Where a model's parts are, for the tracer: its embedding, blocks, final norm, head and tensor-parallel plan.

Read through the model protocol (`workbench.models.protocol`: `lm_parts`, `block_modules`, `block_tp_plan`) when
the model implements it. Until every model does, two models are read by their known layout: the built-in
transformer (tok_embeddings, layers, norm, output, and engine/parallel/tensor.py's plan) and a Hugging Face causal
LM (its input and output embeddings, `model.layers`, `model.norm`, and its config's `base_model_tp_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

BUILTIN_PLAN = {"attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
                "attention.wo": "rowwise", "feed_forward.w1": "colwise", "feed_forward.w3": "colwise",
                "feed_forward.w2": "rowwise"}
"""The built-in block's tensor-parallel plan (engine/parallel/tensor.py's block_plan) in transformers' words."""
SPLIT_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "local_colwise", "local_rowwise",
                "packed_colwise", "packed_rowwise")
"""Plan styles whose module's weight tensor parallel splits (the others, "replicated_with_grad_allreduce",
"sequence_parallel", ..., keep it whole)."""


@dataclass(frozen=True)
class Parts:
    """A causal LM's parts, found in its module tree."""

    embedding: nn.Module | None
    blocks: tuple[tuple[str, nn.Module], ...]
    """(path from the root, block), in order."""
    norm: nn.Module | None
    head: nn.Module
    plan: dict[str, str]
    """The tensor-parallel plan of one block: {path inside a block, "*" for any one name: style}."""
    vocab_parallel: bool
    """Whether tensor parallel splits the embedding and head over the vocabulary."""

    @property
    def dim(self) -> int:
        return self.head.in_features

    @property
    def vocab_size(self) -> int:
        return self.head.out_features

    @staticmethod
    def logits(output: Any):
        """The logits of what the model's forward returns (a tensor, or transformers' output with `.logits`)."""
        return output.logits if hasattr(output, "logits") else output

    @classmethod
    def of(cls, model: nn.Module) -> Parts:
        """The parts of `model`, by the protocol where it has it; raises ValueError naming what is missing."""
        if hasattr(model, "lm_parts"):  # the model protocol
            plan = dict(getattr(model, "block_tp_plan", {}) or {})
            return cls(model.embedding_module, tuple(model.block_paths()), model.final_norm, model.output_head,
                       plan, bool(plan))
        if hasattr(model, "tok_embeddings") and hasattr(model, "layers"):  # the built-in transformer
            return cls(model.tok_embeddings, tuple((f"layers.{k}", b) for k, b in model.layers.items()),
                       model.norm, model.output, dict(BUILTIN_PLAN), True)
        if hasattr(model, "get_output_embeddings") and hasattr(getattr(model, "model", None), "layers"):
            inner = model.model
            prefix = "layers.*."
            plan = {k[len(prefix):]: v for k, v in (getattr(model.config, "base_model_tp_plan", None) or {}).items()
                    if k.startswith(prefix)}
            return cls(model.get_input_embeddings(), tuple((f"model.layers.{i}", b) for i, b in
                                                          enumerate(inner.layers)),
                       getattr(inner, "norm", None), model.get_output_embeddings(), plan, bool(plan))
        raise ValueError(f"{type(model).__name__}: cannot find its blocks, embedding, final norm and head; give it "
                         "the model protocol (workbench.models.protocol)")


def is_split(style: str | None) -> bool:
    return style in SPLIT_STYLES


def is_column(style: str | None) -> bool:
    return style is not None and "colwise" in style
