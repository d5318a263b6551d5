"""nccl-tests on the workbench: one blocking collective of each kind, sized as nccl-tests counts it, timed on
every rank. A rank function (`pool.run(time_kinds, ...)`): the emulation's benches, tests and notebook measure
emulated links with it."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workbench.pool import rank

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
         "send", "barrier")
"""Every kind the recording backend paces (send: rank 0 sends to 1, which receives: both time their side)."""


def prepared(kind: str, nbytes: int):
    """A call that issues one blocking `kind` whose size, as nccl-tests counts it (and the recording backend
    records it), is `nbytes`: all_gather's output, reduce_scatter's and all_to_all's input, the one tensor
    otherwise. Its buffers are allocated here, outside anything timed."""
    me, n = dist.get_rank(), dist.get_world_size()
    whole, out = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    part = torch.zeros(nbytes // 4 // n)
    parts = [torch.zeros_like(part) for _ in range(n)] if me == 0 else None
    calls = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "all_gather": lambda: dist.all_gather_into_tensor(whole, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole),
        "all_to_all": lambda: dist.all_to_all_single(out, whole),
        "broadcast": lambda: dist.broadcast(whole, src=0),
        "reduce": lambda: dist.reduce(whole, dst=0),
        "gather": lambda: dist.gather(part, parts, dst=0),
        "scatter": lambda: dist.scatter(part, parts, src=0),
        "send": lambda: dist.send(whole, dst=1) if me == 0 else dist.recv(whole, src=0) if me == 1 else None,
        "barrier": dist.barrier,
    }
    return calls[kind]


def time_kinds(kinds: tuple[str, ...], sizes: tuple[int, ...], reps: int = 1) -> dict[tuple[str, int], float]:
    """(kind, nbytes) -> the best of `reps` wall times of one blocking collective on this rank, the ranks lined up
    by a barrier before each."""
    out = {}
    with rank.unchecked():  # gather/scatter lists exist on the root only: not the pool's mismatch check's to judge
        for kind in kinds:
            for nbytes in sizes:
                call, best = prepared(kind, nbytes), float("inf")
                for _ in range(reps):
                    dist.barrier()
                    start = time.perf_counter()
                    call()
                    best = min(best, time.perf_counter() - start)
                out[kind, nbytes] = best
    return out
