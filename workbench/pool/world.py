"""On a rank: get ready to compute (ahead of time), then join the session's torch.distributed world.

Starting a rank is mostly importing: torch, the modules the pool preloads,
torch._dynamo (which the first optimizer imports, ~2 s on a small machine).
None of that depends on the session, so it is `prepare`, done before the
rank even connects to the notebook; a standby rank does it long before it
is needed and then waits, using no CPU. `join` is what needs the session:
the process group (its store is per session) and the collective check.
"""

from __future__ import annotations

import gc
import importlib
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from workbench.machine import threads_per_rank
from workbench.pool import rank as rank_api

PREPARE_KEYS = ("device", "threads", "preload", "backend_setup")
"""The settings `prepare` reads: the same for every session of a pool, so a local rank gets them at spawn."""


@dataclass(frozen=True)
class Prepared:
    device: str
    """"cpu" or "cuda:N"."""
    backend: str
    """The torch.distributed backend to join the world with."""
    marks: dict[str, float]
    """When each part of the preparation ended (time.monotonic): torch, backend, preload, warm."""


def prepare(settings: dict[str, Any], local_rank: int, local_world_size: int) -> Prepared:
    """Import and warm up what every command needs; choose the device and the backend. Touches no other rank."""
    # Importing torch, torch._dynamo and the engine creates ~500,000 objects, all kept: the garbage collector's
    # passes over that growing heap found nothing to free and cost 0.2-0.5 s of the ~2.5 s a cold start spent
    # here (benches/first_cell.py). Collection resumes once what the imports built is frozen below.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _prepare(settings, local_rank, local_world_size)
    finally:
        # What start-up built (torch and the modules) lives as long as the rank: freezing it leaves the garbage
        # collector only what commands create to scan, ~1 ms instead of ~0.1-0.8 s per full collection. The few
        # cycles the imports left unreferenced (~6 MB) are frozen with it: collecting them first costs ~0.2 s.
        gc.freeze()
        if collecting:
            gc.enable()


def _prepare(settings: dict[str, Any], local_rank: int, local_world_size: int) -> Prepared:
    import torch

    marks = {"torch": time.monotonic()}
    # On a fatal signal torch prints every thread's native stack (then faulthandler its Python ones): a crash in a
    # thread that runs no Python, gloo's worker or a completion callback, is found only there (crash_report).
    if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
        torch._C._set_print_stack_traces_on_fatal_signal(True)

    torch.set_num_threads(settings["threads"] or threads_per_rank(local_world_size))
    device = settings["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if settings.get("backend_setup"):
        module, _, function = settings["backend_setup"].partition(":")
        backend = getattr(importlib.import_module(module), function)()
    marks["backend"] = time.monotonic()
    for module in settings["preload"]:
        importlib.import_module(module)
    marks["preload"] = time.monotonic()
    # The first optimizer built in a process imports torch._dynamo (~2 s); pay that now, not in apply().
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    marks["warm"] = time.monotonic()
    return Prepared(device, backend, marks)


def join(prepared: Prepared, settings: dict[str, Any], rank: int, world_size: int, local_rank: int) -> None:
    """Form the session's world (every rank at once) and publish who this rank is (`rank.info`)."""
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=settings["pg_timeout_s"])}
    if prepared.device.startswith("cuda"):
        kwargs["device_id"] = torch.device(prepared.device)
    if settings["store"].startswith("file:"):
        store = dist.FileStore(settings["store"][5:], world_size)
        dist.init_process_group(prepared.backend, store=store, rank=rank, world_size=world_size, **kwargs)
    else:  # torchrun / srun: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in the environment
        dist.init_process_group(prepared.backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
    if settings["check_collectives"]:
        from workbench.pool import collective_check

        collective_check.install()
    rank_api.info = rank_api.RankInfo(rank, world_size, local_rank, prepared.device, prepared.backend,
                                      socket.gethostname())


# -- a standby's CPU priority ------------------------------------------------------------------------
# A standby prepares while the session it will replace is training: it should take only idle CPU. It may lower
# its priority only if it can raise it back when it is needed (root, or RLIMIT_NICE allowing it); otherwise it
# prepares at normal priority rather than become a rank that runs niced for ever.
STANDBY_NICE = 10


def lower_priority() -> int | None:
    """Lower this process's CPU priority if it can be restored later; returns the nice value to restore."""
    import resource

    original = os.getpriority(os.PRIO_PROCESS, 0)
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    if os.geteuid() != 0 and (soft != resource.RLIM_INFINITY and 20 - soft > original):
        return None
    os.setpriority(os.PRIO_PROCESS, 0, min(19, original + STANDBY_NICE))
    return original


def restore_priority(nice: int, pid: int | None = None) -> None:
    """Every thread of process `pid` (this one by default) back to `nice` (Linux keeps a nice value per thread)."""
    tasks = f"/proc/{pid or os.getpid()}/task"
    for tid in (os.listdir(tasks) if os.path.isdir(tasks) else [str(pid or 0)]):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:
            pass  # a thread that just ended
