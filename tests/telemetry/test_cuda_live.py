"""The GPU path of the live telemetry, checked against torch.profiler's CUDA activity (needs a CUDA device).

Every test here is marked ``gpu``: skipped without a CUDA device and a CUDA
build of torch, run by ``benches/gpu_check.sh`` (and ``pytest -m gpu``) on a
GPU machine. The logic behind them is tested on CPU in test_gpu_timeline.py.

Reference figures come from torch.profiler (Kineto/CUPTI): the device
activities ("kernel", "gpu_memcpy", "gpu_memset") with their stream ids. A
step's communication is the device activity on the streams NCCL used, i.e.
every stream but the compute stream (the only other work the tests enqueue is
the spin kernel, on the compute stream).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")

from tests.telemetry import overlap_reference  # noqa: E402
from workbench.telemetry import cuda  # noqa: E402

pytestmark = pytest.mark.gpu

MS = 1_000_000
MiB = 1 << 20
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


@pytest.fixture(scope="module")
def gpu():
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA device")
    try:
        if cuda.device_count() == 0:
            pytest.skip("the CUDA library sees no device")
    except (cuda.CudaError, OSError) as e:
        pytest.skip(f"no usable CUDA device: {e}")
    torch.cuda.init()
    return torch.device("cuda", torch.cuda.current_device())


def device_activities(prof) -> list[tuple[str, int, int, int]]:
    """``(name, stream id, start_ns, end_ns)`` of every kernel, memcpy and memset the profiler saw."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA and e.activity_type() in DEVICE_ACTIVITIES:
            out.append((e.name(), e.device_resource_id(), e.start_ns(), e.end_ns()))
    assert out, "the profiler recorded no CUDA activity: is CUPTI available to this torch?"
    return out


def spin_stream(acts) -> int:
    streams = {s for name, s, _, _ in acts if "spin_kernel" in name}
    assert len(streams) == 1, f"spin kernels on streams {streams}"
    return streams.pop()


# --- compute spans ---------------------------------------------------------------------------------


def test_compute_spans_are_the_gpu_time_between_their_marks(gpu):
    from workbench.telemetry.cuda_step import CudaStepClock

    clock = CudaStepClock(gpu)
    stream = torch.cuda.current_stream(gpu).cuda_stream
    clock.begin_step()
    issued = time.monotonic_ns()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with clock.span("forward"):
            cuda.spin(stream, 20 * MS)
        with clock.span("backward"):
            cuda.spin(stream, 30 * MS)
        t0 = time.perf_counter()
        early = clock.finish()  # never waits: the GPU is still spinning
        returned_in = time.perf_counter() - t0
        torch.cuda.synchronize(gpu)
    # Nothing resolved yet, and finish did not wait for the 50 ms of GPU work queued (a generous bound on that).
    assert early == [] and returned_in < 0.025
    ivs = {iv.name: iv for iv in clock.finish()}
    kernels = sorted((s, e) for name, _, s, e in device_activities(prof) if "spin_kernel" in name)
    assert len(kernels) == 2
    for iv, (ks, ke) in zip((ivs["forward"], ivs["backward"]), kernels):
        # The span holds exactly one kernel and the gap before it (launch latency: microseconds).
        assert iv.kind == "compute" and iv.stream == "cuda:compute"
        assert iv.end_ns - iv.start_ns == pytest.approx(ke - ks, rel=0.02)
    assert issued - 1 * MS <= ivs["forward"].start_ns <= ivs["forward"].end_ns <= ivs["backward"].start_ns + 50_000
    assert clock.timeline.pending == 0 and clock.timeline.counts.failed == 0


def test_the_rolling_mark_ends_backward_at_the_last_gradient(gpu):
    from workbench.telemetry.cuda_step import CudaStepClock

    clock = CudaStepClock(gpu)
    stream = torch.cuda.current_stream(gpu).cuda_stream
    clock.begin_step()
    token = clock.begin("compute", "backward")
    for _ in range(3):  # three "gradients", each after 5 ms of work
        cuda.spin(stream, 5 * MS)
        clock.roll()
    cuda.spin(stream, 40 * MS)  # e.g. the stream then waits for DDP's last bucket: not backward's compute
    clock.end(token, clock.take_rolling())
    torch.cuda.synchronize(gpu)
    (iv,) = clock.finish()
    assert iv.end_ns - iv.start_ns == pytest.approx(15 * MS, rel=0.03)


# --- device memory ---------------------------------------------------------------------------------


