"""The verdict on a session's ranks: healthy, dead, hung, or left waiting on a failed one.

A pure function of what the notebook knows (each rank's state, the exit
codes of local processes, the commands in flight) and of the time: no
sockets, no processes, so every rule is tested with made-up states. The
transport runs it a few times a second and acts on the answer: ask stuck
ranks where they are, or break the pool with an error that names the rank
and what it was doing, instead of leaving the notebook waiting for a
collective's timeout (gloo's default: 30 minutes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from workbench.pool.commands import Command, remote_error
from workbench.pool.errors import CollectiveTimeout, PoolError, WorkerDied
from workbench.pool.roster import RankState

HEARTBEAT_S = 0.25
"""How often ranks and driver tell each other they are alive."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    """A rank running a command without any sign of progress for this long is stuck."""
    heartbeat_timeout_s: float
    """A rank on another machine silent for this long is dead."""
    waiting_cpu: float = 0.1
    """A rank using less than this fraction of a core is waiting, not working."""
    error_grace_s: float = 1.0
    """After one rank fails, how long the others get to finish before we look at whether they wait on it."""
    disconnect_grace_s: float = 0.5
    """A local rank whose connection closed gets this long for its exit code to show before it is declared dead."""
    answer_s: float = 0.5
    """How long ranks asked where they are get to answer before the verdict is given without them."""


@dataclass(frozen=True)
class Healthy:
    """Nothing wrong (or nothing to decide yet)."""


@dataclass(frozen=True)
class AskWhere:
    """Ask these ranks for their stack and diagnostics, then judge again."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Waiting:
    """Asked ranks have not all answered yet: judge again soon."""


@dataclass(frozen=True)
class Broken:
    """Stop every rank: `error` says which one and why."""

    error: PoolError


Verdict = Healthy | AskWhere | Waiting | Broken


def judge(ranks: Mapping[int, RankState], exits: Mapping[int, int | None], commands: Iterable[Command],
          now: float, limits: Limits, asked_at: float | None) -> Verdict:
    """The verdict at time `now`. `exits`: local ranks' exit codes (None while running); `asked_at`: when the
    ranks of the last `AskWhere` were asked (None if no question is open)."""
    for r, code in exits.items():
        if code is not None:
            return Broken(WorkerDied(r, code))
    for link in ranks.values():
        gone = link.disconnected_at
        if gone is not None and (not link.local or now - gone > limits.disconnect_grace_s):
            return Broken(WorkerDied(link.rank, None, "its connection to the notebook closed"))
        silent = now - link.last_heartbeat
        if not link.local and silent > limits.heartbeat_timeout_s:
            return Broken(WorkerDied(link.rank, None, f"no heartbeat for {silent:.1f} s"))
    for command in commands:
        if command.first_error_at is not None and now - command.first_error_at > limits.error_grace_s:
            left = _left_waiting(ranks, command, limits)
            if left is not None:
                return left
    return _hangs(ranks, now, limits, asked_at)


def _left_waiting(ranks: Mapping[int, RankState], command: Command, limits: Limits) -> Broken | None:
    """One rank failed; if every rank still running only waits, it waits for the failed one."""
    rates = {r: ranks[r].cpu_rate() for r in command.ranks if r in ranks}
    if all(rate is not None and rate < limits.waiting_cpu for rate in rates.values()):
        note = (f"Ranks {sorted(rates)} were left waiting for rank {min(command.errors)} (idle, most likely in a "
                "collective it never joined), so the pool was stopped: call restart().")
        return Broken(remote_error(command, note))
    return None


def _hangs(ranks: Mapping[int, RankState], now: float, limits: Limits, asked_at: float | None) -> Verdict:
    stuck = [link for link in ranks.values() if link.outstanding and now - link.last_activity > limits.timeout_s]
    if not stuck:
        return Healthy()
    if asked_at is None:
        return AskWhere(tuple(link.rank for link in stuck))
    if now < asked_at + limits.answer_s and not all(link.stack for link in stuck):
        return Waiting()
    return Broken(_diagnose(stuck, now, limits))


def _diagnose(stuck: list[RankState], now: float, limits: Limits) -> CollectiveTimeout:
    lines, frozen, working = [], [], []
    for link in stuck:
        silent = now - link.last_heartbeat
        if silent > 4 * HEARTBEAT_S:
            frozen.append(link.rank)
            lines.append(f"rank {link.rank}: not responding for {silent:.1f} s (stopped or frozen process)")
            continue
        rate = link.cpu_rate()
        waiting = rate is not None and rate < limits.waiting_cpu
        if not waiting:
            working.append(link.rank)
        where = (link.stack or "(no stack received)").rstrip().splitlines()[-4:]
        lines.append(f"rank {link.rank}: {'waiting' if waiting else 'busy'} "
                     f"(cpu {rate if rate is not None else float('nan'):.2f} cores), at:\n    "
                     + "\n    ".join(where))
    culprit = (frozen or working or [stuck[0].rank])[0]
    return CollectiveTimeout(culprit, limits.timeout_s, sorted(link.rank for link in stuck), "\n".join(lines))
