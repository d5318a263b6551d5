"""A rank's step on a GPU, timed by the compiled CUDA library: compute marks, collective marks, device memory.

`StepProbe` uses this when its trainer runs on CUDA. Compute spans (forward,
backward, optimizer) are two CUDA event marks on the compute stream (the
stream current when the probe is called: autograd runs backward on the
forward's stream); collectives are marked by the recording backend on the
streams NCCL uses (``extensions/telemetry/completion.cpp``). Nothing waits
while the step runs: at step end `GpuTimeline` reads the marks the GPU has
passed and turns them into intervals on the rank's monotonic clock, the same
clock as every host-stamped span, so the existing overlap analysis applies
unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from workbench.telemetry import cuda, native
from workbench.telemetry.events import Interval, IntervalKind
from workbench.telemetry.gpu_timeline import GpuTimeline, MarkedSpan


class CudaStepClock:
    """Marks compute spans on the current stream and resolves them, with the backend's collectives, at step end."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        self.timeline = GpuTimeline(cuda.read_marks, cuda.release_marks)
        self.spans: list[MarkedSpan] = []
        self._open: dict[int, tuple[IntervalKind, str, int]] = {}
        self._rolling: int | None = None

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def mark(self) -> int:
        """A mark on the current stream now."""
        return cuda.mark(self.index, self._stream())

    def begin(self, kind: IntervalKind, name: str) -> int:
        start = self.mark()
        self._open[start] = (kind, name, start)
        return start

    def end(self, token: int, end_mark: int | None = None) -> None:
        kind, name, start = self._open.pop(token)
        end = self.mark() if end_mark is None else end_mark
        self.spans.append(MarkedSpan(kind, name, start, end, stream="cuda:compute"))

    def cancel(self, token: int) -> None:
        """Forget an open span (its body raised): its start mark is released, nothing is reported."""
        _, _, start = self._open.pop(token)
        cuda.release_marks([start])
        self.drop_rolling()

    @contextlib.contextmanager
    def span(self, name: str, kind: IntervalKind = "compute") -> Iterator[None]:
        token = self.begin(kind, name)
        try:
            yield
        except BaseException:
            self.cancel(token)
            raise
        self.end(token)

    def roll(self) -> None:
        """Move the rolling mark to now on the current stream (one event, re-recorded: the latest wins)."""
        if self._rolling is None:
            self._rolling = self.mark()
        else:
            cuda.mark_again(self._rolling, self._stream())

    def take_rolling(self) -> int | None:
        """The rolling mark, if moved since the last take; the caller owns it from here."""
        mark, self._rolling = self._rolling, None
        return mark

    def drop_rolling(self) -> None:
        """Release the rolling mark, if any (moved outside a backward the probe watched)."""
        if self._rolling is not None:
            cuda.release_marks([self._rolling])
            self._rolling = None

    def begin_step(self) -> None:
        """Marks left from between steps (a checkpoint, user code) belong to no step: released."""
        self.timeline.discard(native.drain_marked())
        self.timeline.discard(self.spans)
        self.drop_rolling()
        self.spans = []

    def finish(self) -> list[Interval]:
        """Every span whose marks the GPU has passed, this step's and late ones of earlier steps."""
        self.timeline.add([*self.spans, *native.drain_marked()])
        self.spans = []
        return self.timeline.resolve()


def device_memory(device: torch.device) -> dict[str, int]:
    """The device's memory as the CUDA runtime sees it (every process on the GPU), beside torch's allocator."""
    free, total = cuda.memory(device.index if device.index is not None else torch.cuda.current_device())
    return {
        "device_used": total - free,
        "device_total": total,
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
    }
