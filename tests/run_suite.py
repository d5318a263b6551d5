"""`make test`: the whole suite, as two streams of pytest runs at once.

The tests that start processes leave a core idle much of the time: measured per test on 2 quiet cores
(/proc/stat around each, tests/core_use.py), the process tests kept 1.52 of 2 cores busy (1,243 CPU-seconds in 821 s), and most of
the idle time was in the files that mostly wait on other processes, leaving 0.6 of a core or more idle on
average: the notebooks' kernels (0.70), the standby drills (1.12), the browser (0.79), the pool's failure drills
(0.82), the zygote (0.66), the emulated cluster's sleeps (1.61), a few small ones. The foreground stream runs
the process tests that compute; beside it, one after another, run the pure-logic tests (about 2 CPU-minutes,
one core; at a lower priority, so that they take the idle time and not the ranks' share) and then the tests
that mostly wait (marked `mostly_waits`). The fault drills (0.61 idle) run in the foreground but for their soak
(four failures waited out): with all of them beside, the stream beside ended ~50 s after the foreground in a
fresh quiet run; with none, ~37 s before it (i46, stop 8). Every test runs once, in one pytest run; the suite
fails if any of them does.

    python -m tests.run_suite [pytest arguments]

Arguments go to every run; `--junitxml=FILE` gives each run beside the foreground its own FILE, named with
`-pure` or `-waits` before the suffix. With `-m` (the caller chose the tests) one pytest runs them all.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

NO_TESTS_COLLECTED = 5


class Part(NamedTuple):
    label: str
    """What the part's report and junit file are called ("" for the foreground's)."""
    markers: str
    niceness: int


FOREGROUND = Part("", "processes and not mostly_waits", 0)
BESIDE = (Part("pure", "not processes", 10),
          # At the foreground's priority: their hang bounds are for a machine shared, not one starved.
          Part("waits", "processes and mostly_waits", 0))


def _arguments(args: list[str], label: str) -> list[str]:
    if not label:
        return list(args)
    out = []
    for arg in args:
        if arg.startswith("--junitxml="):
            path = Path(arg.split("=", 1)[1])
            arg = f"--junitxml={path.with_name(f'{path.stem}-{label}{path.suffix}')}"
        out.append(arg)
    return out


def _combined(codes: list[int]) -> int:
    """Failed if any part failed; "no tests" only if none had any (a file of pure tests leaves the others
    empty)."""
    ran = [c for c in codes if c != NO_TESTS_COLLECTED]
    if not ran:
        return NO_TESTS_COLLECTED
    return next((c for c in ran if c != 0), 0)


def _command(part: Part, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", part.markers, *_arguments(args, part.label)]


def _environment() -> dict[str, str]:
    """The parts' environment, with bytecode written: the three pytest runs import and rewrite the same test
    modules, and a container's PYTHONDONTWRITEBYTECODE=1 made each do it again (3.6 s of a core each); the
    files go to __pycache__ folders git ignores."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _beside(args: list[str], log) -> subprocess.Popen:
    """The parts beside the foreground, one after another, in one shell: its output to `log`, the parts' exit
    codes on its last line."""
    steps = []
    for part in BESIDE:
        command = shlex.join(_command(part, args))
        steps.append(f"echo '---------- beside the process tests: -m \"{part.markers}\" ----------'; "
                     f"nice -n {part.niceness} {command}; codes=\"$codes $?\"")
    script = "codes=''; " + "; ".join(steps) + "; echo \"exit codes:$codes\""
    # A session of its own, so that the whole stream (the shell and its pytest) ends with the run.
    return subprocess.Popen(["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=_environment())


def _codes(report: str) -> list[int]:
    last = report.rstrip().rsplit("\n", 1)[-1]
    if not last.startswith("exit codes:"):
        return [1]  # the stream did not finish: a failure
    return [int(c) for c in last.split(":", 1)[1].split()]


def _end(stream: subprocess.Popen) -> None:
    """Terminate the stream's process group (a session of its own), then kill what is left after a grace
    period."""
    for sig, grace_s in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(stream.pid, sig)
        except ProcessLookupError:
            return
        try:
            stream.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def main(args: list[str]) -> int:
    if any(a == "-m" or a.startswith("-m=") for a in args):
        return subprocess.call([sys.executable, "-m", "pytest", *args], env=_environment())
    with tempfile.TemporaryFile("w+") as log:
        # Its report is held back and printed after the foreground's, so that neither interleaves with the other.
        beside = _beside(args, log)
        running = subprocess.Popen(_command(FOREGROUND, args), start_new_session=True, env=_environment())
        try:
            foreground = running.wait()
        except BaseException:
            _end(running)  # nothing outlives the run: each pytest unwinds (tests/conftest.py), then is killed
            _end(beside)
            raise
        beside.wait()
        log.seek(0)
        report = log.read()
    sys.stdout.write(report)
    codes = [foreground, *_codes(report)]
    code = _combined(codes)
    print(f"\nmake test: exit codes {codes} (the process tests; beside them "
          f"{', '.join(p.label for p in BESIDE)}): {'passed' if code == 0 else 'FAILED'}", flush=True)
    return code


if __name__ == "__main__":
    # A terminated run (a CI time-out) unwinds as an exception, so that no part outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main(sys.argv[1:]))
