"""The peers that also keep ranks alive between notebook cells, run with benches/ddp_loop.py beside the pool.

Each runs in a fresh interpreter of its own (`python benches/peers.py PEER` prints one JSON line), so that none
inherits another's imports; benches/pool.py calls `measure(peer)` and prints the table. What each figure is:

- ready: from the call that starts the ranks until they answer (the interpreter's own start and the
  peer's import are not counted);
- no-op: the median round trip of an empty call to every rank;
- 10 DDP steps: the median of calls running `ddp_loop.steps` on a model kept on the ranks (built once before).

nbdistributed 0.1.0 (`%dist_init -n 2`, `%%distributed` cells; driven through IPython's InteractiveShell, as a
notebook would) is also looked at for what it exposes, measured while it runs: the listening sockets of its
processes and their addresses (`ss -ltnp`), whether a pickle sent by a process that holds no key is unpickled by
the notebook (a payload that creates a file when unpickled), and whether `%dist_shutdown` ends its workers.
Its `%dist_reset` is never called: it runs `pkill -f worker.py` (and two other patterns) across the whole machine.
Workers it leaves are ended here by their pids.

Monarch (torchmonarch 0.7.0): `this_host().spawn_procs(per_host={"procs": 2})`, an actor with endpoints; its procs
import torch only when a call first needs it, so its `ready` holds no torch import and its first DDP build does
(reported apart, as `first build`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOOPS = 50
REPEATS = 5
PEERS = {"nbdistributed": "nbdistributed", "monarch": "monarch"}
"""Peer name -> the module that must be importable for it to run."""


def installed(peer: str) -> bool:
    return importlib.util.find_spec(PEERS[peer]) is not None


def measure(peer: str, timeout_s: float = 600) -> dict:
    """Run one peer in a fresh interpreter; its figures (or {"error": ...})."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           # nbdistributed's workers start `python` from PATH: this interpreter's, not the system's.
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    out = subprocess.run([sys.executable, __file__, peer], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout_s)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"error": (out.stderr or out.stdout)[-2000:]}
    return json.loads(lines[-1])


def _median_ms(fn, n: int = NOOPS, skip: int = 5) -> float:
    times = []
    for _ in range(n + skip):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[skip:]) * 1e3


def _median_s(fn, n: int = REPEATS) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- nbdistributed ---------------------------------------------------------------------------------------
def run_nbdistributed() -> dict:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdistributed")
    said = io.StringIO()

    def cell(code: str) -> None:
        with contextlib.redirect_stdout(said):
            shell.run_cell_magic("distributed", "", code)

    t = time.perf_counter()
    with contextlib.redirect_stdout(said):
        shell.run_line_magic("dist_init", "-n 2")
    ready = time.perf_counter() - t
    magic = shell.magics_manager.registry["DistributedMagic"]
    workers = [p.pid for p in magic._process_manager.processes]
    try:
        noop = _median_ms(lambda: cell("pass"), n=20, skip=3)  # ~0.1 s each: it polls every 100 ms
        cell(f"import sys; sys.path.insert(0, {str(HERE)!r}); import ddp_loop; state = ddp_loop.build()")
        steps = _median_s(lambda: cell("ddp_loop.steps(*state)"))
        listening = _listening([os.getpid(), *workers])
        port = magic._comm_manager.base_port
        unpickled = _unauthenticated_pickle(port)
        with contextlib.redirect_stdout(said):
            shell.run_line_magic("dist_shutdown", "")
        time.sleep(2)
        left = [pid for pid in workers if _alive(pid)]
    finally:
        for pid in workers:  # by pid: never its own %dist_reset, which pkills by pattern across the machine
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return {"ready_s": ready, "noop_ms": noop, "steps_s": steps, "listening": listening, "notebook_pid": os.getpid(),
            "unpickled_unauthenticated": unpickled, "workers_left_after_dist_shutdown": len(left),
            "version": _version("nbdistributed")}


STRANGER = """
import pathlib, pickle, sys, zmq
class Plant:  # unpickled, it creates a file: what any process that reaches the port can make the notebook run
    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(sys.argv[2]),))
stranger = zmq.Context().socket(zmq.DEALER)
stranger.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
stranger.send(pickle.dumps(Plant()))
stranger.close(linger=2000)
"""


def _unauthenticated_pickle(port: int) -> bool:
    """From another process, holding no key, send the notebook's port a pickle that creates a file when unpickled;
    whether it was."""
    folder = tempfile.mkdtemp(prefix="peers-")
    planted = Path(folder) / "planted"
    try:
        subprocess.run([sys.executable, "-c", STRANGER, str(port), str(planted)], check=True, timeout=60)
        deadline = time.monotonic() + 5
        while not planted.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return planted.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _listening(pids: list[int]) -> list[str]:
    """The TCP listeners of these processes, as `ss -ltnp` shows them (address:port and the owning pid)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout if shutil.which("ss") else ""
    found = []
    for line in out.splitlines():
        for pid in pids:
            if f"pid={pid}," in line:
                found.append(f"{line.split()[3]} (pid {pid}{', the notebook' if pid == os.getpid() else ''})")
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# -- Monarch -------------------------------------------------------------------------------------------------
def run_monarch() -> dict:
    from monarch.actor import this_host
    from monarch.spmd import setup_torch_elastic_env

    import monarch_loop  # benches/monarch_loop.py: its procs import it by name

    t = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": 2})
    loop = procs.spawn("loop", monarch_loop.Loop)
    loop.noop.call().get()
    ready = time.perf_counter() - t
    try:
        noop = _median_ms(lambda: loop.noop.call().get())
        t = time.perf_counter()
        setup_torch_elastic_env(procs)
        loop.build.call().get()
        first_build = time.perf_counter() - t
        steps = _median_s(lambda: loop.steps.call().get())
    finally:
        procs.stop().get()
    return {"ready_s": ready, "noop_ms": noop, "steps_s": steps, "first_build_s": first_build,
            "version": _version("torchmonarch")}


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    print(json.dumps({"nbdistributed": run_nbdistributed, "monarch": run_monarch}[sys.argv[1]]()), flush=True)
