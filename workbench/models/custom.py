"""A user's own nn.Module, adapted to the model protocol: `CustomModel("package.module:factory", plan=..., parts=...)`.

The factory is imported and called with the source's keyword arguments (on the ranks: the notebook's folder is on
their path), its parameters on the meta device. Its parts are those `parts=` names, else found in its module tree:
- blocks: the nn.ModuleList (or ModuleDict) of modules of one class holding the most parameters;
- embedding: the one nn.Embedding outside the blocks;
- head: the last nn.Linear outside the blocks (registration order) whose outputs are the vocabulary;
- norm: the one module outside the blocks, after them, whose parameters are all vectors; none is fine.
What cannot be found is refused, naming it and how to name it.

How a block is called: `block(hidden)`, or, when the module defines `block_inputs(self, hidden)`, with what that
returns (a tensor: one more positional argument; a tuple: several; a dict: keyword arguments). It should read
`self.token_positions(seq_len, device)` for the positions it is given. A module may define `call_block(self,
block, hidden, inputs)` instead, for anything else.

Its initial values: its own `_init_weights(module)` per module when it has one (transformers' and nanoGPT's
convention), else each module's `reset_parameters()` (torch's); `workbench.models.init` says how. Its attention,
for context parallel: its `use_attention(kernel)` when it defines one, else every causal
`F.scaled_dot_product_attention` call inside its blocks goes through the kernel (`route_sdpa`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from workbench.config.sources import CustomModel
from workbench.models.adapt import adopt, outside, parameters_on_meta, routed_experts
from workbench.models.protocol import AttentionKernel, CausalLM, Experts, Parts, Unsupported
from workbench.models.sdpa import route_sdpa
from workbench.models.tp import matching


def load_factory(path: str) -> Any:
    """The callable at "package.module:name", refused by name when it cannot be imported."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise Unsupported(f"CustomModel({path!r}): cannot import {module_name!r} ({e}); the module must be importable "
                          "on the ranks (the notebook's folder is on their path)") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise Unsupported(f"CustomModel({path!r}): {module_name} has no callable {attr!r}")
    return factory


def build(source: CustomModel) -> CustomCausalLM:
    """The module the factory returns, adapted to the protocol, its parameters on the meta device."""
    factory = load_factory(source.factory)
    with parameters_on_meta():
        module = factory(**source.kwargs)
    if not isinstance(module, nn.Module):
        raise Unsupported(f"CustomModel({source.factory!r}) returned a {type(module).__name__}, not an nn.Module")
    parts = find_parts(module, dict(source.parts), source.factory)
    model = adopt(module, CustomCausalLM, parts)
    model.wb_plan = dict(source.plan)
    return model


def find_parts(module: nn.Module, named: dict[str, str | None], what: str) -> Parts:
    """The parts `named` gives, the rest found (module docstring); refused naming what is missing."""
    for part, path in named.items():
        if path is not None and _get(module, path) is None:
            raise Unsupported(f"CustomModel({what!r}): parts[{part!r}]={path!r} is not a module of the model")
    blocks = named.get("blocks") or _largest_block_list(module)
    if blocks is None:
        raise Unsupported(f"CustomModel({what!r}): could not find its blocks (an nn.ModuleList or nn.ModuleDict of "
                          "modules of one class). Fix: name them, parts={'blocks': 'path.to.layers'}")
    rest = list(outside(module, blocks))
    embedding = named.get("embedding") or _only(what, "embedding", [p for p, m in rest if isinstance(m, nn.Embedding)])
    vocab = _get(module, embedding).num_embeddings if embedding else None
    heads = [p for p, m in rest if isinstance(m, nn.Linear) and (vocab is None or m.out_features == vocab)]
    head = named.get("head") or (heads[-1] if heads else None)
    if "norm" in named:
        norm = named["norm"]
    else:
        order = [p for p, _ in module.named_modules()]
        after = order.index(blocks)
        norms = [p for p, m in rest if p not in (embedding, head) and order.index(p) > after
                 and (params := list(m.parameters(recurse=False))) and all(t.dim() == 1 for t in params)]
        norm = _only(what, "norm", norms, optional=True)
    missing = [part for part, path in (("embedding", embedding), ("head", head)) if path is None]
    if missing:
        raise Unsupported(f"CustomModel({what!r}): could not find its {' and '.join(missing)} (an nn.Embedding, and an "
                          "nn.Linear to the vocabulary, outside the blocks). Fix: name them, parts={"
                          + ", ".join(f"'{m}': 'path'" for m in missing) + "}")
    return Parts(embedding=embedding, blocks=blocks, norm=norm, head=head)


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _largest_block_list(module: nn.Module) -> str | None:
    lists = [(sum(p.numel() for p in m.parameters()), path) for path, m in module.named_modules()
             if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 0
             and len({type(b) for b in m.values()} if isinstance(m, nn.ModuleDict) else {type(b) for b in m}) == 1]
    return max(lists)[1] if lists else None


