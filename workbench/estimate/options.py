"""What a run holds tensors in, and the features of published runs this engine does not run yet.

`Features` are estimate-only options: a published setting (torch.compile, Float8 linears, loss parallel) the
estimator models on request before the engine has it (`wb.estimate(cfg, hw, features=Features(compile=True))`).
`Dtypes` is the byte size of each kind of tensor a layout makes, from the Config and the features.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import Config


@dataclass(frozen=True)
class Features:
    """Published-run settings beyond this engine, modelled by the estimator only (the engine refuses nothing
    here because it never sees them)."""

    compile: bool = False
    """torch.compile of every block, as torchtitan's apply_compile: each block's elementwise ops fused into few
    kernels (the loss stays eager, as torchtitan leaves it)."""
    compile_loss: bool = False
    """torch.compile of the loss too (torchtitan compiles it with the model since 2025): the cross-entropy fused
    into kernels that keep the logits and a log-sum-exp per token instead of fp32 log-probabilities."""
    float8: bool = False
    """torchao Float8Linear on every block's linears (dynamic tensorwise scaling, the float8 FSDP all-gather):
    their GEMMs at the fp8 peak, weights gathered in 1 byte, casts to fp8 around every GEMM."""
    loss_parallel: bool = False
    """tensor parallel keeps the logits split over the vocabulary for the loss (torchtitan's default with tp):
    no all-gather of the logits, each rank's loss tensors 1/tp of the vocabulary."""

    def describe(self) -> str:
        on = [name for name in ("compile", "compile_loss", "float8", "loss_parallel") if getattr(self, name)]
        return "+".join(on) if on else "none"


NO_FEATURES = Features()


def fsdp_mixed_precision(cfg: Config) -> bool:
    """Whether FSDP2's MixedPrecisionPolicy casts the parameters for compute (bf16/fp16 under ZeRO 2/3 with
    Config.mixed_precision "fsdp"), instead of autocast casting them per use."""
    return cfg.mixed_precision == "fsdp"  # Config allows it only with bf16 under ZeRO 2/3


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each kind of tensor a layout makes on the device."""

    compute: int
    """Matmul outputs and what attention and the MLP save: 2 under bf16/fp16, else 4."""
    residual: int
    """The residual stream between blocks (and what norms save of it): fp32 under autocast, whose embedding
    output is fp32 and whose residual adds promote; the parameters' dtype under FSDP mixed precision."""
    linear_input: int
    """What a linear layer saves of its input: the compute dtype; 1 byte with Float8 linears (their fp8 cast)."""
    gathered: int
    """Bytes per parameter FSDP2 all-gathers and holds unsharded: fp32 under autocast, the compute dtype under
    mixed precision, 1 with the float8 all-gather (block matrices)."""
    weight_copies: bool
    """Autocast keeps a 2-byte copy of every weight it casts, saved for backward, per micro-batch in flight."""
    mixed_precision: bool


def dtypes(cfg: Config, features: Features = NO_FEATURES) -> Dtypes:
    low = cfg.precision in ("bf16", "fp16")
    mp = fsdp_mixed_precision(cfg)
    a = 2 if low else 4
    return Dtypes(compute=a, residual=a if mp else 4, linear_input=1 if features.float8 else a,
                  gathered=(1 if features.float8 else a) if mp else 4,
                  weight_copies=low and not mp and not features.float8, mixed_precision=mp)
