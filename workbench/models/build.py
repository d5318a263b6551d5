"""Any model source built on the meta device, with the values it starts from.

`build(source, seed)` gives the model (adapted to the protocol, every parameter on the meta device: nothing
allocated) and its `InitialValues`: the built-in model's exact replay, each module's seeded draw, or the source's
safetensors. The ranks lay the model out on the meta device and then fill only their own pieces
(`workbench.engine.materialize`); one process takes it whole with `build_whole`. The values build a pristine meta
model of their own when asked, so laying the model out never changes what they draw.
"""

from __future__ import annotations

import functools
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
    return Built(meta_model(source), initial_values(source, seed))


def meta_model(source: ModelSource) -> CausalLM:
    """`source`'s model adapted to the protocol, every parameter on the meta device, its buffers real."""
    if isinstance(source, ModelConfig):
        from workbench.models.transformer import Transformer

        with parameters_on_meta():
            return Transformer(source)
    if isinstance(source, HFModel):
        from workbench.models import huggingface

        return huggingface.build(source)
    if isinstance(source, CustomModel):
        from workbench.models import custom

        model = custom.build(source)
        if model._own("_init_weights") is None:  # refused now, not when a rank first draws that module
            for path, module in model.named_modules():
                if direct_parameters(module) and not hasattr(module, "reset_parameters"):
                    raise Unsupported(f"{path}: {type(module).__name__} holds parameters but has no reset_parameters()"
                                      ", so its initial values cannot be drawn on each rank apart. Fix: define "
                                      "reset_parameters() on it (torch's convention), or _init_weights(module) on "
                                      "the model")
        return model
    raise TypeError(f"not a model source: {type(source).__name__}")


def initial_values(source: ModelSource, seed: int) -> InitialValues:
    """Where `source`'s parameters start: the built-in model's replayed draws, the weights folder, or each module's
    draw by the model's own initialiser."""
    make = functools.partial(meta_model, source)
    if isinstance(source, ModelConfig):
        return BuiltinInit(make, seed)
    if isinstance(source, HFModel) and source.weights is not None:
        from workbench.models.weights import Weights

        return Weights(source.weights)
    if isinstance(source, HFModel):
        return ModuleInit(make, seed, _hf_initialiser, "the model's _init_weights")
    if isinstance(source, CustomModel):
        return ModuleInit(make, seed, _custom_initialiser, "the model's _init_weights or reset_parameters()")
    raise TypeError(f"not a model source: {type(source).__name__}")


def _hf_initialiser(model: nn.Module):
    def initialise(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            p.__dict__.pop("_is_hf_initialized", None)  # transformers skips a tensor it marked as done
        model._init_weights(module)

    return initialise


def _custom_initialiser(model: nn.Module):
    own = model._own("_init_weights")
    return own if own is not None else reset_parameters


def build_whole(source: ModelSource, seed: int, device: torch.device | str = "cpu") -> CausalLM:
    """`source`'s whole model on `device`, with its initial values (one process, no layout)."""
    built = build(source, seed)
    return materialize(built.model, built.values, device)


def parameter_count(model: nn.Module) -> int:
    """Parameters of `model`, a tied one once (on the meta device too)."""
    return sum(p.numel() for p in model.parameters())
