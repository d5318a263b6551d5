"""Reshard in memory: each rank's pieces of the old layout moved straight into the new one, in one exchange.

`reshard_into(old, new)` carries a trainer's state (weights, optimizer state,
loss scale, counters) into a trainer of another layout on the same world. The
direct path does not gather the full state: every rank describes what it
holds of each tensor (a `Region`: DTensor shard, ZeRO-1 partition, pipeline
stage, expert slice, or whole) and what the new layout wants of it, one
`all_gather_object` shares the descriptions, every rank computes the same plan
(`reshard_plan.plan_moves`), copies what it already holds, and one
`all_to_all_single` of raw bytes carries the rest. dp2 → tp2 moves nothing over
the wire: each rank slices its own copy.

Optimizer state is carried generically, by its parameter: a state tensor shaped
like its parameter's local shard (AdamW's moments, a momentum buffer) is placed
as the parameter is; a 0-dim tensor or a non-tensor (a step counter, a None) is
copied as it is. So any torch optimizer whose state is elementwise moves this
way, not only AdamW.

The full-state path (`reshard.export_full_state` / `import_full_state`) stays as
the fallback, taken on every rank together when any rank's description says
the direct path cannot do it:
    - a host-offloaded layout (Config.offload) on either side: its state lives on
      another device than its parameters,
    - fp8 on either side (its weights may be tensor subclasses; untested without a GPU),
    - a different optimizer class on the two sides (the full path then starts the new one's state afresh),
    - an optimizer state tensor neither shaped like its parameter nor 0-dim,
    - a DTensor placement other than Shard, _StridedShard or Replicate,
    - pieces that do not make up every wanted piece exactly (`Uncovered`).
Both paths give bit for bit the same state (tests/engine/test_reshard_direct.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from workbench.engine.parallel.expert import ExpertShard, expert_shards
from workbench.engine.parallel.zero_redundancy import local_optimizer
from workbench.engine.reshard import bare_name, export_full_state, import_full_state
from workbench.engine.reshard_plan import Box, Move, Region, Uncovered, plan_moves, runs_of, whole

PARAM, STATE = "param", "state"
"""The two parts of a parameter's name that move: its value, and its optimizer state (all like-shaped entries)."""
_ALIGN = 16
"""Bytes each piece in the exchange buffer is padded to, so every piece can be viewed as its own dtype."""


class _CannotDirect(Exception):
    """This rank's layout is one the direct path does not move (the message says why)."""


def reshard_into(old: Any, new: Any, *, direct: bool = True) -> str:
    """Carry `old` trainer's state into `new` (another layout, same world; collective: all ranks).

    Returns the path taken, the same on every rank: "direct", or "full state (why)"; `direct=False` forces the
    full state.
    """
    with torch.no_grad():  # DTensor.to_local is an autograd function otherwise, 5x slower per call
        why = _reshard_direct(old, new) if direct else "asked for"
    if why is None:
        return "direct"
    import_full_state(new, export_full_state(old))
    return f"full state ({why})"


@dataclass
class _Description:
    """What one rank holds of the old layout and wants of the new: the part every rank gathers."""

    held: dict[tuple[str, str], Region] = field(default_factory=dict)
    wanted_params: dict[str, Region] = field(default_factory=dict)
    wanted_state: list[str] = field(default_factory=list)
    """Parameters whose optimizer state the new layout keeps on this rank (ZeRO-1: its partition's). A list, not a
    set: the plan's order follows it, and a set's order of strings differs between processes."""
    dtypes: dict[str, str] = field(default_factory=dict)
    """Each held and each wanted parameter's dtype: the bytes that move are read as it."""
    state_entries: dict[str, tuple[tuple[str, str | None], ...]] = field(default_factory=dict)
    """Per held parameter, its state's keys in order, each with its dtype if it moves like the parameter, else None."""
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per held parameter, its state entries copied as they are (0-dim tensors, non-tensors)."""
    problem: str | None = None


@dataclass(frozen=True)
class _Scalar:
    """A 0-dim tensor as plain values: pickling a tensor costs ~1 ms (torch 2.13), and every rank sends one per
    parameter (AdamW's step). `item()` and back is exact for every real dtype."""

    value: Any
    dtype: str
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Scalar:
        return cls(tensor.item(), str(tensor.dtype).removeprefix("torch."), str(tensor.device))

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.value, dtype=getattr(torch, self.dtype), device=self.device)


