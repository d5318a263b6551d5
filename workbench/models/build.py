"""Any model source built on the meta device, with the values it starts from.

`build(source, seed)` gives the model (adapted to the protocol, every parameter on the meta device: nothing
allocated) and its `InitialValues`: the built-in model's exact replay, each module's seeded draw, or the source's
safetensors. The ranks lay the model out on the meta device and then fill only their own pieces
(`workbench.engine.materialize`); one process takes it whole with `build_whole`. The values read a pristine copy of
the meta model, so laying the model out never changes what they draw.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
import torch
from torch import nn

from workbench.config import CustomModel, HFModel, ModelConfig
from workbench.models.adapt import direct_parameters, parameters_on_meta
from workbench.models.init import BuiltinInit, InitialValues, ModuleInit, materialize, reset_parameters
from workbench.models.protocol import CausalLM, Unsupported

ModelSource = ModelConfig | HFModel | CustomModel


@dataclass
class Built:
    model: CausalLM
    """The model on the meta device (buffers real)."""
    values: InitialValues
    """Where its parameters' values come from."""


def build(source: ModelSource, seed: int) -> Built:
    """`source`'s model on the meta device and its initial values (module docstring)."""
    if isinstance(source, ModelConfig):
        from workbench.models.transformer import Transformer

        with parameters_on_meta():
            model = Transformer(source)
        return Built(model, BuiltinInit(copy.deepcopy(model), seed))
    if isinstance(source, HFModel):
        from workbench.models import huggingface

        model = huggingface.build(source)
        if source.weights is not None:
            from workbench.models.weights import Weights

            return Built(model, Weights(source.weights))
        return Built(model, ModuleInit(copy.deepcopy(model), seed, _hf_initialiser(model),
                                       "the model's _init_weights"))
    if isinstance(source, CustomModel):
        from workbench.models import custom

        model = custom.build(source)
        own = model._own("_init_weights")
        initialise = own if own is not None else reset_parameters
        how = "the model's _init_weights" if own is not None else "reset_parameters()"
        if own is None:  # refused now, not when a rank first draws that module
            for path, module in model.named_modules():
                if direct_parameters(module) and not hasattr(module, "reset_parameters"):
                    raise Unsupported(f"{path}: {type(module).__name__} holds parameters but has no reset_parameters()"
                                      ", so its initial values cannot be drawn on each rank apart. Fix: define "
                                      "reset_parameters() on it (torch's convention), or _init_weights(module) on "
                                      "the model")
        return Built(model, ModuleInit(copy.deepcopy(model), seed, initialise, how))
    raise TypeError(f"not a model source: {type(source).__name__}")


def _hf_initialiser(model: nn.Module):
    def initialise(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            p.__dict__.pop("_is_hf_initialized", None)  # transformers skips a tensor it marked as done
        model._init_weights(module)

    return initialise


def build_whole(source: ModelSource, seed: int, device: torch.device | str = "cpu") -> CausalLM:
    """`source`'s whole model on `device`, with its initial values (one process, no layout)."""
    built = build(source, seed)
    return materialize(built.model, built.values, device)


def parameter_count(model: nn.Module) -> int:
    """Parameters of `model`, a tied one once (on the meta device too)."""
    return sum(p.numel() for p in model.parameters())
