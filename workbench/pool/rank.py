"""What code running on a rank can use: its identity, state kept across calls, events, flags.

Functions sent with `pool.run` receive nothing special; they import this module:

    from workbench.pool import rank
    rank.state["model"] = model      # survives until the pool restarts
    rank.emit(metrics)               # reaches the notebook's subscribers
    if rank.flag("stop"): ...        # set from the notebook while a command runs

In the notebook process this module is inert: `rank.info` is None there.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

state: dict[str, Any] = {}
"""Objects a rank keeps across commands (model, optimizer, ...). Cleared only by a restart."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: str
    """"cpu" or "cuda:N": where this rank computes."""
    backend: str
    """"gloo" or "nccl"."""
    host: str


info: RankInfo | None = None
_flags: dict[str, Any] = {}
_send: Callable[[dict], None] | None = None
_diagnostics: dict[str, Callable[[], Any]] = {}


def _require() -> RankInfo:
    if info is None:
        raise RuntimeError("workbench.pool.rank is only usable on a rank (inside pool.run)")
    return info


def get_rank() -> int:
    return _require().rank


def get_world_size() -> int:
    return _require().world_size


def emit(event: Any) -> None:
    """Send a small picklable record to the notebook; it also counts as progress for hang detection."""
    _require()
    _send({"type": "event", "event": event})


def progress() -> None:
    """Tell the notebook this rank is alive and working (long commands without events call this)."""
    _require()
    _send({"type": "progress"})


def flag(name: str, default: Any = None) -> Any:
    """A value set from the notebook with `pool.set_flag(name, value)`, visible while commands run."""
    return _flags.get(name, default)


def host(send: Callable[[dict], None]) -> None:
    """Where `emit` and `progress` go in this process: set once by what hosts the rank (the pool's worker, or
    `python -m workbench.train`)."""
    global _send
    _send = send


def set_flag(name: str, value: Any) -> None:
    """Set a flag on this rank: by the pool's worker when the notebook calls `pool.set_flag`, or by
    `workbench.train` when a signal asks for a stop."""
    _flags[name] = value


def add_diagnostic(name: str, provider: Callable[[], Any]) -> None:
    """Register `provider`: when this rank looks stuck, its answer goes into the error the notebook raises.

    The notebook asks a rank where it is when it hangs (or when another rank
    froze); the rank's I/O thread answers with its main thread's stack and
    `{name: provider()}` for every provider registered here (e.g. the last
    collectives it issued and completed). Providers run on that I/O thread
    while the main thread is stuck: they must be quick, never wait for a
    lock the main thread may hold, and return something small and picklable
    (a str or a dict of plain values). Registering a name again replaces it.
    """
    _diagnostics[name] = provider


def remove_diagnostic(name: str) -> None:
    _diagnostics.pop(name, None)


def diagnostics() -> dict[str, Any]:
    """Every registered provider's answer now; a provider that fails answers with its error instead."""
    answers: dict[str, Any] = {}
    for name, provider in list(_diagnostics.items()):
        try:
            answers[name] = provider()
        except Exception as e:  # noqa: BLE001 - a broken provider must not hide the stack
            answers[name] = f"(failed: {type(e).__name__}: {e})"
    return answers


MACHINE_FACTS = "WORKBENCH_MACHINE_FACTS"
"""The environment variable naming the folder where local ranks keep `machine_fact`s: the user's runtime folder
(`pool.runtime_dir`), shared by every pool and kernel of the user, or a pool's private folder where that is
unusable."""


def machine_fact(name: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """What `measure()` finds out about this machine (a JSON-able dict), measured once per machine.

    The first rank that needs it measures; every later rank, of this pool or of a pool of another kernel of the
    user, reads the answer instead of measuring again, so neither a restart nor a notebook's first apply pays for it
    (a CPU's matmul peak takes about a second) and every session divides by the same figure. Kept as JSON (never
    unpickled) under the machine's identity (`machine_identity`: CPU, cores, Python, torch), in the folder
    $WORKBENCH_MACHINE_FACTS names, until that folder is emptied (the user's runtime folder is at logout or reboot;
    remove its `machine` folder to measure again); measured at each call where there is no folder (the notebook,
    remote ranks).
    """
    folder = os.environ.get(MACHINE_FACTS)
    if not folder:
        return measure()
    path = os.path.join(folder, re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}-{machine_identity()}") + ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass  # not measured yet (or a half-written file of a rank that died: measure again)
    value = measure()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)  # ranks measuring at once each write a whole file; the last one stays
    return value


@functools.cache
def machine_identity() -> str:
    """A short hash of what a measurement of this machine depends on: the CPU model, the cores this process may
    use, the host, Python and torch (if imported). A fact measured under another identity is measured again."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch = sys.modules.get("torch")
    what = [cpu, cores, os.cpu_count(), platform.node(), sys.version, getattr(torch, "__version__", "")]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]


def unchecked():
    """A context in which this rank's collectives skip the pool's mismatch check (see collective_check)."""
    from workbench.pool.collective_check import unchecked as _unchecked

    return _unchecked()
