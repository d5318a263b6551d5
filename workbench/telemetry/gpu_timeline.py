"""From CUDA event marks to intervals on the rank's clock: pairing, queue order, clock mapping, late marks.

On a GPU every span of a step (forward, backward, optimizer on the compute
stream; each collective on the stream NCCL ran it on) is two *marks*: CUDA
events recorded on a stream, one before the work and one after it. Nothing
waits for them while the step runs. At step end the marks the GPU has passed
are read back (``cuda.read_marks``, never blocking) as raw readings: GPU
milliseconds from an anchor event whose host time is known. This module is
the logic that turns those readings into `Interval` records, kept apart from
CUDA so it is tested on CPU with synthetic readings:

- clock: ``host_ns = anchor_ns + round(elapsed_ms * 1e6)`` (the anchor is the
  host time of an event on the same GPU clock; see ``extensions/cuda/marks.cu``);
- pairing: a span resolves when both its marks are done; until then it stays
  pending and is tried again at the next step end (a late span is reported
  with the step that finds it done, at its true GPU time);
- queue order: collectives of one process group run one after another on the
  group's NCCL stream, which also waits for the caller's stream. The start
  mark is recorded on the caller's stream before the collective is issued, so
  it says when the collective became *able* to start; it really starts when
  the previous collective of its queue has ended too:
  ``start = max(start mark, end of the previous span in the same queue)``.
  A span waits for the spans before it in its queue, so that rule always sees
  its predecessor's end;
- failures: a mark the GPU library does not know or could not time (an error)
  drops its span (counted, never guessed); a span still pending after
  ``max_pending_resolves`` step ends is dropped as lost (counted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from workbench.telemetry.events import Interval, IntervalKind

MarkState = Literal["done", "pending", "error", "unknown"]


@dataclass(frozen=True, slots=True)
class MarkReading:
    """What the GPU library says about one mark now."""

    mark: int
    state: MarkState
    anchor_ns: int = 0
    """Host time (monotonic ns) of the anchor event the mark is measured from."""
    elapsed_ms: float = 0.0
    """GPU time from the anchor to the mark, as cudaEventElapsedTime gives it (float milliseconds)."""
    error: int = 0
    """The cudaError_t of an "error" reading."""

    @property
    def host_ns(self) -> int:
        """The mark on the rank's monotonic clock."""
        if self.state != "done":
            raise ValueError(f"mark {self.mark} is {self.state}: it has no time")
        return self.anchor_ns + round(self.elapsed_ms * 1e6)


@dataclass(frozen=True, slots=True)
class MarkedSpan:
    """A span whose ends are two marks, as the recording backend or a probe left it."""

    kind: IntervalKind
    name: str
    start_mark: int
    end_mark: int
    bytes: int = 0
    group_size: int = 1
    stream: str = "main"
    group: str = ""
    queue: str = ""
    """Spans sharing a queue ran one after another on one stream (a process group's NCCL stream), in the
    order they were issued; "" when nothing orders the span against others."""


@dataclass
class TimelineCounts:
    """What could not be turned into intervals, since the timeline began."""

    failed: int = 0
    """Spans dropped because a mark was unknown or its event failed."""
    lost: int = 0
    """Spans dropped because a mark was still pending after `max_pending_resolves` step ends."""
    clamped: int = 0
    """Spans whose mapped end fell before their start (float rounding) and were cut to zero length."""


Reader = Callable[[list[int]], dict[int, MarkReading]]
Releaser = Callable[[list[int]], None]


@dataclass
class _Pending:
    span: MarkedSpan
    seq: int
    resolves: int = 0


class GpuTimeline:
    """Marked spans in, intervals out, as the GPU passes their marks.

    ``read(marks)`` returns a reading per mark and must release the marks it reports done or failed (the
    GPU library's ``release_done``); ``release(marks)`` forgets marks of spans dropped unread.
    """

    def __init__(self, read: Reader, release: Releaser, max_pending_resolves: int = 8) -> None:
        if max_pending_resolves < 1:
            raise ValueError(f"max_pending_resolves must be >= 1, got {max_pending_resolves}")
        self._read, self._release = read, release
        self.max_pending_resolves = max_pending_resolves
        self._pending: list[_Pending] = []
        self._readings: dict[int, MarkReading] = {}  # final readings of marks whose span is not resolved yet
        self._queue_end: dict[str, int] = {}
        self._seq = 0
        self.counts = TimelineCounts()

    @property
    def pending(self) -> int:
        """Spans added and neither resolved nor dropped yet."""
        return len(self._pending)

    def add(self, spans: Iterable[MarkedSpan]) -> None:
        """Spans in the order they were issued (the order the recorder drained them)."""
        for span in spans:
            self._pending.append(_Pending(span, self._seq))
            self._seq += 1

    def discard(self, spans: Iterable[MarkedSpan]) -> None:
        """Spans that belong to no step (between steps): their marks are released, nothing is reported."""
        marks = [m for s in spans for m in (s.start_mark, s.end_mark)]
        if marks:
            self._release(marks)

    def resolve(self) -> list[Interval]:
        """Intervals of every span whose marks are done now, sorted by start; the rest stay pending."""
        wanted = sorted({m for p in self._pending for m in (p.span.start_mark, p.span.end_mark)
                         if m not in self._readings})
        if wanted:
            got = self._read(wanted)
            for mark in wanted:
                reading = got.get(mark, MarkReading(mark, "unknown"))
                if reading.state != "pending":
                    self._readings[mark] = reading
        out: list[Interval] = []
        blocked: set[str] = set()  # queues whose earliest span is still pending
        keep: list[_Pending] = []
        for p in sorted(self._pending, key=lambda p: p.seq):
            s = p.span
            a, b = self._readings.get(s.start_mark), self._readings.get(s.end_mark)
            if (a is not None and a.state != "done") or (b is not None and b.state != "done"):
                self.counts.failed += 1
                self._drop(s)
                continue
            if a is None or b is None or (s.queue and s.queue in blocked):
                p.resolves += 1
                if p.resolves >= self.max_pending_resolves:
                    self.counts.lost += 1
                    self._drop(s)
                    continue
                if s.queue:
                    blocked.add(s.queue)
                keep.append(p)
                continue
            start, end = a.host_ns, b.host_ns
            if s.queue:
                start = max(start, self._queue_end.get(s.queue, start))
            if end < start:
                self.counts.clamped += 1
                end = start
            if s.queue:
                self._queue_end[s.queue] = max(end, self._queue_end.get(s.queue, end))
            self._forget(s)
            out.append(Interval(s.kind, s.name, start, end, bytes=s.bytes, group_size=s.group_size,
                                stream=s.stream, group=s.group))
        self._pending = keep
        out.sort(key=lambda iv: iv.start_ns)
        return out

    def _drop(self, span: MarkedSpan) -> None:
        # The other mark may still be live in the GPU library; releasing a released one is harmless.
        self._forget(span)
        self._release([span.start_mark, span.end_mark])

    def _forget(self, span: MarkedSpan) -> None:
        self._readings.pop(span.start_mark, None)
        self._readings.pop(span.end_mark, None)
