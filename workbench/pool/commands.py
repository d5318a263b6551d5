"""Commands in flight: what each rank has answered so far, and the handle a caller waits on.

A command is sent to every rank; it is done when each has answered with a
result or an error. The table is plain bookkeeping (no sockets, no threads
of its own): the transport feeds it the ranks' answers under its lock.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from workbench.pool.errors import RemoteError


@dataclass
class Command:
    id: int
    ranks: set[int]
    """The ranks that have not answered yet."""
    name: str = ""
    """What runs (the function's qualified name), for messages about a rank that hangs in it."""
    sent_at: float = field(default_factory=time.monotonic)
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, dict] = field(default_factory=dict)
    first_error_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None


def remote_error(command: Command, note: str = "") -> RemoteError:
    """The error of the lowest rank that raised in `command`, naming the other ranks that raised too."""
    first = min(command.errors)
    e = command.errors[first]
    others = sorted(set(command.errors) - {first})
    if others:
        note = f"(ranks {others} raised too.) {note}"
    return RemoteError(first, e["exc_type"], e["message"], e["traceback"], note)


class CommandTable:
    """The commands sent and not yet finished. Not thread-safe: the transport holds its lock around every call."""

    def __init__(self) -> None:
        self.pending: dict[int, Command] = {}

    def add(self, command: Command) -> None:
        self.pending[command.id] = command

    def get(self, command_id: int) -> Command | None:
        return self.pending.get(command_id)

    def values(self) -> list[Command]:
        return list(self.pending.values())

    def answer(self, rank: int, msg: dict) -> None:
        """Record rank `rank`'s result message; the command finishes once every rank has answered."""
        command = self.pending.get(msg["id"])
        if command is None or command.done.is_set():
            return
        command.ranks.discard(rank)
        if msg["ok"]:
            try:
                command.results[rank] = pickle.loads(msg["value"])
            except Exception as e:  # noqa: BLE001 - e.g. a class the notebook cannot import
                msg = {"ok": False, "exc_type": type(e).__name__, "traceback": "",
                       "message": f"the result reached the notebook but could not be unpickled here: {e}"}
        if not msg["ok"]:
            command.errors[rank] = msg
            command.first_error_at = command.first_error_at or time.monotonic()
        if not command.ranks:
            self.finish(command, remote_error(command) if command.errors else None)

    def finish(self, command: Command, failure: BaseException | None) -> None:
        command.failure = failure
        self.pending.pop(command.id, None)
        command.done.set()

    def fail_all(self, error: BaseException) -> None:
        for command in self.values():
            self.finish(command, error)


class Handle:
    """A command running on every rank; `result()` gives the per-rank values in rank order."""

    def __init__(self, command: Command, world_size: int, wait: Callable[[threading.Event, float | None], bool]) -> None:
        self._command, self._world_size, self._wait = command, world_size, wait

    def done(self) -> bool:
        return self._command.done.is_set()

    def result(self, timeout: float | None = None) -> list:
        if not self._wait(self._command.done, timeout):
            raise TimeoutError(f"the command is still running after {timeout} s (it keeps running on the ranks)")
        if self._command.failure is not None:
            raise self._command.failure
        return [self._command.results[r] for r in range(self._world_size)]
