"""The allowed values of a Config's choice fields, and the one rule each shares between engine and estimator."""

from __future__ import annotations

from typing import Literal

from workbench.schedules.layout import Schedule  # noqa: F401 - the schedules name themselves

Recompute = Literal["none", "selective", "full", "op"]
MixedPrecision = Literal["autocast", "fsdp"]
Precision = Literal["fp32", "bf16", "fp16", "fp8_tensorwise", "fp8_rowwise"]
FP8 = ("fp8_tensorwise", "fp8_rowwise")
"""torchao's Float8 training recipes: the linear layers' matmuls in fp8, everything else in bf16 autocast."""
Compression = Literal["none", "fp16", "bf16", "powersgd", "int8", "1bit"]
Optimizer = Literal["adamw", "lion", "sgd"]
CompileBackend = Literal["inductor", "aot_eager"]
ExpertExchange = Literal["flat", "hierarchical"]
ZERO_STAGES = (0, 1, 2, 3)


def checkpointed_blocks(block_indices: list[int], mode: Recompute) -> list[int]:
    """Which of the given global block indices recompute their activations under `mode`.

    The one rule, used by the engine (which blocks it wraps) and the estimator (what they keep).
    """
    if mode == "full":
        return list(block_indices)
    if mode == "selective":
        # By global index, so a pipeline split recomputes the same blocks as the whole model.
        return [i for i in block_indices if i % 2 == 0]
    return []  # "op" recomputes inside every block, op by op, and checkpoints none of them whole
