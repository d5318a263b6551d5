"""A crashed rank's last words, condensed for its report: the Python stacks faulthandler printed and the native
stack of the thread that crashed, which torch's fatal-signal handler printed beside every other thread's.

A rank prints both on a fatal signal (worker.main enables faulthandler, world.prepare torch's handler), in either
order. faulthandler prints every Python thread's stack and marks the one that crashed "Current thread" — if it
runs Python. A crash in a thread that runs none (gloo's worker, an OpenMP thread, a collective's completion
callback) leaves every Python stack unmarked: the main thread is only waiting, and where the crash was is in that
thread's native frames alone. The other threads' native stacks are waits; the report leaves them out.
"""

from __future__ import annotations

import re

NATIVE_HEADER = re.compile(r"^(SIG[A-Z0-9]+)\(\d+\), PID: \d+, Thread (\d+):")
"""torch's (c10's FatalSignalHandler) header of one thread's native stack."""
CRASHED_FRAME = "FatalSignalHandler::fatalSignalHandler"
"""The frame only the crashing thread's stack holds: the handler ran on that thread."""
NATIVE_FRAMES = 24
"""Frames of the crashing thread kept (below the handler's own): enough to name the library and the call."""


def _split(lines: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(native blocks as (thread id, frames), every other line in order)."""
    blocks: list[tuple[str, list[str]]] = []
    rest: list[str] = []
    i = 0
    while i < len(lines):
        header = NATIVE_HEADER.match(lines[i])
        if not header:
            rest.append(lines[i])
            i += 1
            continue
        frames, i = [], i + 1
        while i < len(lines) and lines[i].strip().startswith(("frame #", "<omitting")):
            frames.append(lines[i].strip())
            i += 1
        if i < len(lines) and not lines[i].strip():
            i += 1  # the blank line that ends a block
        blocks.append((header.group(2), frames))
    return blocks, rest


def condense(lines: list[str], keep: int) -> list[str]:
    """The report of a rank's stderr tail `lines`: the crashing thread's native frames (when torch printed them),
    saying whether that thread runs Python, then the last `keep` lines that are not native stacks."""
    blocks, rest = _split(lines)
    rest = rest[-keep:]
    crashed = next(((tid, frames) for tid, frames in blocks if any(CRASHED_FRAME in f for f in frames)), None)
    if crashed is None:
        return rest
    tid, frames = crashed
    # The handler's frames and the signal trampoline under them say nothing of where the crash was.
    below = next(i for i, f in enumerate(frames) if CRASHED_FRAME in f) + 1
    frames = frames[below + 1:]
    # Where faulthandler ran first, it raised the signal again from the crashing thread: its raise and that
    # second trampoline sit above the crash.
    raised = next((i for i, f in enumerate(frames[:3]) if re.search(r": (gsignal|raise|pthread_kill)\b", f)), None)
    if raised is not None:
        frames = frames[raised + 2:]
    frames = frames[:NATIVE_FRAMES]
    runs_python = any(line.startswith("Current thread ") for line in rest)
    where = ("a thread that runs Python: its Python stack is the one marked 'Current thread' below" if runs_python
             else "a thread that runs no Python (gloo's worker, an OpenMP thread, a completion callback): the Python "
                  "stacks below only waited")
    return [f"The native stack of the thread that crashed (thread {tid}), {where}:", *frames, "", *rest]
