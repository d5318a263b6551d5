"""A crashed rank's last words, condensed for its report: the Python stacks faulthandler printed and the native
stack of the thread that crashed, which torch's fatal-signal handler printed beside every other thread's.

A rank prints both on a fatal signal (worker.main enables faulthandler, world.prepare torch's handler), in either
order. faulthandler prints every Python thread's stack and marks the one that crashed "Current thread" — if it
runs Python. A crash in a thread that runs none (gloo's worker, an OpenMP thread, a collective's completion
callback) leaves every Python stack unmarked: the main thread is only waiting, and where the crash was is in that
thread's native frames alone. The other threads' native stacks are waits; the report leaves them out.

torch's handler symbolizes with malloc: after a crash that corrupted the heap it aborts before it reaches the
crashing thread. Ranks with the recording backend also print that thread's frames from the extension, first and
without allocating (extensions/telemetry/crash_frames.h); the report takes them where torch's are missing.
"""

from __future__ import annotations

import re

NATIVE_HEADER = re.compile(r"^(SIG[A-Z0-9]+)\(\d+\), PID: \d+, Thread (\d+):")
"""torch's (c10's FatalSignalHandler) header of one thread's native stack."""
OWN_HEADER = re.compile(r"^workbench: native frames of the crashing thread \(thread (\d+), signal \d+\):")
"""The recording extension's header (extensions/telemetry/crash_frames.h): the crashing thread's frames, printed
without allocating, so they are there when a corrupted heap stopped torch's handler before that thread."""
CRASHED_FRAME = "FatalSignalHandler::fatalSignalHandler"
"""The frame only the crashing thread's stack holds: the handler ran on that thread."""
NATIVE_FRAMES = 24
"""Frames of the crashing thread kept (below the handler's own): enough to name the library and the call."""


def _split(lines: list[str]) -> tuple[list[tuple[str, list[str]]], tuple[str, list[str]] | None, list[str]]:
    """(torch's native blocks as (thread id, frames), the extension's block of the crashing thread or None, every
    other line in order)."""
    blocks: list[tuple[str, list[str]]] = []
    own = None
    rest: list[str] = []
    i = 0
    while i < len(lines):
        header, own_header = NATIVE_HEADER.match(lines[i]), OWN_HEADER.match(lines[i])
        if not header and not own_header:
            rest.append(lines[i])
            i += 1
            continue
        frames, i = [], i + 1
        while i < len(lines) and lines[i].strip() and (own_header or lines[i].strip().startswith(("frame #",
                                                                                                  "<omitting"))):
            frames.append(lines[i].strip())
            i += 1
        if i < len(lines) and not lines[i].strip():
            i += 1  # the blank line that ends a block
        if own_header:
            own = (own_header.group(1), frames)
        else:
            blocks.append((header.group(2), frames))
    return blocks, own, rest


def _below_the_handlers(frames: list[str], handler_frames: int) -> list[str]:
    """The crashing thread's frames under the signal handlers: the handler's own `handler_frames` and the signal
    trampoline under them dropped, and, where faulthandler ran first and raised the signal again from that
    thread, its raise and the second trampoline too."""
    frames = frames[handler_frames + 1:]
    raised = next((i for i, f in enumerate(frames[:3]) if re.search(r"\b(gsignal|raise|pthread_kill)\b", f)), None)
    if raised is not None:
        frames = frames[raised + 2:]
    return frames[:NATIVE_FRAMES]


def condense(lines: list[str], keep: int) -> list[str]:
    """The report of a rank's stderr tail `lines`: the crashing thread's native frames (torch's, demangled, or the
    extension's where torch's handler died first), saying whether that thread runs Python, then the last `keep`
    lines that are neither."""
    blocks, own, rest = _split(lines)
    rest = rest[-keep:]
    torchs = next(((tid, frames) for tid, frames in blocks if any(CRASHED_FRAME in f for f in frames)), None)
    if torchs is not None:
        tid, frames = torchs
        frames = _below_the_handlers(frames, next(i for i, f in enumerate(frames) if CRASHED_FRAME in f) + 1)
    elif own is not None:
        tid, frames = own[0], _below_the_handlers(own[1], 1)
    else:
        return rest
    runs_python = any(line.startswith("Current thread ") for line in rest)
    where = ("a thread that runs Python: its Python stack is the one marked 'Current thread' below" if runs_python
             else "a thread that runs no Python (gloo's worker, an OpenMP thread, a completion callback): the Python "
                  "stacks below only waited")
    return [f"The native stack of the thread that crashed (thread {tid}), {where}:", *frames, "", *rest]
