"""The stamps-to-intervals logic of the GPU path, on CPU, with a simulated GPU clock.

`FakeGpu` plays the part of ``extensions/cuda/marks.cu``: a mark is an instant
of GPU time, done once the simulated GPU has passed it, read back as float32
milliseconds from an anchor whose host time is known (exactly what
cudaEventElapsedTime and the anchor give), and released when read done.
"""

from __future__ import annotations

import struct

import pytest

from tests.telemetry import overlap_reference
from workbench.telemetry.gpu_timeline import GpuTimeline, MarkedSpan, MarkReading

MS = 1_000_000


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


class FakeGpu:
    """Marks at known GPU times; the GPU clock is host clock + `offset_ns` (any offset works)."""

    def __init__(self, offset_ns: int = 123_456_789_000, anchor_host_ns: int = 5_000 * MS) -> None:
        self.offset = offset_ns
        self.now_host = anchor_host_ns
        self.anchor = (anchor_host_ns + offset_ns, anchor_host_ns)  # (gpu ns, host ns)
        self.marks: dict[int, int] = {}  # id -> gpu ns
        self.failed: set[int] = set()
        self.next_id = 1
        self.reads: list[list[int]] = []
        self.released: list[int] = []

    def mark(self, host_ns: int) -> int:
        """A mark the GPU reaches at `host_ns` (on the host clock)."""
        mid = self.next_id
        self.next_id += 1
        self.marks[mid] = host_ns + self.offset
        return mid

    def read(self, ids: list[int]) -> dict[int, MarkReading]:
        self.reads.append(list(ids))
        out = {}
        for mid in ids:
            if mid not in self.marks:
                out[mid] = MarkReading(mid, "unknown")
                continue
            gpu_ns = self.marks[mid]
            if mid in self.failed:
                out[mid] = MarkReading(mid, "error", error=700)
            elif gpu_ns > self.now_host + self.offset:
                out[mid] = MarkReading(mid, "pending")
                continue
            else:
                ms = f32((gpu_ns - self.anchor[0]) / 1e6)
                out[mid] = MarkReading(mid, "done", anchor_ns=self.anchor[1], elapsed_ms=ms)
            del self.marks[mid]  # release_done
        return out

    def release(self, ids: list[int]) -> None:
        self.released += ids
        for mid in ids:
            self.marks.pop(mid, None)

    def timeline(self, **kw) -> GpuTimeline:
        return GpuTimeline(self.read, self.release, **kw)

    def span(self, name: str, start: int, end: int, kind="comm", queue="", **kw) -> MarkedSpan:
        return MarkedSpan(kind, name, self.mark(start), self.mark(end), queue=queue, **kw)


def test_clock_mapping_is_within_float32_resolution_of_the_truth():
    gpu = FakeGpu()
    start, end = gpu.now_host + 700 * MS + 12_345, gpu.now_host + 980 * MS + 67_891  # up to ~1 s from the anchor
    tl = gpu.timeline()
    tl.add([gpu.span("all_reduce", start, end, bytes=4096, group_size=8, stream="nccl", group="mesh_dp")])
    gpu.now_host = end + 1
    (iv,) = tl.resolve()
    # float32 ms at ~1000 ms: one ulp is 61 ns, so half an ulp of error at most.
    assert abs(iv.start_ns - start) <= 62 and abs(iv.end_ns - end) <= 62
    assert (iv.kind, iv.name, iv.bytes, iv.group_size, iv.stream, iv.group) == (
        "comm", "all_reduce", 4096, 8, "nccl", "mesh_dp")
    assert tl.pending == 0 and gpu.marks == {}


def test_reading_by_definition():
    r = MarkReading(1, "done", anchor_ns=1_000, elapsed_ms=0.5)
    assert r.host_ns == 501_000
    with pytest.raises(ValueError, match="pending"):
        _ = MarkReading(2, "pending").host_ns


