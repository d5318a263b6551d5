"""A model's initial values, one parameter at a time, cut to the piece each rank holds.

Ranks build a model on the meta device (nothing allocated) and lay it out there; then each allocates only its own
pieces and asks an `InitialValues` for them: `pieces({name: region})` yields each wanted parameter's piece, a region
being, per dim, the runs [start, stop) of the whole tensor's indices the rank holds (engine/reshard_plan.py's
`Region`). Where the values are drawn, every parameter's whole tensor is drawn on the host, cut, and dropped before
the next: a rank holds its shard plus one parameter, never the whole model. Where they are read (a checkpoint's
safetensors, `weights.py`), only the piece is read.

Every layout draws the same values, so every layout starts from the same model:
- the built-in transformer (`BuiltinInit`) replays `build_model(cfg, seed)` exactly: the seeded generator first
  advances as the modules' constructors drew (each module's `reset_parameters`, in construction order), then each
  parameter is drawn as `init_weights` draws it, in the same order. The same weights bit for bit, so checkpoints
  and losses are those of building the whole model;
- any other model (`ModuleInit`) draws each module's own parameters with a generator seeded by (seed, the module's
  path), through the model's own per-module initialiser (transformers' `_init_weights(module)`, or the module's
  `reset_parameters()`), so a rank skips the modules it holds nothing of. A parameter the initialiser leaves unset
  is refused by name (it would otherwise hold whatever the memory held).
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import torch
from torch import nn

from workbench.models.adapt import direct_parameters
from workbench.models.protocol import Unsupported

Region = tuple[tuple[tuple[int, int], ...], ...]
"""Per dim, the runs [start, stop) of the whole tensor's indices that a rank's local piece holds, in its order."""


class InitialValues(Protocol):
    def pieces(self, wanted: Mapping[str, Region]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's piece) for every wanted parameter name, one at a time, in the source's own order."""
        ...


def whole_region(shape: torch.Size | tuple[int, ...]) -> Region:
    return tuple(((0, n),) if n else () for n in shape)


def cut(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """The piece of the whole `tensor` that `region` describes."""
    for dim, runs in enumerate(region):
        if len(runs) == 1:
            (start, stop), = runs
            tensor = tensor.narrow(dim, start, stop - start)
        else:
            index = torch.cat([torch.arange(start, stop) for start, stop in runs])
            tensor = tensor.index_select(dim, index)
    return tensor


def _on_host(module: nn.Module) -> nn.Module:
    """A copy of `module` whose own parameters are allocated on the host (uninitialised), its children untouched."""
    host = copy.deepcopy(module)
    host.to_empty(device="cpu", recurse=False)
    return host


class BuiltinInit:
    """The built-in transformer's values, replayed exactly as `build_model(cfg, seed)` draws them (module docstring)."""

    def __init__(self, make: Callable[[], nn.Module], seed: int) -> None:
        self.make, self.seed = make, seed
        """`make()`: the whole model on the meta device, as constructed (its module order is the draws' order); made
        afresh when values are asked for, since the model the ranks lay out changes under them."""

    def pieces(self, wanted: Mapping[str, Region]) -> Iterator[tuple[str, torch.Tensor]]:
        self.model = self.make()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            with torch.no_grad():
                for module in self.model.modules():
                    if direct_parameters(module) and hasattr(module, "reset_parameters"):
                        _on_host(module).reset_parameters()  # only the generator's advance is kept
                for name, param in self.model.named_parameters():
                    value = torch.empty(param.shape, dtype=param.dtype)
                    type(self.model).init_parameter(self.model.cfg, name, value)
                    if name in wanted:
                        yield name, cut(value, wanted[name])
                    del value  # before the next is drawn: one whole parameter at a time


def module_seed(seed: int, path: str) -> int:
    """The seed of one module's draws: a function of the run's seed and the module's path alone."""
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % 2**63


class ModuleInit:
    """Each module's own parameters drawn by `initialiser(model)(module)` under a generator seeded by (seed, its
    path), `model` being made afresh on the meta device by `make()` (as `BuiltinInit`'s)."""

    def __init__(self, make: Callable[[], nn.Module], seed: int,
                 initialiser: Callable[[nn.Module], Callable[[nn.Module], None]], how: str) -> None:
        self.make, self.seed, self.initialiser, self.how = make, seed, initialiser, how
        """`how` names the initialiser in a refusal ("transformers' _init_weights", "reset_parameters()")."""

    def pieces(self, wanted: Mapping[str, Region]) -> Iterator[tuple[str, torch.Tensor]]:
        model = self.make()
        initialise = self.initialiser(model)
        seen: set[int] = set()  # a tied parameter is drawn once, under the first module that holds it
        for path, module in model.named_modules():
            own = [(name, p) for name, p in direct_parameters(module) if id(p) not in seen]
            seen.update(id(p) for _, p in own)
            names = [f"{path}.{name}" if path else name for name, _ in own]
            if not any(n in wanted for n in names):
                continue
            host = _on_host(module)
            with torch.no_grad():
                for _, p in direct_parameters(host):
                    p.fill_(float("nan"))
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(module_seed(self.seed, path))
                    try:
                        initialise(host)
                    except Unsupported as e:
                        raise Unsupported(f"{path or 'the root'}: {e}") from None
            for full_name, (name, _) in zip(names, own):
                value = host._parameters[name]
                if value.is_floating_point() and torch.isnan(value).any():
                    raise Unsupported(f"{full_name}: {self.how} leaves it (partly) unset, so it would start from "
                                      "whatever memory held; initialise it there")
                if full_name in wanted:
                    yield full_name, cut(value.detach(), wanted[full_name])
            del host, value  # before the next module is drawn: one module's parameters at a time


def reset_parameters(module: nn.Module) -> None:
    """torch's convention for a module's initial values (what FSDP2's meta-device recipe calls per module)."""
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise Unsupported(f"{type(module).__name__} holds parameters but has no reset_parameters(), so its initial "
                          "values cannot be drawn on each rank apart; define reset_parameters() (torch's convention)")
    reset()


def whole_model(model: nn.Module, values: InitialValues) -> dict[str, torch.Tensor]:
    """Every parameter of `model` whole, from `values` (one process: the reference the layouts are held to)."""
    wanted = {name: whole_region(p.shape) for name, p in model.named_parameters()}
    return dict(values.pieces(wanted))


def materialize(model: nn.Module, values: InitialValues, device: torch.device | str = "cpu") -> nn.Module:
    """Give a model built on the meta device its whole parameters on `device`, from `values`, in place (one
    process, no layout; tied parameters stay one). Buffers stay as they were built. Returns the model."""
    device = torch.device(device)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in direct_parameters(module):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                           requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, piece in whole_model(model, values).items():
            params[name].copy_(piece)
    return model