def _only(what: str, part: str, found: list[str], optional: bool = False) -> str | None:
    if len(found) > 1:
        raise Unsupported(f"CustomModel({what!r}): several modules could be its {part} ({', '.join(found)}). "
                          f"Fix: name it, parts={{'{part}': 'path'}}")
    if not found and not optional:
        return None
    return found[0] if found else None


class CustomCausalLM(CausalLM):
    """The protocol for a user's module (mixed into its own class by `adopt`; see the module docstring). A method
    the module's own class defines (`block_inputs`, `call_block`, `use_attention`) wins over the defaults here."""

    wb_plan: dict[str, str] = {}
    """The plan the source gave: patterns from the root ("layers.*.attn.q_proj": "colwise")."""

    def _own(self, name: str) -> Any:
        """The module's own method `name` (defined by its class, not by this adapter), bound; else None."""
        for cls in type(self).__mro__:
            if cls in (CustomCausalLM, CausalLM) or cls.__module__.startswith("workbench.models"):
                continue
            if name in vars(cls):
                return getattr(super(CausalLM, self), name)
        return None

    def block_inputs(self, hidden: torch.Tensor) -> Any:
        own = self._own("block_inputs")
        return own(hidden) if own is not None else None

    def call_block(self, block: nn.Module, hidden: torch.Tensor, inputs: Any) -> torch.Tensor:
        own = self._own("call_block")
        if own is not None:
            return own(block, hidden, inputs)
        if inputs is None:
            return block(hidden)
        if isinstance(inputs, dict):
            return block(hidden, **inputs)
        return block(hidden, *inputs) if isinstance(inputs, tuple) else block(hidden, inputs)

    @property
    def block_tp_plan(self) -> dict[str, str]:
        prefix = self.lm_parts.blocks + ".*."
        parts = {self.lm_parts.embedding, self.lm_parts.head, self.lm_parts.norm}
        for pattern in self.wb_plan:
            if not pattern.startswith(prefix) and pattern not in parts:
                raise Unsupported(f"plan entry {pattern!r} is neither inside the blocks ({prefix}...) nor a part the "
                                  "workbench lays out itself (embedding, norm, head). Fix: name modules inside the "
                                  "blocks")
        plan = {p.removeprefix(prefix): style for p, style in self.wb_plan.items() if p.startswith(prefix)}
        names = {name for _, block in self.block_paths() for name, _ in block.named_modules()}
        for pattern in plan:
            if not matching(names, pattern):
                raise Unsupported(f"plan entry {prefix + pattern!r} names no module of any block. Fix: name modules "
                                  f"by their path from the model's root, blocks as {prefix}...")
        return plan

    def routed_experts(self) -> list[Experts]:
        return routed_experts(self)

    def use_attention(self, kernel: AttentionKernel) -> None:
        own = self._own("use_attention")
        if own is not None:
            own(kernel)
            return
        for path, block in self.block_paths():
            route_sdpa(block, kernel, path)
