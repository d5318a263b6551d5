"""Local ranks forked from a zygote instead of spawned: a start in a tenth of a second instead of six.

Spawning a local rank is mostly importing (torch, the engine's modules, torch._dynamo: ~6 s of a core here,
`benches/latency.py`), and none of it depends on the session. A zygote
(`workbench.pool.zygote_process`) is one process that has done it; asked for a rank, it forks one (~0.1 s,
`benches/zygote.py`), whose memory it shares until written. The notebook keeps one per way of preparing (the
same device, preload, backend and environment), shared by the pools of this process: the first start waits for
it to prepare (about what spawning would take), every later one (a restart, the standby, the next Workbench)
forks. It stays `LINGER_S` after its last pool closes, for the Workbench a next cell may make, then ends; it
ends with the notebook in any case (its end of the socket closes).

CPU pools only: a process that has touched CUDA cannot fork a rank that uses it. `$WORKBENCH_ZYGOTE=0` spawns
every rank as before.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from workbench.machine import MACHINE_FACTS
from workbench.pool.private_dir import DRIVER_PID

log = logging.getLogger("workbench.pool")

LINGER_S = 120.0
"""How long a zygote outlives its last pool (a Workbench remade in the next cell forks instead of spawning)."""
MAX_ZYGOTES = 2
"""Zygotes kept at once in a process (each ~300 MB); the least recently used idle one ends first."""
PER_POOL = (MACHINE_FACTS, "WORKBENCH_PREPARE", "OMP_NUM_THREADS", DRIVER_PID)
"""Environment that differs between pools but is read only after the fork (the child gets the pool's own)."""


class ZygoteError(RuntimeError):
    """The zygote could not fork a rank (it failed to prepare, or died): the pool spawns ranks instead."""


class Zygote:
    """One zygote process and what it says: prepared, each fork's pid, each child's exit code."""

    def __init__(self, env: dict[str, str], prepare: dict) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # One OpenMP thread until a rank sets its own (torch starts a pool thread at import without the variable).
        env = {**env, "OMP_NUM_THREADS": "1", "WORKBENCH_PREPARE": json.dumps({**prepare, "threads": 1})}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "workbench.pool.zygote_process", str(theirs.fileno())],
                                         env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        self.users = 0
        self.last_used = time.monotonic()
        self.failed: str | None = None
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self._prepared = False
        self._gone = False
        self._pids: dict[int, int | str] = {}
        self._exits: dict[int, int] = {}
        threading.Thread(target=self._read, name="workbench-zygote", daemon=True).start()

    @property
    def prepared(self) -> bool:
        """Done preparing: a fork now takes about a tenth of a second."""
        return self._prepared and self.alive

    @property
    def alive(self) -> bool:
        return not self._gone and self.failed is None

    def fork(self, args: list[str], env: dict[str, str], timeout_s: float) -> "ForkedRank":
        """A rank running `python -m workbench.pool.worker *args` in `env`, forked once the zygote is prepared."""
        pipes = [os.pipe() for _ in range(3)]
        stdin, stdout, stderr = pipes
        theirs = [stdin[0], stdout[1], stderr[1]]
        request = next(self._ids)
        try:
            with self._send_lock:
                message = {"id": request, "args": args, "env": env, "cwd": os.getcwd()}
                socket.send_fds(self.sock, [json.dumps(message).encode()], theirs)
        except OSError as e:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            raise ZygoteError(f"the zygote is gone ({e})") from None
        for fd in theirs:
            os.close(fd)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while request not in self._pids and self.alive and time.monotonic() < deadline:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
            pid = self._pids.pop(request, None)
        if not isinstance(pid, int):
            for fd in (stdin[1], stdout[0], stderr[0]):
                os.close(fd)
            raise ZygoteError(pid or self.failed or ("the zygote ended" if self._gone else
                                                      f"no fork within {timeout_s:.0f} s"))
        self.last_used = time.monotonic()
        return ForkedRank(self, pid, args, os.fdopen(stdin[1], "wb"), os.fdopen(stdout[0], "rb"),
                          os.fdopen(stderr[0], "rb"))

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout_s: float | None) -> int | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while pid not in self._exits and not self._gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)
            return self._exits.get(pid)

    def forget(self, pid: int) -> None:
        with self._changed:
            self._exits.pop(pid, None)

    def close(self) -> None:
        """End the zygote (its ranks, if any, see their parent change and end too)."""
        self._gone = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._gone = True
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "prepared" in message:
                    self._prepared = True
                elif "failed" in message:
                    self.failed = "the zygote could not prepare:\n" + message["failed"]
                    log.warning("workbench pool: %s; spawning ranks instead", self.failed)
                elif "pid" in message:
                    self._pids[message["id"]] = message["pid"]
                elif "error" in message:
                    self._pids[message["id"]] = message["error"]
                elif "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                self._changed.notify_all()


