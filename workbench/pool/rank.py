"""What code running on a rank can use: its identity, state kept across calls, events, flags.

Functions sent with `pool.run` receive nothing special; they import this module:

    from workbench.pool import rank
    rank.state["model"] = model      # survives until the pool restarts
    rank.emit(metrics)               # reaches the notebook's subscribers
    if rank.flag("stop"): ...        # set from the notebook while a command runs

In the notebook process this module is inert: `rank.info` is None there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

# What a rank measures about the machine, kept once per machine: part of what code on a rank can use.
from workbench.machine import MACHINE_FACTS, machine_fact  # noqa: F401

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


_nodes: tuple[int, ...] | None = None
"""The node each global rank stands on, where something said so (`place_on_nodes`)."""


def place_on_nodes(nodes: Sequence[int] | None) -> None:
    """Say which node each global rank stands on (`nodes[r]`: global rank r's node) where the ranks stand for
    machines other than those they run on (an emulated cluster places them so); None: where they run."""
    global _nodes
    _nodes = tuple(nodes) if nodes is not None else None


def node_of(global_rank: int) -> int:
    """The node `global_rank` stands on: as `place_on_nodes` said, else LOCAL_WORLD_SIZE ranks a node (torchrun's
    placement), else every rank on one node."""
    if _nodes is not None:
        return _nodes[global_rank]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    return global_rank // per_node if per_node else 0


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


def unchecked():
    """A context in which this rank's collectives skip the pool's mismatch check (see collective_check)."""
    from workbench.pool.collective_check import unchecked as _unchecked

    return _unchecked()
