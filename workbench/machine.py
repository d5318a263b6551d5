"""How many local ranks this machine holds: a pure verdict from its cores and memory, and where to read them; the
cores each local rank gets; and what is measured about the machine, kept once per pool (`machine_fact`).

A rank is a whole Python process with torch, the engine and the telemetry
extension loaded: `benches/rank_memory.py` measures it (about 0.3 GB idle and
0.4 GB with the tiny model applied, RSS, on the 2-core CPU machine). More
ranks than cores still run, slower (they take turns; a collective waits for
the last). More than the memory holds fail at `apply` or thrash, so that is
refused unless the user says otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workbench.config import ConfigError

RANK_MEMORY_BYTES = 400 * 2**20
"""A rank's resident memory with the tiny model applied (benches/rank_memory.py); larger models add their share."""


@dataclass(frozen=True)
class Machine:
    """What the local ranks share."""

    cores: int
    total_bytes: int
    available_bytes: int

    @classmethod
    def this(cls) -> Machine:
        """This machine: the cores this process may run on, and memory from /proc/meminfo (Linux)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        info = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, value = line.split(":", 1)
                    info[key] = int(value.split()[0]) * 1024
        except OSError:  # not Linux: no memory figure, so no memory verdict
            pass
        total = info.get("MemTotal", 0)
        return cls(cores=cores, total_bytes=total, available_bytes=info.get("MemAvailable", total))


def run_queue_wait_s(pids: list[int]) -> float:
    """Seconds the threads of processes `pids` have waited for a core so far: the kernel's run-queue time
    (/proc/PID/task/*/schedstat, its second field). How busy the machine was while ranks ran: a rank that waits for
    a core stretches its peer's idle time, which a measured pipeline bubble counts. 0 where the kernel does not
    say; a thread that has ended takes its count with it, so take differences over a span its threads live."""
    import glob

    total = 0
    for pid in pids:
        for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
            try:
                with open(path) as f:
                    total += int(f.read().split()[1])
            except (OSError, ValueError, IndexError):
                pass  # the thread ended meanwhile
    return total / 1e9


def world_size_warning(world_size: int, machine: Machine, *, oversubscribe: bool = False) -> str | None:
    """Refuse (ConfigError) `world_size` local ranks when their estimated memory exceeds the machine's, unless
    `oversubscribe`; otherwise a warning when they exceed its cores or its available memory, or None."""
    need = world_size * RANK_MEMORY_BYTES
    estimate = f"{world_size} ranks need about {need / 2**30:.1f} GB (≈{RANK_MEMORY_BYTES / 2**30:.1f} GB each " \
               "with torch loaded and the tiny model applied; larger models more)"
    if machine.total_bytes and need > machine.total_bytes and not oversubscribe:
        raise ConfigError(f"world_size: {estimate}, and this machine has {machine.total_bytes / 2**30:.1f} GB. "
                          f"Fix: use world_size ≤ {max(1, machine.total_bytes // RANK_MEMORY_BYTES)}, or pass "
                          "oversubscribe=True to start them anyway.")
    problems = []
    if world_size > machine.cores:
        problems.append(f"{world_size} ranks share {machine.cores} cores: they take turns, so steps run slower "
                        "than one rank per core would")
    if machine.available_bytes and need > machine.available_bytes:
        problems.append(f"{estimate}, and {machine.available_bytes / 2**30:.1f} GB are available: the machine may "
                        "swap")
    return "; ".join(problems) + "." if problems else None


def threads_per_rank(local_ranks: int) -> int:
    """The intra-op threads each of `local_ranks` ranks on this machine gets unless told: the cores shared out."""
    return max(1, (os.cpu_count() or 1) // local_ranks)


MACHINE_FACTS = "WORKBENCH_MACHINE_FACTS"
"""The environment variable naming the folder where local ranks keep `machine_fact`s: the user's runtime folder
(`pool.runtime_dir`), shared by every pool and kernel of the user, or a pool's private folder where that is
unusable."""


def machine_fact(name: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """What `measure()` finds out about this machine (a JSON-able dict), measured once per machine.

    The first rank that needs it measures; every later rank, of this pool or of a pool of another kernel of the
    user, reads the answer instead of measuring again, so neither a restart nor a notebook's first apply pays for it
    (a CPU's matmul peak takes about a second) and every session divides by the same figure. Kept as JSON (never
    unpickled) under the machine's identity (`machine_identity`: CPU, cores, Python, torch), in the folder
    $WORKBENCH_MACHINE_FACTS names, until that folder is emptied (the user's runtime folder is at logout or reboot;
    remove its `machine` folder to measure again); measured at each call where there is no folder (the notebook,
    remote ranks).
    """
    folder = os.environ.get(MACHINE_FACTS)
    if not folder:
        return measure()
    path = os.path.join(folder, re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}-{machine_identity()}") + ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass  # not measured yet (or a half-written file of a rank that died: measure again)
    value = measure()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)  # ranks measuring at once each write a whole file; the last one stays
    return value


@functools.cache
def machine_identity() -> str:
    """A short hash of what a measurement of this machine depends on: the CPU model, the cores this process may
    use, the host, Python and torch (if imported). A fact measured under another identity is measured again."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch = sys.modules.get("torch")
    what = [cpu, cores, os.cpu_count(), platform.node(), sys.version, getattr(torch, "__version__", "")]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]
