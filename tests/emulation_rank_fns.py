"""Rank functions for the emulation tests and benches: issue one collective of each kind and time it."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workbench.pool import rank

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
         "send", "barrier")
"""Every kind the recording backend paces (send: rank 0 sends to 1, which receives: both time their side)."""


def issue(kind: str, nbytes: int) -> None:
    """One blocking `kind` whose size, as nccl-tests counts it (and the recording backend records it), is
    `nbytes`: all_gather's output, reduce_scatter's and all_to_all's input, the one tensor otherwise."""
    me, n = dist.get_rank(), dist.get_world_size()
    whole = torch.zeros(nbytes // 4)
    part = torch.zeros(nbytes // 4 // n)
    if kind == "all_reduce":
        dist.all_reduce(whole)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(whole, part)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(part, whole)
    elif kind == "all_to_all":
        dist.all_to_all_single(torch.empty_like(whole), whole)
    elif kind == "broadcast":
        dist.broadcast(whole, src=0)
    elif kind == "reduce":
        dist.reduce(whole, dst=0)
    elif kind == "gather":
        dist.gather(part, [torch.empty_like(part) for _ in range(n)] if me == 0 else None, dst=0)
    elif kind == "scatter":
        dist.scatter(part, [torch.zeros_like(part) for _ in range(n)] if me == 0 else None, src=0)
    elif kind == "send":
        if me == 0:
            dist.send(whole, dst=1)
        elif me == 1:
            dist.recv(whole, src=0)
    elif kind == "barrier":
        dist.barrier()
    else:
        raise ValueError(kind)


def time_kinds(kinds: tuple[str, ...], sizes: tuple[int, ...], reps: int = 1) -> dict[tuple[str, int], float]:
    """(kind, nbytes) -> the best of `reps` wall times of one blocking collective on this rank, the ranks lined up
    by a barrier before each."""
    out = {}
    with rank.unchecked():  # gather/scatter lists exist on the root only: not the pool's mismatch check's to judge
        for kind in kinds:
            for nbytes in sizes:
                best = float("inf")
                for _ in range(reps):
                    dist.barrier()
                    start = time.perf_counter()
                    issue(kind, nbytes)
                    best = min(best, time.perf_counter() - start)
                out[kind, nbytes] = best
    return out


def emulation_status() -> dict:
    from workbench.emulation import rank as emulation

    status = emulation.status()
    status.pop("cluster")
    return status