def test_a_span_resolves_only_once_both_marks_are_done_and_never_waits():
    gpu = FakeGpu()
    t0 = gpu.now_host
    tl = gpu.timeline()
    tl.add([gpu.span("forward", t0 + 1 * MS, t0 + 3 * MS, kind="compute")])
    gpu.now_host = t0 + 2 * MS  # start passed, end not yet
    assert tl.resolve() == [] and tl.pending == 1
    gpu.now_host = t0 + 4 * MS
    (iv,) = tl.resolve()
    assert iv.name == "forward" and tl.pending == 0
    # The start mark was read done once and kept: it is never asked for again.
    assert gpu.reads == [[1, 2], [2]]


def test_collectives_of_one_queue_start_when_the_previous_one_ends():
    # Two async all-reduces issued back to back: both start marks pass at once on the caller's stream,
    # but the group's NCCL stream runs them one after the other.
    gpu = FakeGpu()
    t0 = gpu.now_host
    tl = gpu.timeline()
    tl.add([gpu.span("all_reduce", t0, t0 + 10 * MS, queue="nccl:dp"),
            gpu.span("all_reduce", t0 + MS // 1000, t0 + 25 * MS, queue="nccl:dp"),
            gpu.span("all_gather", t0, t0 + 5 * MS, queue="nccl:tp")])  # another group: its own stream
    gpu.now_host = t0 + 30 * MS
    ivs = tl.resolve()
    by_name = sorted((iv.name, round((iv.start_ns - t0) / MS, 3), round((iv.end_ns - t0) / MS, 3)) for iv in ivs)
    assert by_name == [("all_gather", 0, 5), ("all_reduce", 0, 10), ("all_reduce", 10, 25)]
    # Sum of durations = what the GPU spent in the kernels, not 10 + 25.
    assert sum(iv.end_ns - iv.start_ns for iv in ivs if iv.name == "all_reduce") == pytest.approx(25 * MS, abs=200)


def test_the_queue_rule_carries_across_step_ends():
    gpu = FakeGpu()
    t0 = gpu.now_host
    tl = gpu.timeline()
    tl.add([gpu.span("reduce_scatter", t0, t0 + 8 * MS, queue="q")])
    gpu.now_host = t0 + 9 * MS
    assert len(tl.resolve()) == 1
    tl.add([gpu.span("reduce_scatter", t0 + 2 * MS, t0 + 12 * MS, queue="q")])  # start mark before the last end
    gpu.now_host = t0 + 13 * MS
    (iv,) = tl.resolve()
    assert iv.start_ns == pytest.approx(t0 + 8 * MS, abs=100)


def test_a_pending_span_holds_back_later_spans_of_its_queue_only():
    gpu = FakeGpu()
    t0 = gpu.now_host
    tl = gpu.timeline()
    first = gpu.span("all_reduce", t0, t0 + 20 * MS, queue="q")
    # End mark on a side stream that the GPU happened to pass first: still ordered after `first`.
    second = gpu.span("all_reduce", t0, t0 + 5 * MS, queue="q")
    other = gpu.span("broadcast", t0, t0 + 5 * MS, queue="r")
    tl.add([first, second, other])
    gpu.now_host = t0 + 6 * MS
    assert [iv.name for iv in tl.resolve()] == ["broadcast"]
    assert tl.pending == 2
    gpu.now_host = t0 + 21 * MS
    ivs = tl.resolve()
    assert [iv.name for iv in ivs] == ["all_reduce", "all_reduce"]
    # The second cannot end before it starts: it is cut to zero length at the first's end, and counted.
    assert ivs[1].start_ns == ivs[1].end_ns == ivs[0].end_ns
    assert tl.counts.clamped == 1


def test_a_failed_or_unknown_mark_drops_its_span_and_releases_the_other_mark():
    gpu = FakeGpu()
    t0 = gpu.now_host
    tl = gpu.timeline()
    bad = gpu.span("all_reduce", t0, t0 + MS, queue="q")
    gpu.failed.add(bad.end_mark)
    ghost = MarkedSpan("comm", "send", start_mark=999, end_mark=gpu.mark(t0 + 50 * MS))  # 999: never recorded
    good = gpu.span("all_reduce", t0, t0 + 2 * MS, queue="q")
    tl.add([bad, ghost, good])
    gpu.now_host = t0 + 3 * MS
    (iv,) = tl.resolve()
    assert iv.name == "all_reduce" and iv.start_ns == pytest.approx(t0, abs=100)  # the failed one set no queue end
    assert tl.counts.failed == 2 and tl.pending == 0
    assert ghost.end_mark in gpu.released and ghost.end_mark not in gpu.marks  # pending mark freed in the library


def test_a_span_that_never_completes_is_dropped_as_lost_after_some_step_ends():
    gpu = FakeGpu()
    t0 = gpu.now_host
    tl = gpu.timeline(max_pending_resolves=3)
    stuck = gpu.span("all_reduce", t0, t0 + 10_000 * MS, queue="q")
    after = gpu.span("all_reduce", t0, t0 + MS, queue="q")
    tl.add([stuck, after])
    gpu.now_host = t0 + 2 * MS
    assert tl.resolve() == [] and tl.resolve() == []
    ivs = tl.resolve()  # third step end: the stuck one is given up, the next of its queue goes ahead
    assert [iv.name for iv in ivs] == ["all_reduce"] and tl.counts.lost == 1
    assert stuck.end_mark in gpu.released and gpu.marks == {}
    with pytest.raises(ValueError):
        GpuTimeline(gpu.read, gpu.release, max_pending_resolves=0)


def test_discarded_spans_release_their_marks_and_report_nothing():
    gpu = FakeGpu()
    tl = gpu.timeline()
    s = gpu.span("broadcast", gpu.now_host, gpu.now_host + MS)
    tl.discard([s])
    assert gpu.marks == {} and tl.pending == 0 and tl.resolve() == []


def test_overlap_from_resolved_intervals_matches_the_arithmetic():
    # A step: forward 0-10 ms, backward 10-30 ms on the compute stream; DDP buckets all-reduce on the NCCL
    # stream, issued at 15 ms and 22 ms (each 6 ms on the wire), the last one exposed after backward.
    gpu = FakeGpu()
    t0 = gpu.now_host
    tl = gpu.timeline()
    tl.add([gpu.span("forward", t0, t0 + 10 * MS, kind="compute"),
            gpu.span("all_reduce", t0 + 15 * MS, t0 + 21 * MS, queue="q"),
            gpu.span("all_reduce", t0 + 22 * MS, t0 + 28 * MS, queue="q"),
            gpu.span("backward", t0 + 10 * MS, t0 + 30 * MS, kind="compute"),
            gpu.span("all_reduce", t0 + 30 * MS, t0 + 36 * MS, queue="q")])
    gpu.now_host = t0 + 40 * MS
    ivs = tl.resolve()
    assert [iv.start_ns for iv in ivs] == sorted(iv.start_ns for iv in ivs)
    comm_s, exposed_s, overlap = overlap_reference.step_summary(ivs)
    assert comm_s == pytest.approx(18e-3, abs=1e-6)
    assert exposed_s == pytest.approx(6e-3, abs=1e-6)
    assert overlap == pytest.approx(12 / 18, abs=1e-4)


# --- the probe's GPU clock, with the CUDA library replaced by the simulated GPU -------------------------


@pytest.fixture
def fake_clock(monkeypatch):
    """A CudaStepClock whose marks go to FakeGpu: stream 7 is "current"; each mark lands at the fake `now`."""
    torch = pytest.importorskip("torch")
    from workbench.telemetry import cuda, cuda_step, native

    gpu = FakeGpu()
    gpu.issue_at = gpu.now_host  # host time the GPU will reach the next mark (tests move it)
    agains: list[tuple[int, int]] = []

    def mark(device, stream):
        assert (device, stream) == (0, 7)
        return gpu.mark(gpu.issue_at)

    def mark_again(mid, stream):
        agains.append((mid, stream))
        gpu.marks[mid] = gpu.issue_at + gpu.offset

    backend: list[MarkedSpan] = []
    monkeypatch.setattr(cuda, "mark", mark)
    monkeypatch.setattr(cuda, "mark_again", mark_again)
    monkeypatch.setattr(cuda, "read_marks", gpu.read)
    monkeypatch.setattr(cuda, "release_marks", gpu.release)
    monkeypatch.setattr(native, "drain_marked", lambda: [backend.pop(0) for _ in range(len(backend))])
    monkeypatch.setattr(cuda_step.CudaStepClock, "_stream", lambda self: 7)
    clock = cuda_step.CudaStepClock(torch.device("cuda", 0))
    return clock, gpu, backend, agains


def test_the_probe_clock_marks_compute_and_resolves_it_with_the_backends_collectives(fake_clock):
    clock, gpu, backend, agains = fake_clock
    t0 = gpu.now_host
    backend.append(gpu.span("all_reduce", t0 - 50 * MS, t0 - 40 * MS))  # between steps: not this step's
    clock.begin_step()
    assert gpu.marks == {}  # released
    gpu.issue_at = t0 + 1 * MS
    with clock.span("forward"):
        gpu.issue_at = t0 + 10 * MS
    token = clock.begin("compute", "backward")
    for k in range(3):  # three gradients; the mark rolls to the last
        gpu.issue_at = t0 + (12 + 2 * k) * MS
        clock.roll()
    backend.append(gpu.span("all_reduce", t0 + 13 * MS, t0 + 19 * MS, queue="nccl:0", stream="nccl"))
    gpu.issue_at = t0 + 30 * MS  # the stream waits for the last bucket after backward: not compute
    clock.end(token, clock.take_rolling())
    gpu.now_host = t0 + 31 * MS
    ivs = {iv.name: iv for iv in clock.finish()}
    assert sorted(ivs) == ["all_reduce", "backward", "forward"]
    assert (ivs["forward"].start_ns, ivs["forward"].end_ns) == pytest.approx((t0 + MS, t0 + 10 * MS), abs=100)
    assert (ivs["backward"].start_ns, ivs["backward"].end_ns) == pytest.approx((t0 + 10 * MS, t0 + 16 * MS), abs=100)
    assert ivs["backward"].stream == "cuda:compute" and ivs["all_reduce"].stream == "nccl"
    assert len(agains) == 2 and gpu.marks == {} and clock.timeline.pending == 0


def test_the_probe_clock_carries_late_spans_and_frees_an_unused_rolling_mark(fake_clock):
    clock, gpu, backend, _ = fake_clock
    t0 = gpu.now_host
    clock.begin_step()
    gpu.issue_at = t0 + 1 * MS
    with clock.span("optimizer"):
        gpu.issue_at = t0 + 50 * MS  # not reached at step end
    assert clock.finish() == [] and clock.timeline.pending == 1
    clock.roll()  # a gradient hook outside any backward (user code): its mark must not leak
    clock.begin_step()
    gpu.now_host = t0 + 60 * MS
    (iv,) = clock.finish()  # the late span is reported once the GPU has passed it
    assert iv.name == "optimizer" and gpu.marks == {}


def test_a_span_whose_body_raises_releases_its_mark_and_reports_nothing(fake_clock):
    clock, gpu, _, _ = fake_clock
    clock.begin_step()
    clock.roll()
    with pytest.raises(RuntimeError, match="out of memory"):
        with clock.span("forward"):
            raise RuntimeError("CUDA out of memory")
    gpu.now_host += 10 * MS
    assert clock.finish() == [] and gpu.marks == {}
