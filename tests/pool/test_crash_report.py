"""The report of a crashed rank's stderr: the crashing thread's native frames kept (the other threads' dropped),
said whether that thread runs Python, and faulthandler's Python stacks kept after them; the dumps below are torch
2.13's and Python 3.11's, as they printed them on this machine."""

from workbench.pool.crash_report import condense

_FRAME = "frame #{}: {} ({} in /lib/x86_64-linux-gnu/libc.so.6)"


def _native(tid: int, frames: list[str], crashed: bool) -> list[str]:
    handler = ["frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool) + 0x8f (0x7f in libc10.so)"]
    if crashed:
        handler.append("frame #1: c10::FatalSignalHandler::fatalSignalHandler(int, siginfo_t*) + 0x2da (0x7f in "
                       "libc10.so)")
    trampoline = [_FRAME.format(len(handler), "<unknown function> + 0x3c050", "0x7f0")]
    body = [_FRAME.format(len(handler) + 1 + i, f, f"0x7f{i}") for i, f in enumerate(frames)]
    first = (handler + trampoline + body)[0]
    return [f"SIGSEGV(11), PID: 100, Thread {tid}: ", " " + first, *(handler + trampoline + body)[1:], ""]


PYTHON = ["Fatal Python error: Segmentation fault", "",
          "{marker} 0x00007f26e4649b80 (most recent call first):",
          '  File "/work/workbench/pool/worker.py", line 250 in command_loop', "",
          "Extension modules: torch._C (total: 1)"]


def _python(current: bool) -> list[str]:
    return [line.format(marker="Current thread" if current else "Thread") for line in PYTHON]


def test_a_crash_in_a_thread_that_runs_no_python_is_told_by_its_native_frames_alone():
    waiting = _native(101, ["clock_nanosleep + 0x65", "<unknown function> + 0x2724a"], crashed=False)
    crashed = _native(102, ["gloo::AllgatherRing::run() + 0x1f", "start_thread + 0x2f"], crashed=True)
    for lines in (waiting + crashed + _python(False), _python(False) + waiting + crashed):  # either handler first
        report = condense(lines, keep=40)
        assert report[0].startswith("The native stack of the thread that crashed (thread 102), a thread that runs "
                                    "no Python")
        assert report[1].startswith("frame #3: gloo::AllgatherRing::run()")  # the handler and trampoline gone
        assert not any("clock_nanosleep" in line or "FatalSignalHandler" in line for line in report)
        assert report[-len(PYTHON):] == _python(False) and not any("PID: 100" in line for line in report)


def test_faulthandlers_raise_of_the_signal_again_is_not_taken_for_the_crash():
    # A rank forked from a prepared zygote enables faulthandler after torch's handler: faulthandler runs first and
    # raises the signal again, so torch's handler sees that raise above the crash.
    crashed = _native(9, ["<unknown function> + 0x8aeec", "gsignal + 0x12", "<unknown function> + 0x3c050",
                          "strlen + 0x18", "start_thread + 0x2f"], crashed=True)
    report = condense(crashed + _python(False), keep=40)
    assert report[1].startswith("frame #6: strlen")


OWN = ["workbench: native frames of the crashing thread (thread 4044, signal 11):",
       "/root/.cache/workbench/extensions/telemetry-acea/wb_telemetry_acea.so(+0x5aa44)[0x7efc5d8bba44]",
       "/lib/x86_64-linux-gnu/libc.so.6(+0x3c050)[0x7efc77c5a050]",
       "/lib/x86_64-linux-gnu/libc.so.6(+0x8aeec)[0x7efc77ca8eec]",
       "/lib/x86_64-linux-gnu/libc.so.6(gsignal+0x12)[0x7efc77c59fb2]",
       "/lib/x86_64-linux-gnu/libc.so.6(+0x3c050)[0x7efc77c5a050]",
       "/work/.venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so(_ZN4gloo13AllgatherRing3runEv+0x1f)[0x7f1]",
       "/lib/x86_64-linux-gnu/libc.so.6(+0x891f5)[0x7efc77ca71f5]", ""]


def test_where_torchs_handler_died_before_the_crashing_thread_the_extensions_frames_tell():
    # A corrupted heap: torch's handler printed the main thread's wait, then malloc aborted it.
    waiting = _native(4019, ["pthread_cond_wait + 0x1e8"], crashed=False)
    lines = _python(False) + OWN + waiting + ["malloc_consolidate(): unaligned fastbin chunk detected",
                                              "Fatal Python error: Aborted"]
    report = condense(lines, keep=40)
    assert report[0].startswith("The native stack of the thread that crashed (thread 4044), a thread that runs no")
    assert report[1].endswith("libtorch_cpu.so(_ZN4gloo13AllgatherRing3runEv+0x1f)[0x7f1]")  # handlers, raise gone
    assert report[2].endswith("libc.so.6(+0x891f5)[0x7efc77ca71f5]") and report[3] == ""
    assert report[-1] == "Fatal Python error: Aborted" and not any("wb_telemetry" in line for line in report)
    # Where torch's handler did reach it, its demangled frames are taken instead.
    crashed = _native(4044, ["gloo::AllgatherRing::run() + 0x1f"], crashed=True)
    assert condense(_python(False) + OWN + crashed, keep=40)[1].startswith("frame #3: gloo::AllgatherRing::run()")


def test_a_crash_in_a_python_thread_points_at_its_marked_python_stack():
    lines = _native(7, ["PyObject_Call + 0x10"], crashed=True) + _python(True)
    report = condense(lines, keep=40)
    assert "a thread that runs Python" in report[0] and "'Current thread'" in report[0]
    assert report[-len(PYTHON):] == _python(True)


def test_without_native_stacks_the_report_is_the_tail_of_what_the_rank_wrote():
    lines = [f"warning {i}" for i in range(100)] + _python(True)
    assert condense(lines, keep=40) == lines[-40:]
    blocks_of_waits = _native(5, ["pthread_cond_wait + 0x1e8"], crashed=False)  # an abort's dump with no crashed frame
    assert condense(blocks_of_waits + ["terminate called"], keep=40) == ["terminate called"]