class ForkedRank:
    """A rank the zygote forked, with the part of `subprocess.Popen` that `LocalRanks` uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str], stdin, stdout, stderr) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
            if self.returncode is None and self.zygote._gone and not Path(f"/proc/{self.pid}").exists():
                self.returncode = -signal.SIGKILL  # its zygote ended before it could say how it did
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self.zygote.wait_exit(self.pid, timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# -- the process's zygotes ---------------------------------------------------------------------------
_lock = threading.Lock()
_zygotes: dict[str, Zygote] = {}
_lingering: dict[str, threading.Timer] = {}


def usable(device: str) -> bool:
    """Whether ranks of a pool on `device` may be forked: CPU ranks, zygotes not turned off."""
    if os.environ.get("WORKBENCH_ZYGOTE", "1") == "0":
        return False
    return device == "cpu" or (device == "auto" and not any(Path("/dev").glob("nvidia[0-9]*")))


def acquire(env: dict[str, str], prepare: dict) -> Zygote:
    """The zygote for ranks with this environment and preparation (started if there is none); `release` it."""
    shared = {k: v for k, v in env.items() if k not in PER_POOL}
    key = _key(shared, prepare)
    with _lock:
        timer = _lingering.pop(key, None)
        if timer is not None:
            timer.cancel()
        zygote = _zygotes.get(key)
        if zygote is None or not zygote.alive:
            if zygote is not None:
                zygote.close()
            _evict_idle(keep=MAX_ZYGOTES - 1)
            zygote = _zygotes[key] = Zygote(shared, prepare)
        zygote.users += 1
        return zygote


def release(zygote: Zygote) -> None:
    """A pool no longer needs `zygote`; the last one leaves it `LINGER_S` for the next pool, then it ends."""
    with _lock:
        zygote.users -= 1
        if zygote.users > 0:
            return
        key = next((k for k, z in _zygotes.items() if z is zygote), None)
        if key is None:
            return
        timer = threading.Timer(LINGER_S, _end_if_idle, args=(key, zygote))
        timer.daemon = True
        timer.name = "workbench-zygote-linger"
        _lingering[key] = timer
        timer.start()


def close_all() -> None:
    with _lock:
        for timer in _lingering.values():
            timer.cancel()
        _lingering.clear()
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()


def _end_if_idle(key: str, zygote: Zygote) -> None:
    with _lock:
        if zygote.users or _zygotes.get(key) is not zygote:
            return
        del _zygotes[key]
        _lingering.pop(key, None)
    zygote.close()


def _evict_idle(keep: int) -> None:
    idle = sorted((z.last_used, k) for k, z in _zygotes.items() if not z.users)
    while len(_zygotes) > keep and idle:
        _, key = idle.pop(0)
        timer = _lingering.pop(key, None)
        if timer is not None:
            timer.cancel()
        _zygotes.pop(key).close()


def _key(shared: dict[str, str], prepare: dict) -> str:
    return json.dumps([shared, {k: v for k, v in prepare.items() if k not in ("private_dir", "threads")}],
                      sort_keys=True)


atexit.register(close_all)