@dataclass
class _Local:
    """This rank's tensors behind its description (never sent as objects)."""

    old: dict[tuple[str, str], list[torch.Tensor]] = field(default_factory=dict)
    new: dict[tuple[str, str], list[torch.Tensor]] = field(default_factory=dict)
    new_params: dict[str, tuple[nn.Parameter, torch.optim.Optimizer]] = field(default_factory=dict)


def _reshard_direct(old: Any, new: Any) -> str | None:
    """Move the state directly; None when done, else why not (then nothing was changed)."""
    mine, local = _describe(old, new)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    problems = [d.problem for d in everyone if d.problem]
    if problems:
        return problems[0]  # every rank sees the same descriptions: all fall back together
    try:
        entries = _agree_state_entries(everyone)
        moves = plan_moves([d.held for d in everyone], _wanted(everyone, entries))
    except Uncovered as e:
        return str(e)
    _allocate_state(local, entries, mine.wanted_state)
    _run_moves(moves, local, dist.get_rank(), new.device)
    _install_state(local, entries, everyone)
    scaler = old.precision.scaler.state_dict()
    if scaler and new.precision.scaler.is_enabled():
        new.precision.scaler.load_state_dict(scaler)
    new.steps_done, new.skipped_steps = old.steps_done, old.skipped_steps
    return None


# -- describing a rank's pieces ---------------------------------------------------------------------------
def _describe(old: Any, new: Any) -> tuple[_Description, _Local]:
    mine, local = _Description(), _Local()
    try:
        if old.cfg.offload or new.cfg.offload:
            raise _CannotDirect("host offload keeps optimizer state on another device than its parameters")
        if any(t.cfg.precision.startswith("fp8") for t in (old, new)):
            # Its weights may be float8 tensor subclasses under FSDP2; CPU refuses fp8, so this path is untested there.
            raise _CannotDirect("fp8 weights are not moved directly (not yet tested on a GPU)")
        kinds = {type(local_optimizer(o)) for o in [*old.optimizers, *new.optimizers]}
        if len(kinds) > 1:
            raise _CannotDirect(f"the optimizer changes ({', '.join(sorted(k.__name__ for k in kinds))})")
        for module, opt in zip(old.modules, old.optimizers):
            _describe_held(module, local_optimizer(opt), mine, local)
        for module, opt in zip(new.modules, new.optimizers):
            _describe_wanted(module, local_optimizer(opt), mine, local)
    except Exception as e:  # noqa: BLE001 - any failure to describe must become the full path on every rank,
        # not an error on this rank alone while the others wait for it in the gather below.
        mine = _Description(problem=f"rank {dist.get_rank()}: {e}")
    return mine, local


