"""A model laid out on the meta device gets its parameters: only this rank's pieces, filled from the initial values.

Ranks build the model on the meta device (`workbench.models.build`) and apply the layout there: tensor parallel's
DTensors, expert slices and FSDP2's shards are all meta, costing nothing. Then each rank allocates the pieces it
holds (`to_empty`: FSDP2 re-creates its sharded parameters there) and asks the model's `InitialValues` for exactly
those pieces, each described by where it sits in the whole tensor (reshard_direct's `region`: a DTensor shard, an
expert slice, or the whole tensor). Drawn values cost one whole parameter at a time on the host; read values (a
checkpoint's safetensors) only the piece. No rank ever holds the whole model when the layout shards it.

Buffers are not parameters: they were built for real (rotary tables, scales derived from the config) and are put
back as they were after `to_empty`, which would otherwise leave them uninitialised. Parameters go to `device`: the
compute device, or the host where FSDP2 offloads its shards (Config.offload with ZeRO 2/3).
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.engine.parallel.expert import expert_shards
from workbench.engine.reshard import bare_name
from workbench.engine.reshard_direct import local_tensor, region
from workbench.models.init import InitialValues


def materialize(modules: list[nn.Module], values: InitialValues, device: torch.device) -> None:
    """Allocate `modules`' meta parameters on `device` as this rank's pieces and fill them from `values`."""
    wanted: dict[str, tuple[torch.Tensor, tuple]] = {}
    for module in modules:
        if not any(p.is_meta for p in module.parameters()):
            continue
        buffers = [(owner, name, buffer) for owner in module.modules() for name, buffer in owner._buffers.items()
                   if buffer is not None]
        module.to_empty(device=device)
        for owner, name, buffer in buffers:
            owner._buffers[name] = buffer  # as built, where `on_device` put it
        shards = expert_shards(module, bare_name)
        for name, param in module.named_parameters():
            name = bare_name(name)
            wanted[name] = (local_tensor(param), region(param, shards.get(name)))
    filled = set()
    with torch.no_grad():
        for name, piece in values.pieces({name: place for name, (_, place) in wanted.items()}):
            target = wanted[name][0]
            if tuple(piece.shape) != tuple(target.shape):
                raise RuntimeError(f"{name}: the initial values give a piece of shape {tuple(piece.shape)} for this "
                                   f"rank's {tuple(target.shape)}")
            target.copy_(piece)
            filled.add(name)
    unfilled = sorted(wanted.keys() - filled)
    if unfilled:
        raise RuntimeError(f"no initial value for {', '.join(unfilled[:5])}")


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` with its buffers on `device` and its parameters there too, unless they are still on the meta
    device (a model built there gets them laid out, `parallelize`'s `materialize`)."""
    if not any(p.is_meta for p in model.parameters()):
        return model.to(device)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return model
