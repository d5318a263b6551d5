"""What a rank process holds right now: memory, open files, threads, and the models still alive in it.

A long interactive session must not accumulate anything across apply/train cycles. `held()` counts what would pile
up if it did, on the rank it runs on (`workbench.engine.session.held` hands it the session's trainer, run through
`pool.run`), so a soak test and `benches/soak.py` can watch the counts stay flat. The model counts go through the
garbage collector, which sees every live object: a model that something forgot to release shows up there even when
nothing the session knows of refers to it.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.telemetry.memory import local_tensor

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Held:
    """One rank's holdings at one moment."""

    rss_bytes: int
    """Resident memory of the process (/proc/self/statm)."""
    open_fds: int
    threads: int
    """Python threads alive (gloo's and the pool's native threads are not Python threads)."""
    trainers: int
    """`Trainer` objects alive: 1 after an apply, however many came before."""
    parameters: int
    """Parameter tensors alive (`nn.Parameter`, also those wrapping a DTensor), every model in the process."""
    parameter_bytes: int
    """This rank's bytes of those parameters (a DTensor's local shard)."""
    session_parameters: int
    """Parameter tensors of the session's current trainer: `parameters` equals it when nothing leaked."""


def held(trainer_type: type, session_modules: Iterable[nn.Module] = ()) -> Held:
    """Count what this rank holds, after a full garbage collection (so only what is really reachable counts):
    objects of `trainer_type` alive, and every parameter against those of `session_modules` (the modules of the
    session's current trainer). The engine's session hands them over (`workbench.engine.session.held`)."""
    from torch import nn

    gc.collect()
    objects = gc.get_objects()
    params = [o for o in objects if isinstance(o, nn.Parameter)]
    trainers = sum(isinstance(o, trainer_type) for o in objects)
    del objects
    own = {id(p) for m in session_modules for p in m.parameters()}
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return Held(rss_bytes=rss, open_fds=len(os.listdir("/proc/self/fd")), threads=threading.active_count(),
                trainers=trainers, parameters=len(params),
                parameter_bytes=sum(local_tensor(p).untyped_storage().nbytes() for p in params),
                session_parameters=len(own))
