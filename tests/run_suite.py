"""`make test`: the whole suite, as two pytest processes at once.

The tests that start processes (marked `processes`: ranks, zygotes, kernels, torchrun, a browser) leave a core
idle much of the time: run one after another, the suite kept 1.14 of 2 cores busy on average (13.8 CPU-minutes in
12.1 minutes). The pure-logic tests (about 2.5 CPU-minutes, one core) run beside them, at a lower priority, so
that they take the idle time and not the ranks' share of the CPU. Every test runs once, in one of the two; the run fails if either does.

    python -m tests.run_suite [pytest arguments]

Arguments go to both halves; `--junitxml=FILE` gives the pure half FILE with `-pure` before its suffix. With `-m`
(the caller chose the tests) one pytest runs them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

STARTS_PROCESSES = "processes"  # the browser's tests are marked processes as well
PURE_NICENESS = 10
NO_TESTS_COLLECTED = 5


def _pure_arguments(args: list[str]) -> list[str]:
    out = []
    for arg in args:
        if arg.startswith("--junitxml="):
            path = Path(arg.split("=", 1)[1])
            arg = f"--junitxml={path.with_name(path.stem + '-pure' + path.suffix)}"
        out.append(arg)
    return out


def _combined(codes: list[int]) -> int:
    """Failed if either failed; "no tests" only if neither half had any (a file of pure tests leaves the other
    half empty)."""
    ran = [c for c in codes if c != NO_TESTS_COLLECTED]
    if not ran:
        return NO_TESTS_COLLECTED
    return next((c for c in ran if c != 0), 0)


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    if any(a == "-m" or a.startswith("-m=") for a in args):
        return subprocess.call(pytest + args)
    with tempfile.TemporaryFile("w+") as pure_log:
        # Its report is held back and printed after the other half's, so neither interleaves with the other.
        pure = subprocess.Popen(pytest + ["-m", f"not ({STARTS_PROCESSES})"] + _pure_arguments(args),
                                stdout=pure_log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.nice(PURE_NICENESS))
        try:
            with_processes = subprocess.call(pytest + ["-m", STARTS_PROCESSES] + args)  # killed if we are
        except BaseException:
            pure.kill()  # nothing outlives the run
            raise
        pure_code = pure.wait()
        pure_log.seek(0)
        print(f"\n---------- the pure-logic tests, run beside the ones above (-m 'not ({STARTS_PROCESSES})') "
              "----------", flush=True)
        sys.stdout.write(pure_log.read())
    code = _combined([with_processes, pure_code])
    print(f"\nmake test: tests that start processes exit {with_processes}, pure-logic tests exit {pure_code}: "
          f"{'passed' if code == 0 else 'FAILED'}", flush=True)
    return code


if __name__ == "__main__":
    # A terminated run (a CI time-out) unwinds as an exception, so neither half outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.exit(main(sys.argv[1:]))
