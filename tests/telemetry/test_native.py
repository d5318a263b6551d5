"""The compiled telemetry extension: clock, recorder, the recording backend around a fake one, the build cache.

The extension is built once into the persistent cache (``python -m
workbench.telemetry.native --build``); the first test to need it builds it
if the cache is empty. The backend in a real 2-process gloo world is
tests/telemetry/test_recording_world.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from workbench.telemetry import native


@pytest.fixture(scope="module")
def ext():
    return native.load()


# --- clock and recorder ----------------------------------------------------------


def test_clock_is_pythons_monotonic_clock(ext):
    before = time.monotonic_ns()
    now = native.now_ns()
    after = time.monotonic_ns()
    assert before <= now <= after


def test_recorder_records_spans(ext):
    native.drain()
    before = time.monotonic_ns()
    outer = native.begin("compute", "forward")
    with native.span("compute", "inner", stream="side"):
        pass
    native.end(outer)
    after = time.monotonic_ns()
    inner, fwd = native.drain()  # in order of ending
    assert (inner.name, inner.kind, inner.stream) == ("inner", "compute", "side")
    assert (fwd.name, fwd.stream, fwd.bytes, fwd.group_size) == ("forward", "main", 0, 1)
    assert before <= fwd.start_ns <= inner.start_ns <= inner.end_ns <= fwd.end_ns <= after
    assert native.drain() == []


def test_span_is_closed_on_exception(ext):
    native.drain()
    with pytest.raises(KeyError):
        with native.span("compute", "failing"):
            raise KeyError("boom")
    assert [iv.name for iv in native.drain()] == ["failing"]


def test_open_spans_wait_for_their_end(ext):
    native.drain()
    token = native.begin("compute", "long")
    assert native.drain() == []
    assert native.recorder().open_count == 1
    native.end(token)
    assert [iv.name for iv in native.drain()] == ["long"]


def test_recorder_refuses_bad_input(ext):
    with pytest.raises(ValueError, match="unknown or already ended"):
        native.end(987654321)
    with pytest.raises(ValueError, match="kind must be"):
        native.begin("io", "x")


def test_disabled_recorder_records_nothing(ext):
    rec = native.recorder()
    native.drain()
    rec.set_enabled(False)
    try:
        token = native.begin("compute", "ignored")
        assert token == 0
        native.end(token)
    finally:
        rec.set_enabled(True)
    assert native.drain() == []


def test_full_buffer_drops_and_counts(ext):
    rec = ext.Recorder(capacity=2)
    for name in "abc":
        rec.end(rec.begin("compute", name))
    assert [row[1] for row in rec.drain()] == ["a", "b"]
    assert rec.dropped == 1


def test_recorder_takes_spans_from_many_threads(ext):
    rec = ext.Recorder()

    def work(i):
        for j in range(200):
            rec.end(rec.begin("compute", f"{i}.{j}"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = [row[1] for row in rec.drain()]
    assert sorted(names) == sorted(f"{i}.{j}" for i in range(4) for j in range(200))


# --- the recording backend around an in-process fake backend ----------------------


@pytest.fixture
def over_fake(ext):
    """A recording backend wrapping torch's FakeProcessGroup (no peers; works complete at once)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    native.drain()
    return ext.recording_backend(0, 2, FakeProcessGroup._create_internal(0, 2), None, "g")


def test_coalesced_batch_is_one_span(over_fake):
    import torch

    # NCCL batches pipeline p2p this way (batch_isend_irecv); gloo cannot.
    over_fake._start_coalescing()
    over_fake.send([torch.ones(10)], 1, 0)
    over_fake.recv([torch.ones(20)], 1, 0)
    over_fake.send([torch.ones(5)], 1, 0)
    assert native.drain() == []  # nothing per op inside a batch
    over_fake._end_coalescing().wait()
    (iv,) = native.drain()
    assert (iv.name, iv.bytes, iv.group_size, iv.stream, iv.group) == ("send+recv", 140, 2, "fake", "g")


def test_empty_batch_records_nothing(over_fake):
    over_fake._start_coalescing()
    over_fake._end_coalescing().wait()
    assert native.drain() == []


