"""The processes of local ranks: spawned, prepared ahead, watched, ended. The control plane never touches one.

As in ipyparallel, lifecycle (start, signal, stop) is apart from work
(commands, results): `LocalRanks` owns one session's processes, and the
transport asks it only for their exit codes, a look at a silent one, and to
end them. Every local rank starts as a standby (worker.py): it prepares
(imports torch and what the pool preloads, most of a start) and waits for a
line on its stdin before it connects. A cold start activates its ranks at
once; `Standby` keeps the next session's ranks prepared and idle, so that
`restart()` only has to activate them.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from workbench.pool import crash_report, launch
from workbench.pool.health import ProcessSample
from workbench.pool.zygote import ForkedRank, Zygote, ZygoteError

log = logging.getLogger("workbench.pool")

Output = Callable[[int, str, str], None]
LAST_WORDS = 40
"""Lines of a rank's stderr shown in the report of its death (faulthandler's stacks of a few threads), beside the
crashing thread's native frames (crash_report)."""
STDERR_KEPT = 2000
"""Lines of a rank's stderr held for that report: torch's native stacks of every thread (~20 lines each) come
before or after faulthandler's, and the crashing thread's may be among the first."""
PREPARED = "\0workbench: prepared"
"""What a rank prints once prepared (worker.PREPARED; not imported: the notebook need not import the worker)."""


def rank_environment(threads: int, extra: dict[str, str], prepare: dict) -> dict[str, str]:
    """The environment of a local rank: the notebook's, with one rank's threads, our package importable, none
    of torchrun's variables (a notebook started under torchrun must not hand them down), the pool's variables
    (`extra`, set before torch is imported) and what to prepare."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [launch.package_root(), os.environ.get("PYTHONPATH")])))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    env.update(extra)
    env["WORKBENCH_PREPARE"] = json.dumps(prepare)
    return env


class LocalRanks:
    """The local rank processes of one session, by rank: spawned preparing, then told to connect."""

    def __init__(self, address: str, key_file: str, world_size: int, env: dict[str, str], on_output: Output, *,
                 nice: bool = False, zygote: "Zygote | None" = None, fork_timeout_s: float = 120.0) -> None:
        self.procs: dict[int, subprocess.Popen | ForkedRank] = {}
        self.prepared: set[int] = set()
        # What each rank wrote last to its file descriptor 2: only native code and crashes write there (its
        # Python stderr goes to the notebook through the pool), so it says how a rank that died, died.
        self._last_stderr = {r: deque(maxlen=STDERR_KEPT) for r in range(world_size)}
        self._stderr_closed = {r: threading.Event() for r in range(world_size)}
        self.spawned_at = time.monotonic()
        self.activated_at: float | None = None
        for r in range(world_size):
            argv = launch.local_worker_argv(address, key_file, r, world_size) + ["--standby"]
            argv += ["--nice"] if nice else []
            self.procs[r] = self._start(argv, env, zygote, fork_timeout_s)
            for stream in ("stdout", "stderr"):
                threading.Thread(target=self._pump, args=(getattr(self.procs[r], stream), r, stream, on_output),
                                 daemon=True, name=f"workbench-rank{r}-{stream}").start()

    def _start(self, argv: list[str], env: dict[str, str], zygote: "Zygote | None",
               fork_timeout_s: float) -> "subprocess.Popen | ForkedRank":
        if zygote is not None and zygote.alive:
            try:
                return zygote.fork(argv[3:], env, fork_timeout_s)  # after `python -m workbench.pool.worker`
            except ZygoteError as e:
                log.warning("workbench pool: %s; spawning the rank instead", e)
        return subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    def activate(self) -> None:
        """Tell every rank to connect (each does so once prepared); a standby taken early is reniced now."""
        self.activated_at = time.monotonic()
        for proc in self.procs.values():
            try:
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
            except OSError:
                pass  # it died: its exit code tells the health check
            _renice(proc.pid)

    def pid(self, rank: int) -> int | None:
        proc = self.procs.get(rank)
        return None if proc is None else proc.pid

    @property
    def pids(self) -> list[int]:
        return [self.procs[r].pid for r in sorted(self.procs)]

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs.values())

    @property
    def ready(self) -> bool:
        """Every rank prepared (and waiting, if not yet activated)."""
        return len(self.prepared) == len(self.procs)

    def memory_bytes(self) -> int:
        """What its processes cost the machine in memory: their proportional set size (shared library pages
        counted once across the processes that map them; /proc/PID/smaps_rollup); 0 where there is no /proc."""
        return sum(proportional_memory(proc.pid) for proc in self.procs.values())

    def sample(self, rank: int) -> ProcessSample | None:
        """The rank's process state and CPU time as the kernel sees them; None where there is no /proc."""
        proc = self.procs.get(rank)
        return None if proc is None else sample_process(proc.pid)

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
            if isinstance(proc, ForkedRank):
                proc.zygote.forget(proc.pid)  # its exit code is kept in proc: the zygote's record is not needed
            try:
                proc.stdin.close()
            except OSError:
                pass

    def _pump(self, pipe, rank: int, stream: str, on_output: Output) -> None:
        """Forward what a local rank writes to its file descriptors (C++ warnings, crashes) to the notebook."""
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if line == PREPARED and stream == "stdout":
                self.prepared.add(rank)
            else:
                if stream == "stderr":
                    self._last_stderr[rank].append(line)
                on_output(rank, stream, line)
        pipe.close()
        if stream == "stderr":
            self._stderr_closed[rank].set()

    def last_words(self, rank: int, wait_s: float = 0.5) -> list[str]:
        """The last lines rank `rank` wrote to its stderr file descriptor (a crash's report: faulthandler's stacks,
        a C++ abort's message), once the pipe has closed or `wait_s` has passed."""
        if rank not in self._last_stderr:
            return []
        self._stderr_closed[rank].wait(wait_s)
        return crash_report.condense(list(self._last_stderr[rank]), LAST_WORDS)


