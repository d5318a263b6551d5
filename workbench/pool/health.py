"""The verdict on a session's ranks: healthy, dead, frozen, hung, or left waiting on a failed one.

A pure function of what the notebook knows (each rank's state, the exit
codes and a sample of the processes of local ranks, the commands in flight)
and of the time: no sockets, no processes, so every rule is tested with
made-up states. The transport runs it a few times a second and acts on the
answer: ask ranks where they are, or break the pool with an error that names
the rank and what it was doing, instead of leaving the notebook waiting for
a collective's timeout (gloo's default: 30 minutes).

Frozen or slow. Each rank's I/O thread sends a heartbeat every 0.25 s. It is
a Python thread, so it runs whenever the main thread lets go of the GIL:
torch's kernels and collectives release it, and a pure-Python loop hands it
over every 5 ms (`sys.getswitchinterval()`), so a rank that computes keeps
beating. Only C code that holds the GIL (a long regex, `sum` over a huge
range, an extension that does not release it) or a stopped process silence
it. So silence alone does not condemn a rank: after `frozen_after_s` of it
the notebook reads the process's state from /proc. Stopped (SIGSTOP, a
debugger), or asleep without using CPU since its last heartbeat (deadlocked):
frozen, reported at once. Running, in I/O, or using CPU: alive, only slow,
and judged like any rank by `timeout_s` (a rank stuck in a collective keeps
beating and is reported there, as before).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.pool.commands import Command, remote_error
from workbench.pool.errors import CollectiveTimeout, PoolError, RankFrozen, WorkerDied
from workbench.pool.roster import RankState

HEARTBEAT_S = 0.25
"""How often ranks and driver tell each other they are alive."""

Explain = Callable[[dict[int, dict[str, Any]]], "str | None"]
"""Turns every answering rank's diagnostics into one summary line (e.g. which collective each waits in)."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    """A rank running a command without any sign of progress for this long is stuck."""
    heartbeat_timeout_s: float
    """A rank whose process the notebook cannot see (on another machine) silent for this long is dead."""
    frozen_after_s: float = 2.0
    """A local rank silent this long has its process looked at: stopped, or asleep using no CPU, is frozen."""
    waiting_cpu: float = 0.1
    """A rank using less than this fraction of a core is waiting, not working."""
    error_grace_s: float = 1.0
    """After one rank fails, how long the others get to finish before we look at whether they wait on it."""
    disconnect_grace_s: float = 0.5
    """A local rank whose connection closed gets this long for its exit code to show before it is declared dead."""
    answer_s: float = 0.5
    """How long ranks asked where they are get to answer before the verdict is given without them."""


@dataclass(frozen=True)
class ProcessSample:
    """A local rank's process as the kernel sees it (/proc/PID/stat), read when its heartbeats stop."""

    state: str
    """R running, S sleeping, D in I/O, T stopped, t traced, Z zombie, ..."""
    cpu_s: float
    """User + system CPU seconds so far, the measure of the heartbeats' `cpu_s`."""

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")


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


def silent(ranks: Mapping[int, RankState], now: float, limits: Limits) -> list[int]:
    """Local ranks whose heartbeats stopped `frozen_after_s` ago: the ones whose process to sample."""
    return [r for r, link in ranks.items() if link.local and now - link.last_heartbeat > limits.frozen_after_s]


def judge(ranks: Mapping[int, RankState], exits: Mapping[int, int | None], samples: Mapping[int, ProcessSample],
          commands: Iterable[Command], now: float, limits: Limits, asked_at: float | None,
          explain: Explain | None = None) -> Verdict:
    """The verdict at time `now`. `exits`: local ranks' exit codes (None while running); `samples`: the processes
    of the `silent` ranks; `asked_at`: when the ranks of the last `AskWhere` were asked (None: no open question)."""
    for r, code in exits.items():
        if code is not None:
            return Broken(WorkerDied(r, code))
    for link in ranks.values():
        gone = link.disconnected_at
        if gone is not None and (not link.local or now - gone > limits.disconnect_grace_s):
            return Broken(WorkerDied(link.rank, None, "its connection to the notebook closed"))
        quiet = now - link.last_heartbeat
        if not link.local and quiet > limits.heartbeat_timeout_s:
            return Broken(WorkerDied(link.rank, None, f"no heartbeat for {quiet:.1f} s"))
    commands = list(commands)
    for command in commands:
        if command.first_error_at is not None and now - command.first_error_at > limits.error_grace_s:
            left = _left_waiting(ranks, command, limits)
            if left is not None:
                return left
    frozen = {r: how for r in sorted(ranks) if (how := _frozen(ranks[r], samples.get(r), now, limits))}
    stuck = [r for r, link in sorted(ranks.items()) if link.outstanding and now - link.last_activity > limits.timeout_s]
    if not frozen and not stuck:
        return Healthy()
    # Everyone says where it is (the frozen cannot; their silence through the wait confirms them).
    asked = tuple(sorted(ranks)) if frozen else tuple(stuck)
    if asked_at is None:
        return AskWhere(asked)
    answering = [r for r in asked if r not in frozen]
    if now < asked_at + limits.answer_s and not all(ranks[r].stack for r in answering):
        return Waiting()
    if frozen:
        culprit = next(iter(frozen))
        others = [ranks[r] for r in answering]
        return Broken(RankFrozen(culprit, now - ranks[culprit].last_heartbeat, frozen[culprit],
                                 _doing(ranks[culprit], commands, now), _where(others, limits),
                                 _diagnostics(others), _explain(explain, others)))
    return Broken(_timed_out([ranks[r] for r in stuck], now, limits, explain))


