"""The processes of local ranks: spawned, watched, ended. The control plane never touches a process itself.

As in ipyparallel, lifecycle (start, signal, stop) is apart from work
(commands, results): `LocalRanks` owns one session's processes, and the
transport asks it only for their exit codes and to end them.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Callable

from workbench.pool import launch

log = logging.getLogger("workbench.pool")

Output = Callable[[int, str, str], None]


def rank_environment(threads: int, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a local rank: the notebook's, with one rank's threads, our package importable, and
    none of torchrun's variables (a notebook started under torchrun must not hand them down)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [launch.package_root(), os.environ.get("PYTHONPATH")])))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    env.update(extra)
    return env


class LocalRanks:
    """The local rank processes of one session, by rank."""

    def __init__(self, address: str, key_file: str, world_size: int, env: dict[str, str], on_output: Output) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        for r in range(world_size):
            self.procs[r] = subprocess.Popen(launch.local_worker_argv(address, key_file, r, world_size),
                                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, start_new_session=True)
            for stream in ("stdout", "stderr"):
                threading.Thread(target=_pump, args=(getattr(self.procs[r], stream), r, stream, on_output),
                                 daemon=True, name=f"workbench-rank{r}-{stream}").start()

    def pid(self, rank: int) -> int | None:
        proc = self.procs.get(rank)
        return None if proc is None else proc.pid

    def exit_codes(self) -> dict[int, int | None]:
        """Each rank's exit code, None while it runs."""
        return {r: proc.poll() for r, proc in self.procs.items()}

    def stop(self, grace_s: float) -> None:
        """Give the ranks `grace_s` to exit (they were told to), then kill those left, stopped ones included."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                proc.kill()  # also ends a SIGSTOPped rank
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("workbench pool: rank pid %d did not exit after SIGKILL", proc.pid)


def _pump(pipe, rank: int, stream: str, on_output: Output) -> None:
    """Forward what a local rank writes to its file descriptors (C++ warnings, crashes) to the notebook."""
    for raw in iter(pipe.readline, b""):
        on_output(rank, stream, raw.decode(errors="replace").rstrip("\n"))
    pipe.close()
