"""8-bit training (Config.precision "fp8_tensorwise" / "fp8_rowwise" / "mxfp8"): torchao's low-precision linears.

`convert_to_float8_training` swaps each nn.Linear of the bare model for
torchao's Float8Linear, whose matmuls cast their inputs, weights and output
gradients to float8 (e4m3) with dynamic scales, one per tensor ("tensorwise")
or per row ("rowwise", more accurate, a little slower), and run on the GPU's fp8
units (torch._scaled_mm: compute capability 8.9 or newer; `Config.check_device`
refuses others). Everything else runs in bf16 autocast (engine/precision.py).

Not converted: the output head (its logits feed the loss, torchtitan keeps it
in high precision), a mixture of experts' experts and router (their matmuls are
batched per expert, not nn.Linear), and layers whose dimensions are not
multiples of 16 (what fp8 matmuls need).

With FSDP2 (zero 2/3) and the tensorwise recipe, the weights are all-gathered
in fp8 unless Config.fp8_all_gather is False (`enable_fsdp_float8_all_gather`:
half of bf16's bytes), and after each optimizer step one all-reduce computes
every weight's next scale at once (`precompute_float8_dynamic_scale_for_fsdp`),
as torchtitan does. torchao's rowwise recipe has no fp8 all-gather; its weights
are gathered as they are. Under tensor parallel the tensorwise linears take
torchao's Float8 styles (parallel/tensor.py).

"mxfp8" swaps the same linears for torchao's MXLinear (`quantize_` with the
"mxfp8_cublas" MXLinearConfig, as torchtitan's MX converter): each operand cast
to float8 e4m3 with one e8m0 scale per 32 elements, along the reduction dim of
each of the three matmuls, multiplied by cuBLAS's block-scaled kernels, which
only Blackwell (compute capability 10.0) has; its communication stays in bf16.

torchao is an optional dependency (`pip install -e ".[fp8]"`, 3.4 MB, no
other dependencies): imported only when an fp8 precision is applied.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from workbench.config import FP8, MX, Config, low_precision_recipe
from workbench.config import converts as converts_dims
from workbench.models.protocol import CausalLM, Experts, Unsupported

MX_RECIPE = "mxfp8_cublas"
"""torchao's MX recipe for precision "mxfp8": e4m3 elements, e8m0 scales per 32, cuBLAS's kernels (torchtitan's
"mxfp8")."""


def apply_float8(model: CausalLM, cfg: Config) -> CausalLM:
    """Convert `model`'s linear layers to torchao Float8Linear (MXLinear for "mxfp8"), in place, when
    cfg.precision is an 8-bit recipe."""
    if cfg.precision not in FP8:
        return model
    try:
        experts = model.routed_experts()
    except Unsupported:  # experts expert parallel cannot split: their whole blocks stay out of fp8
        experts = [Experts(path, int(path.rpartition(".")[2]), 0, "routed") for path, _ in model.block_paths()]
    head, recipe = model.lm_parts.head, low_precision_recipe(cfg.precision)
    if cfg.precision in MX:
        from torchao.prototype.mx_formats.config import MXLinearConfig
        from torchao.quantization import quantize_

        quantize_(model, config=MXLinearConfig.from_recipe_name(MX_RECIPE),
                  filter_fn=lambda module, fqn: converts(module, fqn, head, experts, recipe))
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fp8_all_gather(cfg):
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: converts(module, fqn, head, experts, recipe))
    return model


def fp8_all_gather(cfg: Config) -> bool:
    """Whether FSDP2 gathers the Float8 weights in fp8: tensorwise scales, zero 2/3, Config.fp8_all_gather."""
    return cfg.precision == "fp8_tensorwise" and cfg.zero >= 2 and cfg.fp8_all_gather


def converts(module: nn.Module, fqn: str, head: str, experts: list[Experts], recipe: str) -> bool:
    """Which linear layers run in 8 bits: not the output head, not a mixture of experts' experts nor its router (a
    linear layer beside them onto the experts), dims the recipe's multiples (config's `CONVERTED_MULTIPLE`: 16 for
    Float8, 32 for MX)."""
    if not isinstance(module, nn.Linear) or fqn == head:
        return False
    for e in experts:
        beside = fqn.rpartition(".")[0] == e.path.rpartition(".")[0]
        if fqn.startswith(e.path + ".") or fqn == e.path or (beside and module.out_features == e.n_experts):
            return False
    return converts_dims(module.in_features, module.out_features, recipe)


def after_optimizer_step(cfg: Config) -> Callable[[list[nn.Module]], None]:
    """What the trainer runs after each optimizer step: FSDP2's fp8 all-gather needs every weight's scale for
    the next step's gather, computed for all of them in one all-reduce; nothing otherwise."""
    if not fp8_all_gather(cfg):
        return lambda modules: None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute(modules: list[nn.Module]) -> None:
        for module in modules:
            precompute_float8_dynamic_scale_for_fsdp(module)

    return precompute
