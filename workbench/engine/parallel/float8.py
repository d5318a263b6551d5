"""fp8 training (Config.precision "fp8_tensorwise" / "fp8_rowwise"): torchao's Float8 linear layers.

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
in fp8 (`enable_fsdp_float8_all_gather`: half of bf16's bytes), and after each
optimizer step one all-reduce computes every weight's next scale at once
(`precompute_float8_dynamic_scale_for_fsdp`), as torchtitan does. torchao's
rowwise recipe has no fp8 all-gather; its weights are gathered as they are.

torchao is an optional dependency (`pip install -e ".[fp8]"`, 3.4 MB, no
other dependencies): imported only when an fp8 precision is applied.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from workbench.config import FP8, Config
from workbench.models.protocol import CausalLM, Experts, Unsupported

MULTIPLE = 16
"""fp8 matmuls need both dimensions of a weight to be multiples of this."""


def apply_float8(model: CausalLM, cfg: Config) -> CausalLM:
    """Convert `model`'s linear layers to torchao Float8Linear, in place, when cfg.precision is an fp8 recipe."""
    if cfg.precision not in FP8:
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = cfg.precision.removeprefix("fp8_")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and cfg.zero >= 2:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    try:
        experts = model.routed_experts()
    except Unsupported:  # experts expert parallel cannot split: their whole blocks stay out of fp8
        experts = [Experts(path, int(path.rpartition(".")[2]), 0, "routed") for path, _ in model.block_paths()]
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: converts(module, fqn, model.lm_parts.head, experts))
    return model


def converts(module: nn.Module, fqn: str, head: str, experts: list[Experts]) -> bool:
    """Which linear layers run in fp8: not the output head, not a mixture of experts' experts nor its router (a
    linear layer beside them onto the experts), dims multiples of 16."""
    if not isinstance(module, nn.Linear) or fqn == head:
        return False
    for e in experts:
        beside = fqn.rpartition(".")[0] == e.path.rpartition(".")[0]
        if fqn.startswith(e.path + ".") or fqn == e.path or (beside and module.out_features == e.n_experts):
            return False
    return module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0


def after_optimizer_step(cfg: Config) -> Callable[[list[nn.Module]], None]:
    """What the trainer runs after each optimizer step: FSDP2's fp8 all-gather needs every weight's scale for
    the next step's gather, computed for all of them in one all-reduce; nothing otherwise."""
    if cfg.precision != "fp8_tensorwise" or cfg.zero < 2:
        return lambda modules: None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute(modules: list[nn.Module]) -> None:
        for module in modules:
            precompute_float8_dynamic_scale_for_fsdp(module)

    return precompute
