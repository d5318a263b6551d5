"""What a run holds tensors in and which kernels it runs, and the features of published runs this engine lacks.

`Features` are estimate-only options: a published setting the estimator models on request before the engine has
it (`wb.estimate(cfg, hw, features=Features(loss_parallel=True))`). What the engine runs itself is read from the
Config: torch.compile (`Config.compile`), Float8 linears (`Config.precision` "fp8_tensorwise"/"fp8_rowwise").
`Dtypes` is the byte size of each kind of tensor a layout makes, and the kernels that decide them.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import FP8, Config


@dataclass(frozen=True)
class Features:
    """Published-run settings beyond this engine, modelled by the estimator only (the engine refuses nothing
    here because it never sees them)."""

    compile_loss: bool = False
    """torch.compile of the loss too (torchtitan compiles it with the model since 2025; Config.compile compiles
    the blocks only): the cross-entropy fused into kernels that keep the logits and a log-sum-exp per token instead
    of fp32 log-probabilities."""
    float8_tp: bool = False
    """torchao Float8Linear on every block's linears under tensor parallel (torchao's Float8 tensor-parallel
    styles, which the engine does not wire: Config refuses fp8 with tp > 1). Modelled as precision
    "fp8_tensorwise": GEMMs at the fp8 peak, weights gathered in 1 byte, casts to fp8 around every GEMM."""
    loss_parallel: bool = False
    """tensor parallel keeps the logits split over the vocabulary for the loss (torchtitan's default with tp):
    no all-gather of the logits, each rank's loss tensors 1/tp of the vocabulary."""

    def describe(self) -> str:
        on = [name for name in ("compile_loss", "float8_tp", "loss_parallel") if getattr(self, name)]
        return "+".join(on) if on else "none"


NO_FEATURES = Features()


def fsdp_mixed_precision(cfg: Config) -> bool:
    """Whether FSDP2's MixedPrecisionPolicy casts the parameters for compute (bf16/fp16 under ZeRO 2/3 with
    Config.mixed_precision "fsdp"), instead of autocast casting them per use."""
    return cfg.mixed_precision == "fsdp"  # Config allows it only with bf16 (or fp8) under ZeRO 2/3


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each kind of tensor a layout makes on the device, and the kernels behind them."""

    compute: int
    """Matmul outputs and what attention and the MLP save: 2 under bf16/fp16 (and fp8's bf16), else 4."""
    residual: int
    """The residual stream between blocks (and what norms save of it): fp32 under autocast, whose embedding
    output is fp32 and whose residual adds promote; the parameters' dtype under FSDP mixed precision."""
    linear_input: int
    """What a linear layer saves of its input: the compute dtype; 1 byte with Float8 linears (their fp8 cast)."""
    gathered: int
    """Bytes per parameter FSDP2 all-gathers and holds unsharded: fp32 under autocast, the compute dtype under
    mixed precision, 1 with the float8 all-gather (tensorwise scaling)."""
    weight_copies: bool
    """Autocast keeps a 2-byte copy of every weight it casts, saved for backward, per micro-batch in flight."""
    mixed_precision: bool
    float8: bool = False
    """The blocks' linears are torchao Float8Linear: their GEMMs run at the fp8 rate on fp8 operands."""
    fused: bool = False
    """torch.compile (inductor) fuses each block's elementwise ops into few kernels (Config.compile)."""


def float8(cfg: Config, features: Features = NO_FEATURES) -> bool:
    """Whether the blocks' linears run as Float8 (an fp8 precision, or Features.float8_tp)."""
    return cfg.precision in FP8 or features.float8_tp


def dtypes(cfg: Config, features: Features = NO_FEATURES) -> Dtypes:
    low = cfg.precision in ("bf16", "fp16", *FP8)
    mp = fsdp_mixed_precision(cfg)
    a = 2 if low else 4
    f8 = float8(cfg, features)
    # torchao's float8 FSDP all-gather is the tensorwise recipe's (engine/parallel/float8.py).
    f8_gather = f8 and cfg.precision != "fp8_rowwise"
    return Dtypes(compute=a, residual=a if mp else 4, linear_input=1 if f8 else a,
                  gathered=1 if f8_gather else a if mp else 4,
                  weight_copies=low and not mp and not f8, mixed_precision=mp, float8=f8,
                  fused=cfg.compile and cfg.compile_backend == "inductor")
