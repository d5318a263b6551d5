"""The notebook's watch over its ranks: a dead process, a silent or hung rank, ranks left waiting on a failed one.

Run by whichever thread owns the pool's sockets (see transport.py), a few
times a second and after every message. A verdict breaks the pool with an
error that names the rank and what it was doing, instead of leaving the
notebook waiting for a collective's timeout (gloo's default: 30 minutes).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from workbench.pool.errors import CollectiveTimeout, WorkerDied

if TYPE_CHECKING:
    from workbench.pool.transport import _Command, _Rank

HEARTBEAT_S = 0.25
"""How often ranks and driver tell each other they are alive."""
WAITING_CPU = 0.1
"""A rank using less than this fraction of a core is waiting, not working."""
ERROR_GRACE_S = 1.0
"""After one rank fails, how long the others get to finish before we look at whether they wait on it."""
DISCONNECT_GRACE_S = 0.5
"""A local rank whose connection closed gets this long for its exit code to show before it is declared dead."""


class HealthChecks:
    """The health checks of `Transport`, which provides the state they read (`lock`, `ranks`, `local`,
    `commands`, `broken`, `timeout_s`, `heartbeat_timeout_s`, `next_ping`, `hang_diagnosis_at`) and the
    actions they take (`break_pool`, `_send_now`, `_remote_error`)."""

    def _check_health(self) -> None:
        now = time.monotonic()
        with self.lock:
            if self.broken is not None:
                return
            for r, proc in (self.local or {}).items():
                code = proc.poll()
                if code is not None:
                    return self.break_pool(WorkerDied(r, code))
            for link in list(self.ranks.values()):
                gone = link.disconnected_at
                if gone is not None and (link.proc is None or now - gone > DISCONNECT_GRACE_S):
                    return self.break_pool(WorkerDied(link.rank, None, "its connection to the notebook closed"))
                if link.proc is None and now - link.last_heartbeat > self.heartbeat_timeout_s:
                    return self.break_pool(WorkerDied(link.rank, None, f"no heartbeat for "
                                                                       f"{now - link.last_heartbeat:.1f} s"))
            if now >= self.next_ping:
                self.next_ping = now + HEARTBEAT_S
                for link in self.ranks.values():
                    if link.io_id is not None:
                        self._send_now(link.io_id, {"type": "ping"})
            for command in list(self.commands.values()):
                if command.first_error_at is not None and now - command.first_error_at > ERROR_GRACE_S:
                    self._check_left_waiting(command)
            self._check_hangs(now)

    def _check_left_waiting(self, command: _Command) -> None:
        """One rank failed; if every rank still running only waits, it waits for the failed one."""
        rates = {r: self.ranks[r].cpu_rate() for r in command.ranks}
        if all(rate is not None and rate < WAITING_CPU for rate in rates.values()):
            note = (f"Ranks {sorted(rates)} were left waiting for rank {min(command.errors)} (idle, most likely in a "
                    "collective it never joined), so the pool was stopped: call restart().")
            self.break_pool(self._remote_error(command, note))

    def _check_hangs(self, now: float) -> None:
        stuck = [link for link in self.ranks.values()
                 if link.outstanding and now - link.last_activity > self.timeout_s]
        if not stuck:
            self.hang_diagnosis_at = None
            return
        if self.hang_diagnosis_at is None:
            # Ask the stuck ranks where they are, give them a moment to answer, then decide.
            for link in stuck:
                link.stack = None
                if link.io_id is not None:
                    self._send_now(link.io_id, {"type": "stack"})
            self.hang_diagnosis_at = now + 0.5
            return
        if now < self.hang_diagnosis_at and not all(link.stack for link in stuck):
            return
        self.break_pool(self._diagnose(stuck, now))

    def _diagnose(self, stuck: list[_Rank], now: float) -> CollectiveTimeout:
        lines, frozen, working = [], [], []
        for link in stuck:
            silent = now - link.last_heartbeat
            if silent > 4 * HEARTBEAT_S:
                frozen.append(link.rank)
                lines.append(f"rank {link.rank}: not responding for {silent:.1f} s (stopped or frozen process)")
                continue
            rate = link.cpu_rate()
            waiting = rate is not None and rate < WAITING_CPU
            if not waiting:
                working.append(link.rank)
            where = (link.stack or "(no stack received)").rstrip().splitlines()[-4:]
            lines.append(f"rank {link.rank}: {'waiting' if waiting else 'busy'} "
                         f"(cpu {rate if rate is not None else float('nan'):.2f} cores), at:\n    "
                         + "\n    ".join(where))
        culprit = (frozen or working or [stuck[0].rank])[0]
        return CollectiveTimeout(culprit, self.timeout_s, sorted(link.rank for link in stuck), "\n".join(lines))
