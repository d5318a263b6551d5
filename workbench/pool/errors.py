"""What can go wrong on the ranks, as the notebook sees it."""

from __future__ import annotations

import signal
from typing import Any


class PoolError(RuntimeError):
    """Base of every error the pool raises about its ranks."""


class WorkerDied(PoolError):
    """A rank's process ended while the pool needed it."""

    def __init__(self, rank: int, exitcode: int | None = None, detail: str = "",
                 last_words: tuple[str, ...] = ()) -> None:
        self.rank, self.exitcode, self.detail = rank, exitcode, detail
        self.last_words = last_words
        """What the rank wrote last to its stderr file descriptor: a crash's report (every thread's Python stack on
        a segmentation fault), C++ messages."""
        how = describe_exit(exitcode) if exitcode is not None else "lost contact"
        said = "\nIts last words on stderr:\n" + "\n".join(f"  {line}" for line in last_words) if last_words else ""
        super().__init__(f"rank {rank} died ({how}){': ' + detail if detail else ''}. "
                         f"The other ranks were stopped; call restart() for a fresh pool.{said}")

    def with_last_words(self, lines: list[str]) -> "WorkerDied":
        """The same death, with what the rank wrote last to its stderr."""
        return WorkerDied(self.rank, self.exitcode, self.detail, tuple(lines)) if lines else self

    @property
    def signal(self) -> str | None:
        if self.exitcode is not None and self.exitcode < 0:
            return signal.Signals(-self.exitcode).name
        return None


class RemoteError(PoolError):
    """An exception raised on a rank; carries that rank's traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str, note: str = "") -> None:
        self.rank, self.exc_type, self.remote_message = rank, exc_type, message
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n\n--- traceback on rank {rank} ---\n"
                         f"{remote_traceback.rstrip()}{chr(10) + note if note else ''}")


class CollectiveTimeout(PoolError):
    """Ranks made no progress for the pool's timeout: stuck in a collective or in user code, but alive."""

    def __init__(self, rank: int, timeout_s: float, ranks: list[int], detail: str,
                 diagnostics: dict[int, dict[str, Any]] | None = None, explanation: str | None = None) -> None:
        self.rank, self.timeout_s, self.ranks = rank, timeout_s, ranks
        self.diagnostics = diagnostics or {}
        """What each rank's diagnostic providers said (`workbench.pool.rank.add_diagnostic`), by rank."""
        summary = f"{explanation}\n" if explanation else ""
        super().__init__(f"rank {rank} made no progress for {timeout_s:g} s (ranks stuck: {ranks}).\n{summary}"
                         f"{detail}\nThe pool was stopped; call restart() for a fresh pool.")


class RankFrozen(PoolError):
    """A rank stopped answering: no heartbeat, and its process stopped or asleep without using any CPU."""

    def __init__(self, rank: int, silent_s: float, how: str, doing: str, detail: str,
                 diagnostics: dict[int, dict[str, Any]] | None = None, explanation: str | None = None) -> None:
        self.rank, self.silent_s = rank, silent_s
        self.diagnostics = diagnostics or {}
        """What the other ranks' diagnostic providers said, by rank (a frozen rank cannot answer)."""
        summary = f"{explanation}\n" if explanation else ""
        super().__init__(f"rank {rank} is not responding: no heartbeat for {silent_s:.1f} s and {how}; it was "
                         f"running {doing}.\n{summary}{detail}\nThe pool was stopped; call restart() for a fresh pool.")


class PoolBroken(PoolError):
    """The pool cannot run commands until restart()."""


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
