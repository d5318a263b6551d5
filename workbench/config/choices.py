"""The allowed values of a Config's choice fields, and the one rule each shares between engine and estimator."""

from __future__ import annotations

from typing import Literal

from workbench.schedules.layout import Schedule  # noqa: F401 - the schedules name themselves

Recompute = Literal["none", "selective", "full", "op"]
MixedPrecision = Literal["autocast", "fsdp"]
Precision = Literal["fp32", "bf16", "fp16", "fp8_tensorwise", "fp8_rowwise", "mxfp8"]
FP8 = ("fp8_tensorwise", "fp8_rowwise", "mxfp8")
"""8-bit linears: torchao's Float8 recipes (a scale per tensor or per row; sm_89 and newer) and MXFP8 (OCP MX, a
scale per 32 elements; Blackwell, sm_100 and newer): the linear layers' matmuls in fp8, everything else in bf16."""
MX = ("mxfp8",)
"""The 8-bit recipes whose scales are per block of 32 (torchao's MX formats), which only Blackwell multiplies."""
CONVERTED_MULTIPLE = {"tensorwise": 16, "rowwise": 16, "mx": 32}
"""torchao's 8-bit linears need both dims of a weight to be multiples of this: 16 for fp8 matmuls, 32 for MX's
scale blocks along the reduction dim. The engine converts only such linears and leaves the others in bf16; the
estimator prices them so. NVFP4, an estimator option the engine does not run, converts every one."""


def low_precision_recipe(precision: str) -> str:
    """torchao's recipe of an 8-bit `precision`: "tensorwise", "rowwise" or "mx"; "" for any other."""
    if precision not in FP8:
        return ""
    return "mx" if precision in MX else precision.removeprefix("fp8_")


def converts(fan_in: int, fan_out: int, recipe: str) -> bool:
    """Whether a linear of these whole dims runs in `recipe`'s low precision (the engine's filter)."""
    multiple = CONVERTED_MULTIPLE.get(recipe, 1)
    return fan_in % multiple == 0 and fan_out % multiple == 0
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