def _describe_held(module: nn.Module, opt: torch.optim.Optimizer, mine: _Description, local: _Local) -> None:
    shards = expert_shards(module, bare_name)
    for name, param in module.named_parameters():
        name = bare_name(name)
        place, tensor = region(param, shards.get(name)), local_tensor(param)
        mine.held[name, PARAM], local.old[name, PARAM] = place, [tensor.detach()]
        mine.dtypes[name] = str(tensor.dtype)
        state = opt.state.get(param)
        if not state:
            continue
        entries, moving, values = [], [], {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                moving.append(_like_param(name, key, value, param))
                entries.append((key, str(value.dtype)))
            else:
                if isinstance(value, DTensor):
                    raise _CannotDirect(f"{name}: state {key!r} is a 0-dim DTensor")
                values[key] = _Scalar.of(value) if isinstance(value, torch.Tensor) else value
                entries.append((key, None))
        mine.state_entries[name], mine.values[name] = tuple(entries), values
        if moving:
            mine.held[name, STATE], local.old[name, STATE] = place, moving


def _describe_wanted(module: nn.Module, opt: torch.optim.Optimizer, mine: _Description, local: _Local) -> None:
    shards = expert_shards(module, bare_name)
    stateful = {p for group in opt.param_groups for p in group["params"]}
    for name, param in module.named_parameters():
        name = bare_name(name)
        mine.wanted_params[name], tensor = region(param, shards.get(name)), local_tensor(param)
        local.new[name, PARAM] = [tensor.detach()]
        if mine.dtypes.setdefault(name, str(tensor.dtype)) != str(tensor.dtype):
            raise _CannotDirect(f"{name} changes dtype ({mine.dtypes[name]} → {tensor.dtype})")
        if param in stateful:
            mine.wanted_state.append(name)
            local.new_params[name] = (param, opt)


def _like_param(name: str, key: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value`'s local tensor, if it is sharded exactly as `param` is; else the direct path cannot place it."""
    same_spec = (isinstance(value, DTensor) == isinstance(param, DTensor)
                 and (not isinstance(value, DTensor)
                      or (value.placements == param.placements and value.device_mesh == param.device_mesh)))
    tensor, own = local_tensor(value), local_tensor(param)
    if not same_spec or tensor.shape != own.shape or tensor.device != own.device:
        raise _CannotDirect(f"{name}: optimizer state {key!r} is not laid out like its parameter")
    return tensor.detach()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The piece of `tensor` this rank holds: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def region(tensor: torch.Tensor, expert: ExpertShard | None) -> Region:
    """Where this rank's local piece of `tensor` sits in the whole model's tensor of that name."""
    place = _dtensor_region(tensor) if isinstance(tensor, DTensor) else whole(tensor.shape)
    if expert is None:
        return place
    # An expert-parallel slice: this ep rank's experts along dim 0 (tensor.shape is the slice's, also for a DTensor).
    shift = expert.rank * tensor.shape[0]
    return (tuple((a + shift, b + shift) for a, b in place[0]), *place[1:])


def _dtensor_region(tensor: DTensor) -> Region:
    placements = tensor.placements
    shape = tuple(tensor.to_local().shape)
    if all(isinstance(p, (Shard, Replicate)) for p in placements):
        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
        region = tuple(((o, o + n),) if n else () for o, n in zip(offset, local_shape))
    else:
        region = _strided_region(tensor)
    if tuple(sum(b - a for a, b in runs) for runs in region) != shape:
        raise _CannotDirect(f"a DTensor's computed shard {region} does not match its local shape {shape}")
    return region


def _strided_region(tensor: DTensor) -> Region:
    """FSDP2 over a dim tensor parallel also shards gives `_StridedShard`: rows interleaved, several runs per dim.
    torch 2.13 computes their indices only in a private helper (what `compute_local_shape_and_global_offset` uses
    before it keeps the first offset); without it, the direct path declines."""
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError as e:
        raise _CannotDirect(f"this torch cannot compute a strided shard's indices ({e})") from None
    mesh, sizes, indices = tensor.device_mesh, list(tensor.shape), {}
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise _CannotDirect(f"DTensor placement {placement} is not moved directly")
        dim = placement.dim
        sizes[dim], indices[dim] = _get_shard_size_and_offsets(
            sizes[dim], mesh.size(mesh_dim), coordinate[mesh_dim], placement, indices.get(dim), tensor.shape[dim], False)
    return tuple(runs_of(indices[d][:sizes[d]].tolist()) if d in indices else ((0, n),) if n else ()
                 for d, n in enumerate(tensor.shape))


# -- agreeing and planning ----------------------------------------------------------------------------------
def _agree_state_entries(everyone: list[_Description]) -> dict[str, tuple[tuple[str, str | None], ...]]:
    """Each parameter's state entries, the same on every rank that holds them (else Uncovered)."""
    entries: dict[str, tuple[tuple[str, str | None], ...]] = {}
    for d in everyone:
        for name, mine in d.state_entries.items():
            if entries.setdefault(name, mine) != mine:
                raise Uncovered(f"{name}: ranks hold different optimizer state ({entries[name]} vs {mine})")
    dtypes: dict[str, str] = {}
    for d in everyone:
        for name, dtype in d.dtypes.items():
            if dtypes.setdefault(name, dtype) != dtype:
                raise Uncovered(f"{name}: held as {dtypes[name]} and as {dtype}")
    return entries


def _wanted(everyone: list[_Description], entries: dict) -> list[dict[tuple[str, str], Region]]:
    """Every rank's wanted pieces: its parameters, and their state where the new layout keeps it and some is held."""
    out = []
    for d in everyone:
        want = {(name, PARAM): region for name, region in d.wanted_params.items()}
        for name in d.wanted_state:
            if any(dtype for _, dtype in entries.get(name, ())):
                want[name, STATE] = d.wanted_params[name]
        out.append(want)
    return out


# -- moving ---------------------------------------------------------------------------------------------------
def _allocate_state(local: _Local, entries: dict, wanted_state: list[str]) -> None:
    """Empty tensors for the new layout's moving state, shaped like each parameter's local shard."""
    for name in wanted_state:
        dtypes = [dtype for _, dtype in entries.get(name, ()) if dtype]
        if dtypes:
            (own,) = local.new[name, PARAM]
            local.new[name, STATE] = [torch.empty(own.shape, dtype=getattr(torch, d.removeprefix("torch.")),
                                                  device=own.device) for d in dtypes]


def _box(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(start, start + length) for start, length in box)]


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _run_moves(moves: list[Move], local: _Local, me: int, device: torch.device) -> None:
    """Local copies first; then one all_to_all_single of raw bytes for everything that crosses ranks (skipped by
    every rank when nothing does: the plan is the same everywhere)."""
    world = dist.get_world_size()
    sends: list[list[Move]] = [[] for _ in range(world)]
    recvs: list[list[Move]] = [[] for _ in range(world)]
    crossing = False
    with torch.no_grad():
        for move in moves:
            if move.src == move.dst:
                if move.src == me:
                    for src, dst in zip(local.old[move.key], local.new[move.key]):
                        _box(dst, move.dst_box).copy_(_box(src, move.src_box))
                continue
            crossing = True
            if move.src == me:
                sends[move.dst].append(move)
            elif move.dst == me:
                recvs[move.src].append(move)
        if not crossing:
            return
        out_bytes = _bytes_per_peer(sends, local.old)
        in_bytes = _bytes_per_peer(recvs, local.new)
        send = torch.empty(sum(out_bytes), dtype=torch.uint8, device=device)
        for tensor, piece, at in _laid_out(sends, local.old, "src_box"):
            send[at].view(tensor.dtype).view(piece.shape).copy_(piece)
        recv = torch.empty(sum(in_bytes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(recv, send, in_bytes, out_bytes)
        for tensor, piece, at in _laid_out(recvs, local.new, "dst_box"):
            piece.copy_(recv[at].view(tensor.dtype).view(piece.shape))


def _bytes_per_peer(by_peer: list[list[Move]], tensors: dict) -> list[int]:
    """Bytes of the exchange buffer each peer's moves take, each piece padded as `_laid_out` places it."""
    return [sum(_padded(m.numel * t.element_size()) for m in ms for t in tensors[m.key]) for ms in by_peer]


def _laid_out(by_peer: list[list[Move]], tensors: dict,
              box: str) -> Iterator[tuple[torch.Tensor, torch.Tensor, slice]]:
    """Each piece the moves carry, in the exchange buffer's order (by peer, then move, then tensor): the tensor,
    its `box` ("src_box" sending, "dst_box" receiving) of it, and where its bytes stand in the buffer. Sender and
    receiver walk the same order, so a piece is read where it was written."""
    offset = 0
    for ms in by_peer:
        for move in ms:
            for tensor in tensors[move.key]:
                n = move.numel * tensor.element_size()
                yield tensor, _box(tensor, getattr(move, box)), slice(offset, offset + n)
                offset += _padded(n)

def _install_state(local: _Local, entries: dict, everyone: list[_Description]) -> None:
    """The moved state into the new optimizers, in the source's key order; entries that do not move copied from
    the first rank holding them. A DTensor parameter's state is a DTensor of the same placements, as torch makes it."""
    for name, (param, opt) in local.new_params.items():
        if name not in entries:
            continue  # no state held anywhere yet (before the first step)
        values = next(d.values[name] for d in everyone if name in d.values)
        moved = iter(local.new.get((name, STATE), ()))
        state = {}
        for key, dtype in entries[name]:
            if dtype is None:
                value = values[key]
                state[key] = value.tensor() if isinstance(value, _Scalar) else value
                continue
            tensor = next(moved)
            state[key] = _placed_like(param, tensor) if isinstance(param, DTensor) else tensor
        opt.state[param] = state


def _placed_like(param: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor holding `local` as `param`'s shard, as torch's optimizers make their state of a DTensor parameter.
    With the parameter's own spec where the dtype is the same: `from_local` builds an equal spec anew, ~7x slower
    (torch 2.13, measured), and a reshard makes two per parameter."""
    if local.dtype == param.dtype:
        return DTensor(local, param._spec, requires_grad=False)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