@dataclass(frozen=True)
class StandbyInfo:
    """The warm standby as `pool.standby` shows it."""

    enabled: bool
    ranks: int
    """Processes waiting (0: none now; being refilled, or off)."""
    ready: bool
    """All of them prepared: a restart now takes about a second."""
    memory_mb: float
    """What they hold in memory (proportional set size): the price of a fast restart."""
    pids: tuple[int, ...] = ()

    def __str__(self) -> str:
        if not self.enabled:
            return "standby off"
        if not self.ranks:
            return "no standby (refilling)"
        return f"standby {'ready' if self.ready else 'preparing'}: {self.ranks} ranks, {self.memory_mb:.0f} MB"


class Standby:
    """The next session's ranks, spawned and prepared ahead: `take()` hands them over, `refill()` spawns more.

    `spawn(nice)` makes a LocalRanks; a standby prepares niced where it can be reniced back (worker.py), so
    filling it takes CPU the session leaves idle.
    """

    def __init__(self, spawn: Callable[..., LocalRanks], enabled: bool = True) -> None:
        self._spawn, self.enabled = spawn, enabled
        self._lock = threading.Lock()
        self._cohort: LocalRanks | None = None

    def spawn_now(self) -> LocalRanks:
        """Ranks for a session that starts now (a cold start): at normal priority, not kept as the standby."""
        return self._spawn(nice=False)

    def refill(self) -> None:
        with self._lock:
            if self.enabled and self._cohort is None:
                self._cohort = self._spawn(nice=True)

    def take(self) -> LocalRanks | None:
        """The standby ranks (prepared, or still preparing) if they are all alive; None otherwise."""
        with self._lock:
            cohort, self._cohort = self._cohort, None
        if cohort is not None and not cohort.alive():
            cohort.stop(0.0)
            return None
        return cohort

    def info(self) -> StandbyInfo:
        cohort = self._cohort
        if cohort is None:
            return StandbyInfo(self.enabled, 0, False, 0.0)
        return StandbyInfo(self.enabled, len(cohort.procs), cohort.ready, cohort.memory_bytes() / 2**20,
                           tuple(cohort.pids))

    def close(self) -> None:
        self.enabled = False
        cohort = self.take()
        if cohort is not None:
            cohort.stop(0.0)


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def sample_process(pid: int) -> ProcessSample | None:
    """State and user + system CPU seconds of process `pid` from /proc/PID/stat (Linux); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state is field 3 of the file, utime and stime fields 14 and 15.
    return ProcessSample(fields[0].decode(), (int(fields[11]) + int(fields[12])) / _TICKS)


def proportional_memory(pid: int) -> int:
    """Bytes of process `pid`'s proportional set size; its resident size where the kernel has no smaps_rollup."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _renice(pid: int) -> None:
    """Every thread of a standby back to the notebook's priority (it lowered its own while preparing)."""
    from workbench.pool.world import restore_priority

    restore_priority(os.getpriority(os.PRIO_PROCESS, 0), pid)