def test_backend_is_silent_while_recorder_is_disabled(over_fake):
    import torch

    native.recorder().set_enabled(False)
    try:
        over_fake.allreduce([torch.ones(4)]).wait()
    finally:
        native.recorder().set_enabled(True)
    assert native.drain() == []
    over_fake.allreduce([torch.ones(4)]).wait()
    assert [(iv.name, iv.bytes) for iv in native.drain()] == [("all_reduce", 16)]


# --- build and cache -------------------------------------------------------------


def test_build_goes_to_the_persistent_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    path = native.extension_path()
    assert path.is_relative_to(tmp_path / "extensions")
    assert native.build_key() in path.name
    assert not native.is_built()


def test_unbuildable_extension_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler"):
        native.build()


@pytest.mark.processes
def test_command_line_build_is_a_no_op_when_cached(ext):
    done = subprocess.run(
        [sys.executable, "-m", "workbench.telemetry.native", "--build"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "already built" in done.stdout


CRASH_IN_A_NATIVE_THREAD = """
import ctypes, time
from workbench.telemetry import native
native.load().install_crash_frames()
libc = ctypes.CDLL(None)
thread = ctypes.c_ulong()
libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.strlen, ctypes.c_void_p), None)
libc.pthread_join(thread, None)
"""


@pytest.mark.processes
def test_a_fatal_signal_prints_the_crashing_threads_frames_then_kills_as_before(ext):
    # No faulthandler, no torch handler: the extension's alone, as when a corrupted heap stops torch's early. It
    # prints the crashing thread (strlen's frame, in the C library) and hands the signal on to the default action.
    done = subprocess.run([sys.executable, "-c", CRASH_IN_A_NATIVE_THREAD], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -11, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("workbench: native frames of the crashing"))
    assert "signal 11" in lines[header]
    frames = lines[header + 1:lines.index("", header)]
    assert "wb_telemetry" in frames[0]  # the handler itself, then the trampoline, then the crash
    assert any("libc.so" in f for f in frames[2:4]) and len(frames) >= 3


A_HANDLER_THAT_NEVER_RETURNS = """
import ctypes, os
from workbench.telemetry import native
libc = ctypes.CDLL(None)
# Before the extension's, a SIGABRT handler that waits for ever, as torch's waits on the lock of a heap whose
# corruption glibc found inside malloc: pause() as the handler.
libc.signal.restype = ctypes.c_void_p
libc.signal(6, ctypes.cast(libc.pause, ctypes.c_void_p))
native.load().install_crash_frames()
os.abort()
"""


@pytest.mark.processes
def test_a_fatal_signal_whose_next_handler_hangs_still_ends_the_process_with_it(ext):
    # Seen in a rank: "malloc_consolidate(): unaligned fastbin chunk detected", then torch's handler waited on
    # malloc's lock and the rank hung (reported stuck after 180 s). The extension's handler prints, hands the signal
    # on, and 5 s later raises it again at its default action.
    done = subprocess.run([sys.executable, "-c", A_HANDLER_THAT_NEVER_RETURNS], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -6, (done.returncode, done.stderr)
    assert "workbench: native frames of the crashing thread" in done.stderr and "signal 6" in done.stderr
    assert "did not finish in 5 s; the process ends with signal 6" in done.stderr


def test_stale_cached_builds_are_pruned_by_last_use_and_kept_ones_survive(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    root = tmp_path / "extensions"
    month_ago = time.time() - 31 * 86400
    folders = {name: root / name for name in ("telemetry-old", "cuda-old", "telemetry-recent", "telemetry-current")}
    for folder in folders.values():
        folder.mkdir(parents=True)
        (folder / "lib.so").write_bytes(b"x")
    for name in ("telemetry-old", "cuda-old", "telemetry-current"):
        os.utime(folders[name], (month_ago, month_ago))

    removed = native.prune_stale_builds(keep=[folders["telemetry-current"]])

    assert sorted(p.name for p in removed) == ["cuda-old", "telemetry-old"]
    assert sorted(p.name for p in root.iterdir()) == ["telemetry-current", "telemetry-recent"]
    native.mark_used(folders["telemetry-current"])  # what loading does: an old build in use is young again
    assert native.prune_stale_builds(keep=[]) == []
