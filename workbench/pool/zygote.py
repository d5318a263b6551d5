"""Local ranks forked from a zygote instead of spawned: a start in a tenth of a second instead of six.

Spawning a local rank is mostly importing (torch, the engine's modules, torch._dynamo: ~6 s of a core here,
`benches/latency.py`), and none of it depends on the session. A zygote
(`workbench.pool.zygote_process`) is one process that has done it; asked for a rank, it forks one (~0.1 s,
`benches/zygote.py`), whose memory it shares until written. The notebook keeps one per way of preparing (the
same device, preload, backend and environment), shared by the pools of this process: the first start waits for
it to prepare (about what spawning would take), every later one (a restart, the standby, the next Workbench)
forks. It stays `zygotes.LINGER_S` after its last pool closes, for the Workbench a next cell may make, then ends; it
ends with the notebook in any case (its end of the socket closes).

By default the zygote is the user's standby instead (`workbench.pool.user_standby`): the same process, but one
that outlives the kernel, so that the next kernel (a restart, another notebook) forks at once too.

CPU pools only: a process that has touched CUDA cannot fork a rank that uses it. `$WORKBENCH_ZYGOTE=0` spawns
every rank as before.
"""

from __future__ import annotations

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


log = logging.getLogger("workbench.pool")



class ZygoteError(RuntimeError):
    """The zygote could not fork a rank (it failed to prepare, or died): the pool spawns ranks instead."""


def hang_up(sock: socket.socket) -> None:
    """Shut both directions before closing: a thread blocked in recv on this socket wakes at once (a bare close
    leaves it blocked), and so does the peer."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class PrivateChannel:
    """The socket pair to a zygote this process started: JSON both ways, and no one else can reach it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def handshake(self) -> dict:
        return {}  # nothing to prove: the zygote says "prepared" itself

    def send(self, message: dict, fds: list[int] | None = None) -> None:
        socket.send_fds(self.sock, [json.dumps(message).encode()], fds or [])

    def recv(self) -> dict | None:
        data = self.sock.recv(1 << 16)
        return json.loads(data) if data else None

    def close(self) -> None:
        hang_up(self.sock)


class Zygote:
    """A prepared process that forks ranks, and what it says: prepared, each fork's pid, each child's exit code.

    Either this process's own (`start_private`: it ends with this process) or the user's standby
    (`workbench.pool.user_standby`: it outlives it); `channel` is the way to it.
    """

    def __init__(self, channel, pid: int, origin: str, proc: subprocess.Popen | None = None) -> None:
        self.channel, self.pid, self.origin, self.proc = channel, pid, origin, proc
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

    @classmethod
    def start_private(cls, env: dict[str, str], prepare: dict) -> "Zygote":
        """A zygote of this process's own, ending with it (its end of the socket pair closes)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "workbench.pool.zygote_process", str(theirs.fileno())],
                                    env=zygote_environment(env, prepare), pass_fds=(theirs.fileno(),),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            theirs.close()
        return cls(PrivateChannel(ours), proc.pid, "this process's zygote", proc)

    @property
    def prepared(self) -> bool:
        """Done preparing: a fork now takes about a tenth of a second."""
        return self._prepared and self.alive

    @property
    def alive(self) -> bool:
        return not self._gone and self.failed is None

    def wait_prepared(self, timeout_s: float) -> bool:
        """Until it is prepared (True), or failed, ended, or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._prepared and self.alive and time.monotonic() < deadline:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
        return self.prepared

    def fork(self, args: list[str], env: dict[str, str], timeout_s: float) -> "ForkedRank":
        """A rank running `python -m workbench.pool.worker *args` in `env`, forked once the zygote is prepared."""
        deadline = time.monotonic() + timeout_s
        if not self.wait_prepared(timeout_s):
            raise ZygoteError(self.failed or ("the zygote ended" if self._gone else
                                              f"not prepared within {timeout_s:.0f} s"))
        pipes = [os.pipe() for _ in range(3)]
        stdin, stdout, stderr = pipes
        theirs = [stdin[0], stdout[1], stderr[1]]
        request = next(self._ids)
        try:
            with self._send_lock:
                self.channel.send({"type": "fork", "id": request, "args": args, "env": env, "cwd": os.getcwd()},
                                  theirs)
        except OSError as e:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            raise ZygoteError(f"the zygote is gone ({e})") from None
        for fd in theirs:
            os.close(fd)
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
        """Let go of the zygote: this process's own ends (its ranks, if any, see their parent change and end too);
        the user's standby goes on, for the next kernel."""
        self._gone = True
        self.channel.close()
        if self.proc is None:
            return
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def _read(self) -> None:
        try:
            said = self.channel.handshake()
        except Exception as e:  # noqa: BLE001 - said as the reason the pool spawns instead
            said = {"failed": str(e) or type(e).__name__}
        while True:
            with self._changed:
                if "failed" in said:
                    self.failed = f"{self.origin} could not prepare:\n" + said["failed"]
                    log.warning("workbench pool: %s; spawning ranks instead", self.failed)
                elif "prepared" in said:
                    self._prepared = True
                elif "pid" in said:
                    self._pids[said["id"]] = said["pid"]
                elif "error" in said:
                    self._pids[said["id"]] = said["error"]
                elif "exit" in said:
                    self._exits[said["exit"]] = said["code"]
                self._changed.notify_all()
                if "failed" in said:
                    return
            try:
                said = self.channel.recv()
            except OSError:
                said = None
            if said is None:
                with self._changed:
                    self._gone = True
                    self._changed.notify_all()
                return


def zygote_environment(env: dict[str, str], prepare: dict) -> dict[str, str]:
    """A zygote's own environment: the ranks' shared one, one OpenMP thread until a rank sets its own (torch starts
    a pool thread at import without the variable), and what to prepare."""
    return {**env, "OMP_NUM_THREADS": "1", "WORKBENCH_PREPARE": json.dumps({**prepare, "threads": 1})}


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