def _frozen(link: RankState, sample: ProcessSample | None, now: float, limits: Limits) -> str | None:
    """How a rank is frozen ("its process is stopped", ...), or None if it is alive."""
    quiet = now - link.last_heartbeat
    if not link.local or quiet <= limits.frozen_after_s:
        return None
    if sample is None:  # no /proc: only a long silence tells
        return "its heartbeats stopped" if quiet > limits.heartbeat_timeout_s else None
    if sample.stopped:
        return "its process is stopped (SIGSTOP or a debugger)"
    used = sample.cpu_s - (link.cpu[-1][1] if link.cpu else 0.0)
    if sample.state in ("S", "I") and used < limits.waiting_cpu * quiet:
        return f"its process sleeps and used {used:.2f} s of CPU since (deadlocked?)"
    return None  # running, in I/O or computing: C code holding the GIL is slow, not frozen


def _left_waiting(ranks: Mapping[int, RankState], command: Command, limits: Limits) -> Broken | None:
    """One rank failed; if every rank still running only waits, it waits for the failed one."""
    rates = {r: ranks[r].cpu_rate() for r in command.ranks if r in ranks}
    if all(rate is not None and rate < limits.waiting_cpu for rate in rates.values()):
        note = (f"Ranks {sorted(rates)} were left waiting for rank {min(command.errors)} (idle, most likely in a "
                "collective it never joined), so the pool was stopped: call restart().")
        return Broken(remote_error(command, note))
    return None


def _timed_out(stuck: list[RankState], now: float, limits: Limits, explain: Explain | None) -> CollectiveTimeout:
    working = [link.rank for link in stuck if not _waiting(link, limits)]
    culprit = (working or [stuck[0].rank])[0]
    return CollectiveTimeout(culprit, limits.timeout_s, [link.rank for link in stuck], _where(stuck, limits),
                             _diagnostics(stuck), _explain(explain, stuck))


def _waiting(link: RankState, limits: Limits) -> bool:
    rate = link.cpu_rate()
    return rate is not None and rate < limits.waiting_cpu


def _doing(link: RankState, commands: list[Command], now: float) -> str:
    """What a rank was running: its oldest unanswered command and for how long."""
    by_id = {c.id: c for c in commands}
    command = by_id.get(link.outstanding[0]) if link.outstanding else None
    if command is None:
        return "no command (idle)"
    return f"`{command.name}` (command #{command.id}, sent {now - command.sent_at:.1f} s ago)"


def _where(links: list[RankState], limits: Limits) -> str:
    """Per rank: waiting or busy, the end of its stack, and what its diagnostic providers said."""
    lines = []
    for link in links:
        rate = link.cpu_rate()
        state = "waiting" if _waiting(link, limits) else "busy"
        where = _frames(link.stack) if link.stack else ["(no stack received)"]
        lines.append(f"rank {link.rank}: {state} (cpu {rate if rate is not None else float('nan'):.2f} cores), at:\n    "
                     + "\n    ".join(where))
        for name, value in (link.diagnostics or {}).items():
            # A sentence is shown; structured answers are data for the summary line, kept in error.diagnostics.
            shown = value if isinstance(value, str) else f"(data: error.diagnostics[{link.rank}][{name!r}])"
            lines.append(f"    {name}: {shown}")
    return "\n".join(lines)


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code> {4}\S[^\n]*\n)?')


def _frames(stack: str, shown: int = 6) -> list[str]:
    """A formatted stack as one line per frame (`function (file:line): code`), from the command the rank runs
    (frames of the worker's own loop left out): its outermost frames and its innermost, where it waits."""
    frames = [(m["fn"], f"{m['fn']} ({Path(m['file']).name}:{m['line']}): {(m['code'] or '').strip()}")
              for m in _FRAME.finditer(stack)]
    if not frames:
        return stack.rstrip().splitlines()[-shown:]
    loop = max((i for i, (fn, _) in enumerate(frames) if fn == "command_loop"), default=-1)
    lines = [line for _, line in frames[loop + 1:]] or [line for _, line in frames]
    if len(lines) > shown:
        lines = lines[:2] + [f"... {len(lines) - shown + 1} frames ..."] + lines[-(shown - 3):]
    return lines


def _diagnostics(links: list[RankState]) -> dict[int, dict[str, Any]]:
    return {link.rank: link.diagnostics for link in links if link.diagnostics}


def _explain(explain: Explain | None, links: list[RankState]) -> str | None:
    if explain is None:
        return None
    try:
        return explain(_diagnostics(links))
    except Exception as e:  # noqa: BLE001 - a failing explanation must not hide the verdict
        return f"(the diagnosis could not be summarised: {type(e).__name__}: {e})"
