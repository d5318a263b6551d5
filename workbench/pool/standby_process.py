"""The user's standby: a zygote that outlives the kernel that started it, forking ranks for the kernels after it.

Run as `python -m workbench.pool.standby_process FOLDER NAME` by `user_standby` (in a session of its own, so a
kernel's process group being signalled does not end it). It takes NAME.lock (or exits: one already runs), says
who it is (NAME.json), writes a fresh key, listens on NAME.sock, prepares as the kernel's own zygote would
(`world.prepare`), then serves: kernels that prove they hold the key (standby_wire) ask for ranks, as they ask
their own zygote (zygote_process.py), and hear of each fork and each exit. It holds nothing of any kernel but
what that kernel's requests carry, and every rank is forked from the same prepared state: no model, no state of
an earlier kernel.

It ends
- when no kernel has been connected and no rank of it has run for $WORKBENCH_STANDBY_IDLE_S (IDLE_S);
- when its socket is removed or replaced (`user_standby.stop`, a test run's folder removed), once no kernel uses it;
- on SIGTERM or SIGKILL, at any moment: its ranks then see their parent change and end, as they would at their
  kernel's death, and the lock, held by the process, is freed with it.
A kernel that goes away (closed, or killed) leaves its ranks `GRACE_S` to end by themselves (they see their
stdin close) before they are killed.

Like the kernel's zygote it forks only while it has one thread, and starts none.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from workbench.pool import protocol, standby_wire as wire
from workbench.pool.launch import write_key_file
from workbench.pool.process_name import name_process
from workbench.pool.zygote_process import become_rank, drained, reap, thread_count

IDLE_S = float(os.environ.get("WORKBENCH_STANDBY_IDLE_S", 1800))
"""How long the standby waits, with no kernel connected and no rank running, before it exits (~300 MB held)."""
GRACE_S = 3.0


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + wire.HANDSHAKE_S
        self.challenge: str | None = None  # set by its knock: the hello must echo it
        self.channel: wire.SignedChannel | None = None
        self.proved = False
        self.children: set[int] = set()


class Standby:
    def __init__(self, listener: socket.socket, key: bytes, fingerprint: dict, paths: wire.Paths, lock: int) -> None:
        self.listener: socket.socket | None = listener
        self.key, self.fingerprint, self.paths, self.lock = key, fingerprint, paths, lock
        self.inode = os.stat(paths.socket).st_ino
        self.connections: dict[socket.socket, _Connection] = {}
        self.children: dict[int, _Connection | None] = {}
        self.orphans: dict[int, float] = {}  # rank -> when it is killed, its kernel gone
        self.idle_since = time.monotonic()
        self.wake = os.pipe()
        for fd in self.wake:
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake[1])

    def serve(self) -> None:
        while True:
            now = time.monotonic()
            if self.listener is not None and not self._still_ours():
                self._stop_listening()
            if any(c.proved for c in self.connections.values()) or self.children:
                self.idle_since = now
            elif self.listener is None or now - self.idle_since >= IDLE_S:
                self._exit()
            waits = [c.deadline for c in self.connections.values() if not c.proved] + list(self.orphans.values())
            timeout = max(0.0, min([now + 1.0, *waits]) - now)
            watched = [*self.connections, self.wake[0], *([self.listener] if self.listener else [])]
            readable = select.select(watched, [], [], timeout)[0]
            if self.wake[0] in readable:
                while drained(self.wake[0]):
                    pass
            reap(set(self.children), self._ended)
            if self.listener is not None and self.listener in readable:
                self._accept()
            for sock in readable:
                if sock in self.connections:
                    self._receive(self.connections[sock])
            now = time.monotonic()
            for conn in [c for c in self.connections.values() if not c.proved and c.deadline <= now]:
                self._drop(conn)
            for pid, when in list(self.orphans.items()):
                if when <= now:
                    _kill(pid)
                    del self.orphans[pid]

    # -- connections -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if sum(not c.proved for c in self.connections.values()) >= wire.MAX_STRANGERS:
                sock.close()
                continue
            self.connections[sock] = _Connection(sock)

    def _receive(self, conn: _Connection) -> None:
        try:
            if not conn.proved:
                self._handshake(conn)
                return
            message, fds = conn.channel.recv(wire.REQUEST_BYTES, 3)
        except (protocol.Rejected, OSError, ValueError) as e:
            print(f"workbench standby: closed a connection ({e})", file=sys.stderr, flush=True)
            self._drop(conn)
            return
        if message is None:
            self._drop(conn)
        elif message.get("type") == "fork":
            self._fork(conn, message, fds)
        else:
            wire.close_all(fds)

    def _handshake(self, conn: _Connection) -> None:
        """The knock, then the hello; anything else, or more, closes the connection (its descriptors closed)."""
        data, fds = wire.receive(conn.sock, wire.UNAUTHENTICATED_BYTES, 3)
        wire.close_all(fds)  # a stranger's descriptors are never kept
        if not data or fds:
            raise ValueError("closed" if not data else "descriptors before the handshake")
        if conn.challenge is None:
            match = wire.KNOCK.fullmatch(data)
            if match is None:
                raise ValueError("not a knock")
            conn.challenge = secrets.token_hex(16)
            conn.channel = wire.SignedChannel(conn.sock, self.key, "standby", secrets.token_hex(8))
            conn.channel.send({"type": "welcome", "nonce": match[1].decode(), "challenge": conn.challenge,
                               "pid": os.getpid(), "fingerprint": self.fingerprint})
            return
        message, _ = wire.open_datagram(conn.channel.verifier, data, [])
        if not (isinstance(message, dict) and message.get("type") == "hello"
                and isinstance(message.get("challenge"), str)
                and secrets.compare_digest(message["challenge"], conn.challenge)):
            raise ValueError("a hello that does not answer the challenge")
        conn.proved = True

    def _drop(self, conn: _Connection) -> None:
        """Forget a connection; its kernel's ranks get GRACE_S to end by themselves."""
        self.connections.pop(conn.sock, None)
        conn.sock.close()
        for pid in conn.children:
            self.children[pid] = None
            self.orphans[pid] = time.monotonic() + GRACE_S

    # -- ranks ------------------------------------------------------------------------------------
    def _fork(self, conn: _Connection, request: dict, fds: list[int]) -> None:
        if len(fds) != 3 or thread_count() != 1:
            conn.channel.send({"id": request.get("id"),
                               "error": f"cannot fork: {len(fds)} descriptors, {thread_count()} threads"})
            wire.close_all(fds)
            return
        pid = os.fork()
        if pid == 0:
            become_rank([*self.connections, *([self.listener] if self.listener else []), *self.wake, self.lock],
                        fds, request)
        wire.close_all(fds)  # the child's now: the kernel must see their ends close when the child exits
        self.children[pid] = conn
        conn.children.add(pid)
        self._send(conn, {"id": request.get("id"), "pid": pid})

    def _ended(self, pid: int, code: int) -> None:
        conn = self.children.pop(pid, None)
        self.orphans.pop(pid, None)
        if conn is not None:
            conn.children.discard(pid)
            self._send(conn, {"exit": pid, "code": code})

    def _send(self, conn: _Connection, message: dict) -> None:
        try:
            conn.channel.send(message)
        except OSError:
            self._drop(conn)

    # -- its end ----------------------------------------------------------------------------------
    def _still_ours(self) -> bool:
        try:
            return os.stat(self.paths.socket).st_ino == self.inode
        except OSError:
            return False

    def _stop_listening(self) -> None:
        """Its socket was removed or replaced: no new kernel comes; it ends once the ones it serves are done."""
        self.listener.close()
        self.listener = None
        for conn in [c for c in self.connections.values() if not c.proved]:
            self._drop(conn)

    def _exit(self) -> None:
        if self.listener is not None and self._still_ours():
            for path in (self.paths.socket, self.paths.description, self.paths.key):
                path.unlink(missing_ok=True)
        os._exit(0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _describe(paths: wire.Paths, described: dict) -> None:
    """Who it is, what it is prepared for, and (once prepared) how long each part of its preparation took."""
    tmp = paths.description.with_suffix(".json.tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(json.dumps(described))
    os.replace(tmp, paths.description)


def _since_exec() -> float:
    """Seconds since this process started (its interpreter's start and imports included)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    paths = wire.Paths(Path(sys.argv[1]), sys.argv[2])
    name_process("wb-standby")
    lock = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os._exit(0)  # one already runs for this name: the kernel connects to it
    log = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)
    os.close(log)
    fingerprint = json.loads(os.environ.pop(wire.FINGERPRINT_ENV))
    described = {"pid": os.getpid(), "started": time.time(), "fingerprint": fingerprint}
    _describe(paths, described)
    key = write_key_file(paths.key)
    paths.socket.unlink(missing_ok=True)  # a dead standby's: we hold the lock
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    umask = os.umask(0o177)  # the socket is born 0600
    try:
        listener.bind(str(paths.socket))
    finally:
        os.umask(umask)
    listener.listen(64)  # kernels that come while it prepares wait here for their welcome
    try:
        from workbench.pool import world

        begun = time.monotonic()
        prepared = world.prepare(json.loads(os.environ["WORKBENCH_PREPARE"]), 0, 1)
    except BaseException:  # noqa: BLE001 - the kernels waiting read why, and fork their ranks elsewhere
        print(f"workbench standby: could not prepare\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        paths.socket.unlink(missing_ok=True)
        os._exit(1)
    marks = [("torch", begun), *prepared.marks.items()]
    described["preparation"] = {"interpreter and workbench": _since_exec() - (time.monotonic() - begun),
                                **{b: t1 - t0 for (_, t0), (b, t1) in zip(marks, marks[1:])}}
    _describe(paths, described)
    listener.setblocking(False)
    Standby(listener, key, fingerprint, paths, lock).serve()


if __name__ == "__main__":
    main()
