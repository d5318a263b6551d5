"""What ranks did beside their steps' compute and communication, as spans on their clock: checkpoint saves and
torch.compile compilations, cut into the parts a timeline draws.

A blocking save holds training from its start until it is durable; an asynchronous one only until its state is
staged in host memory, and is then written in the background while training goes on: two spans, so the timeline
shows what the training thread paid and what overlapped it. A compilation is one span (its start and end events
merged by the store); one still running has no end and is not drawn (the status line says "compiling").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from workbench.telemetry.events import CheckpointSave, Compilation

COMPILING = "compiling"
SAVE_HELD = "checkpoint: training held"
SAVE_BACKGROUND = "checkpoint: background write"
KINDS = (COMPILING, SAVE_HELD, SAVE_BACKGROUND)


@dataclass(frozen=True, slots=True)
class Span:
    """One drawn span on one rank (nanoseconds of its monotonic clock, as `Interval`)."""

    rank: int
    kind: str
    """One of KINDS."""
    start_ns: int
    end_ns: int
    detail: str
    """What it was, for the hover: the compiled frame, or the checkpoint and its bytes."""


def save_spans(save: CheckpointSave) -> list[Span]:
    """The part of a save that held training, and for an asynchronous save its background write."""
    outcome = f"failed: {save.error}" if save.error else (
        f"{save.bytes_written:,} B written, {save.bytes_reused:,} B already stored")
    detail = f"step-{save.step} ({'async' if save.asynchronous else 'blocking'}) · {outcome}"
    held = Span(save.rank, SAVE_HELD, save.start_ns, save.staged_ns, detail)
    if not save.asynchronous or save.durable_ns <= save.staged_ns:
        return [held]
    return [held, Span(save.rank, SAVE_BACKGROUND, save.staged_ns, save.durable_ns, detail)]


def compile_span(compilation: Compilation) -> Span | None:
    """A finished compilation's span; None while it runs."""
    if compilation.end_ns is None:
        return None
    return Span(compilation.rank, COMPILING, compilation.start_ns, compilation.end_ns,
                f"frame {compilation.compile_id} ({compilation.trigger})")


def spans_within(saves: Iterable[CheckpointSave], compilations: Iterable[Compilation], start_ns: int,
                 end_ns: int) -> list[Span]:
    """Every span that overlaps [start_ns, end_ns] (a step's window), whole: a background write that began in an
    earlier step and goes on after this one is drawn across it."""
    out = [s for save in saves for s in save_spans(save)]
    out += [s for c in compilations if (s := compile_span(c)) is not None]
    return sorted((s for s in out if s.start_ns <= end_ns and s.end_ns >= start_ns),
                  key=lambda s: (s.rank, s.start_ns))
