"""A process's short name, as `top`, `ps -o comm`, `pgrep` and `/proc/PID/comm` show it: "wb-rank-3" and
"wb-zygote" instead of a row of identical "python"s, so a user can tell which rank is busy, or whether anything
is left running (`pgrep -l wb-`). Linux only (prctl); elsewhere nothing changes."""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15
MAX_BYTES = 15
"""The kernel keeps 15 bytes of a name (and a NUL)."""


def name_process(name: str) -> None:
    """Call from the process's main thread: PR_SET_NAME names the calling thread, the main one's is the process's."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:MAX_BYTES], 0, 0, 0)
    except (OSError, AttributeError):  # no libc symbol: leave the name as it is
        pass
