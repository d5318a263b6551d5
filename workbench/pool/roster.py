"""What the notebook knows about each rank of the current session: plain data, read by the health verdict."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankState:
    """One rank of the current session, as its messages have shown it."""

    rank: int
    incarnation: str
    main_id: bytes
    pid: int
    host: str
    local: bool = False
    """Started by this notebook: its process can be polled (exit code, stopped or running)."""
    io_id: bytes | None = None
    ready: bool = False
    device: str = ""
    backend: str = ""
    last_activity: float = field(default_factory=time.monotonic)
    """When it last showed progress on a command (a result, an event, output, `rank.progress()`)."""
    last_heartbeat: float = field(default_factory=time.monotonic)
    cpu: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    """(when, process CPU seconds) from its heartbeats."""
    outstanding: collections.deque = field(default_factory=collections.deque)
    """Ids of the commands sent to it and not answered yet, oldest first."""
    stack: str | None = None
    """Its main thread's stack, when asked where it is."""
    diagnostics: dict[str, Any] | None = None
    """What its diagnostic providers said, when asked where it is (see `workbench.pool.rank.add_diagnostic`)."""
    disconnected_at: float | None = None
    ready_at: float | None = None
    timeline: dict[str, float] = field(default_factory=dict)
    """When each step of its start happened, by its own clock (time.monotonic: the machine's, for local ranks)."""

    def cpu_rate(self, window_s: float = 1.0) -> float | None:
        """Cores used over about the last second, from heartbeat CPU stamps; None if too few stamps."""
        if len(self.cpu) < 2:
            return None
        t1, c1 = self.cpu[-1]
        older = [(t, c) for t, c in self.cpu if t1 - t >= window_s * 0.8]
        if not older:
            return None
        t0, c0 = older[-1]
        return (c1 - c0) / max(t1 - t0, 1e-6)
