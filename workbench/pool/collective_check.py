"""Refuse desynchronised collectives on the world group instead of hanging or silently succeeding.

gloo lets the rank with the smaller tensor "succeed" when ranks all-reduce
different shapes, and ranks calling different ops hang until the timeout.
torch's own cure, TORCH_DISTRIBUTED_DEBUG=DETAIL, wraps every group in a
checker, but torch 2.13's DDP segfaults on a group so wrapped (its logger,
at construction), so the pool cannot turn it on by default. This is the
same check, done our way: before each collective that user code issues on
the world group, the ranks compare a fingerprint (op, shapes, dtypes,
arguments) over a separate gloo group; on a mismatch every rank raises
`CollectiveMismatch` naming what each rank called. Torch's parallel modules
(DDP, FSDP, DTensor) generate matching collectives by construction; code
that runs them wraps itself in `rank.unchecked()` to skip the ~1 ms check.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from typing import Any, Callable

_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
        "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")

_state = threading.local()
_check_group: Any = None


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives, or the same one with different shapes or arguments."""


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe(v) for v in value) + "]"
    if value is None or isinstance(value, (int, float, str, bool)):
        return repr(value)
    return type(value).__name__ if not hasattr(value, "name") else str(getattr(value, "name"))


# Arguments that legitimately differ between ranks: the list only the root of a scatter/gather holds.
_ROOT_ONLY = {"scatter": (1, "scatter_list"), "gather": (1, "gather_list")}


def _fingerprint(op: str, args: tuple, kwargs: dict) -> str:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("group", "async_op")}
    if op in _ROOT_ONLY:
        index, name = _ROOT_ONLY[op]
        args = args[:index] + args[index + 1:]
        kwargs.pop(name, None)
    parts = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in sorted(kwargs.items())]
    return f"{op}({', '.join(parts)})"


def _compare(fingerprint: str) -> None:
    import torch
    import torch.distributed as dist

    digest = torch.frombuffer(bytearray(hashlib.sha256(fingerprint.encode()).digest()), dtype=torch.uint8)
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, digest, group=_check_group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    described: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(described, fingerprint, group=_check_group)
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(described))
    raise CollectiveMismatch(f"ranks called mismatched collectives on the world group:\n{lines}\n"
                             "Every rank must call the same collective with the same shapes, in the same order.")


def _checked(op: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        group = kwargs.get("group")
        world = group is None or group is dist.group.WORLD
        if world and not getattr(_state, "off", False):
            _state.off = True  # the check's own collectives are not checked
            try:
                _compare(_fingerprint(op, args, kwargs))
            finally:
                _state.off = False
        return original(*args, **kwargs)

    wrapper.__workbench_checked__ = True
    return wrapper


def install() -> None:
    """Start checking: call once on every rank, right after the world group is up."""
    global _check_group
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _check_group = dist.new_group(backend="gloo")
    for op in _OPS:
        original = getattr(c10d, op)
        if getattr(original, "__workbench_checked__", False):
            continue
        wrapped = _checked(op, original)
        setattr(c10d, op, wrapped)
        if getattr(dist, op, None) is original:
            setattr(dist, op, wrapped)


@contextlib.contextmanager
def unchecked():
    """Skip the check inside (torch's parallel modules, whose collectives match by construction)."""
    previous = getattr(_state, "off", False)
    _state.off = True
    try:
        yield
    finally:
        _state.off = previous