def test_device_memory_from_the_library_agrees_with_the_runtime_and_the_allocator(gpu):
    from workbench.telemetry.cuda_step import device_memory

    torch.cuda.empty_cache()  # so the allocation below must come from cudaMalloc
    before = device_memory(gpu)
    x = torch.empty(1 << 30, dtype=torch.uint8, device=gpu)  # 1 GiB through torch's allocator
    after = device_memory(gpu)
    free, total = torch.cuda.mem_get_info(gpu)
    assert after["device_total"] == total
    assert after["device_used"] == pytest.approx(total - free, abs=64 << 20)  # other processes may move a little
    assert after["allocated"] - before["allocated"] == 1 << 30
    assert after["device_used"] - before["device_used"] >= (1 << 30) - (64 << 20)
    assert after["device_used"] >= after["reserved"] >= after["allocated"]
    del x


# --- collectives against the profiler --------------------------------------------------------------


@pytest.fixture
def nccl_world(gpu):
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    from workbench.telemetry import comm, native

    comm.register()
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("workbench", store=store, rank=0, world_size=1)
        try:
            native.recorder().set_enabled(True)
            yield dist
        finally:
            dist.destroy_process_group()


def test_nccl_collectives_are_stamped_on_the_gpu(nccl_world):
    dist = nccl_world
    from workbench.telemetry import native
    from workbench.telemetry.gpu_timeline import GpuTimeline

    x = torch.ones(MiB, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    time.sleep(0.05)
    timeline = GpuTimeline(cuda.read_marks, cuda.release_marks)
    timeline.discard(native.drain_marked())
    issued = time.monotonic_ns()
    cuda.spin(torch.cuda.current_stream().cuda_stream, 30_000_000)
    dist.all_reduce(x)  # queued behind 30 ms of GPU work
    torch.cuda.synchronize()
    assert native.drain() == []  # nothing host-stamped: CUDA collectives carry marks
    timeline.add(native.drain_marked())
    (iv,) = timeline.resolve()
    assert (iv.name, iv.bytes, iv.stream) == ("all_reduce", 4 * MiB, "nccl")
    # GPU-side start: after the spin kernel, not when Python issued the call.
    assert iv.start_ns - issued >= 29_000_000
    assert iv.end_ns > iv.start_ns
    assert native.load().unstamped_cuda_ops() == 0


def test_comm_intervals_match_the_profilers_nccl_device_time_within_5_percent(gpu, nccl_world):
    """One step: compute on the compute stream while asynchronous collectives queue on the group's NCCL stream.

    On one GPU (world size 1) NCCL still does device work for these ops: all_reduce with AVG scales the
    buffer (a kernel), out-of-place all_gather copies it (a memcpy). With more ranks the same holds
    with ncclDevKernel_* kernels. Either way the reference is the device time on the non-compute streams.
    """
    dist = nccl_world
    from workbench.telemetry import native
    from workbench.telemetry.cuda_step import CudaStepClock

    n = 256 << 20  # 1 GiB of fp32: each op is hundreds of microseconds on the device, not a launch
    x = torch.ones(n, device=gpu)
    out = torch.empty(n, device=gpu)
    stream = torch.cuda.current_stream(gpu).cuda_stream
    clock = CudaStepClock(gpu)

    def step():
        with clock.span("forward"):
            cuda.spin(stream, 5 * MS)  # the collectives below queue behind this
        works = [dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True) for _ in range(4)]
        works += [dist.all_gather_into_tensor(out, x, async_op=True) for _ in range(4)]
        with clock.span("backward"):
            cuda.spin(stream, 2 * MS)
        for w in works:
            w.wait()

    step()  # warm-up: communicator set-up, allocator
    torch.cuda.synchronize(gpu)
    clock.begin_step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(gpu)
    ivs = clock.finish()
    comm = [iv for iv in ivs if iv.kind == "comm"]
    assert [iv.name for iv in comm].count("all_reduce") == 4 and [iv.name for iv in comm].count("all_gather") == 4
    assert all(iv.stream == "nccl" for iv in comm)
    assert native.load().unstamped_cuda_ops() == 0 and clock.timeline.counts.failed == 0

    acts = device_activities(prof)
    compute_stream = spin_stream(acts)
    nccl = [(s, e) for name, sid, s, e in acts if sid != compute_stream]
    reference_ns = overlap_reference.covered_ns(nccl)
    measured_ns = overlap_reference.covered_ns((iv.start_ns, iv.end_ns) for iv in comm)
    assert reference_ns > MS // 2, f"NCCL did only {reference_ns} ns of device work: the comparison would be noise"
    assert measured_ns == pytest.approx(reference_ns, rel=0.05), (
        f"extension {measured_ns / 1e6:.3f} ms vs profiler {reference_ns / 1e6:.3f} ms of NCCL device time")
    # The queue rule placed them after the forward spin, not when Python issued them.
    fwd = next(iv for iv in ivs if iv.name == "forward")
    assert min(iv.start_ns for iv in comm) >= fwd.end_ns - 50_000
