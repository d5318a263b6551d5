"""Adopting a module that was not written for the protocol: its class swapped for one with the protocol mixed in.

A Hugging Face model or a user's module keeps its own class, attributes and parameter names; its class becomes a
subclass of (the protocol's adapter, its own class), made once per class, as FSDP2's `fully_shard` does. So
`isinstance(model, LlamaForCausalLM)` still holds, every method the model's own code calls is still there, and the
adapter's `forward` (the protocol's: embedding, blocks, norm, head) is the one that runs.

Also here: what both adapters need of a module tree (paths of modules, a block list as a ModuleDict, a module's
parameters on the meta device).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

from workbench.models.protocol import CausalLM, Experts, Parts, Unsupported

_ADAPTED: dict[tuple[type, type], type] = {}


def adopt(module: nn.Module, adapter: type[CausalLM], parts: Parts) -> CausalLM:
    """Make `module` a `adapter` in place (its class swapped), its blocks a ModuleDict; returns it."""
    cls = type(module)
    if not isinstance(module, adapter):
        key = (adapter, cls)
        if key not in _ADAPTED:
            _ADAPTED[key] = type(f"{adapter.__name__}[{cls.__name__}]", (adapter, cls), {"__module__": cls.__module__})
        module.__class__ = _ADAPTED[key]
    module.lm_parts = parts
    as_module_dict(module, parts.blocks)
    return module


def as_module_dict(root: nn.Module, path: str) -> None:
    """Replace the ModuleList at `path` by a ModuleDict keyed "0", "1", ...: the same parameter names, and a pipeline
    chunk can then drop blocks and keep the others' global indices."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    blocks = parent._modules[name]
    if isinstance(blocks, nn.ModuleList):
        parent._modules[name] = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
    elif not isinstance(blocks, nn.ModuleDict):
        raise Unsupported(f"{path}: the blocks must be an nn.ModuleList or nn.ModuleDict, not "
                          f"{type(blocks).__name__}")


def path_of(root: nn.Module, target: nn.Module | None) -> str | None:
    """The path of `target` in `root`'s tree (its first), None if it is not there."""
    if target is None:
        return None
    return next((name for name, module in root.named_modules() if module is target), None)


def outside(root: nn.Module, blocks_path: str) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) of every module of `root` that is not a block nor inside one, the root excluded."""
    prefix = blocks_path + "."
    for name, module in root.named_modules():
        if name and name != blocks_path and not name.startswith(prefix):
            yield name, module


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered while this is active goes to the meta device (no memory); buffers stay where they
    are made. Buffers are derived from the config (rotary frequencies, scales), small, and needed as they are; the
    parameters are drawn later, one at a time, into each rank's own shard (`workbench.models.init`). A parameter
    made with torch.empty first costs no memory either: its pages are never touched before it moves."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and not param.is_meta:
            # nn.Parameter, not type(param): under FakeTensorMode (the tracer's) that type is a fake subclass.
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def direct_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A module's own parameters (not its children's)."""
    return [(name, p) for name, p in module._parameters.items() if p is not None]


def routed_experts(model: CausalLM) -> list[Experts]:
    """The experts modules (named "experts") in `model`'s blocks, which must follow transformers' convention:
    parameters stacked along dim 0 (`num_experts` of them), `forward(hidden, top_k_index, top_k_weights)`."""
    found = []
    for path, block in model.block_paths():
        for name, module in block.named_modules():
            if name.rpartition(".")[2] != "experts":
                continue
            where = f"{path}.{name}"
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                raise Unsupported(f"{where}: the experts are a list of modules the layer calls one by one, so expert "
                                  "parallel cannot send their tokens to other ranks (it needs stacked experts: 3-D "
                                  "weights called with the router's choices, transformers' convention)")
            n = getattr(module, "num_experts", None)
            routed = "top_k_index" in inspect.signature(module.forward).parameters
            stacked = bool(n) and all(p.dim() >= 2 and p.shape[0] == n for _, p in module.named_parameters())
            if not (routed and stacked):
                raise Unsupported(f"{where} ({type(module).__name__}) is not stacked experts (num_experts, parameters "
                                  "stacked along dim 0, forward(hidden, top_k_index, top_k_weights))")
            found.append(Experts(where, int(path.rpartition(".")[2]), n, "routed"))
    return found
