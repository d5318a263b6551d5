"""A rank: one long-lived process that runs the notebook's commands.

Started by the Pool (`python -m workbench.pool.worker --connect HOST:PORT
--key-file FILE --rank R --world-size N --local --standby`) or, on other
machines, by torchrun/srun (rank and world size then come from the
environment). It connects back to the notebook, proves it holds the key,
joins one torch.distributed world and keeps it until it exits. A local rank
first prepares (imports torch and what the pool preloads: most of a start,
see world.py) and waits for a line on stdin before it connects, so the pool
can start it ahead of need, as a warm standby.

Two threads, each with its own connection to the notebook:
- the main thread runs commands one after another and sends their results,
  events and printed output, so all of them arrive in the order they happened;
- the I/O thread sends heartbeats (with CPU time, so the notebook can tell a
  rank that waits from one that works), answers control messages while a
  command runs (flags, a stack dump, shutdown) and ends the process when the
  notebook is gone (its connection closes, its parent changes or it stops
  answering), so no rank outlives its driver.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import os
import pickle
import queue
import secrets
import socket
import sys
import threading
import time
import traceback
from typing import Any

from workbench.pool import handshake, private_dir, protocol, rank as rank_api, wire, world
from workbench.pool.launch import read_key_file
from workbench.pool.process_name import name_process

CONNECT_TIMEOUT_S = 60.0
"""How long a rank tries to reach (and be welcomed by) the notebook before it gives up."""
PREPARED = "\0workbench: prepared"
"""The line a standby rank writes to its stdout once it is prepared (the pool's output pump reads it)."""


class _Link:
    """One connection to the driver, with its own signer and verifier; used by one thread only."""

    def __init__(self, address: str, key: bytes, sender: str, session: str = "") -> None:
        self.sock = wire.connect(address, CONNECT_TIMEOUT_S)
        self.reader = wire.FrameReader(self.sock, max_frame=None)  # the notebook's frames can be large
        self.signer = protocol.Signer(key, sender, session)
        self.verifier = protocol.Verifier(key, session)

    def send(self, obj: Any) -> None:
        wire.send_all(self.sock, self.signer.seal(obj))

    def recv(self, timeout_ms: int | None) -> Any | None:
        """The next authentic message, or None on timeout; forged ones are dropped. EOFError: the notebook is gone."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            blob = self.reader.next(left)
            if blob is None:
                return None
            try:
                return self.verifier.open(blob)[1]
            except protocol.Rejected as e:
                print(f"workbench worker: dropped a control message ({e})", file=sys.__stderr__)


class _RankStream(io.TextIOBase):
    """sys.stdout/stderr on a rank: whole lines go to the notebook, prefixed there with the rank."""

    def __init__(self, worker: "Worker", name: str) -> None:
        self.worker, self.name, self.buffer_ = worker, name, ""
        self.lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self.lock:
            self.buffer_ += text
            *lines, self.buffer_ = self.buffer_.split("\n")
        for line in lines:
            self.worker.send_output(self.name, line)
        return len(text)

    def flush(self) -> None:
        with self.lock:
            rest, self.buffer_ = self.buffer_, ""
        if rest:
            self.worker.send_output(self.name, rest)


class Worker:
    def __init__(self, address: str, key: bytes, rank: int, world_size: int, local_rank: int,
                 local_world_size: int, local: bool, private: str | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size, self.local = local_rank, local_world_size, local
        self.incarnation = secrets.token_hex(8)
        self.address, self.key = address, key
        self.main: _Link | None = None  # connected by the handshake
        self.io: _Link | None = None  # connected once the handshake has given us the session
        self.main_thread = threading.get_ident()
        self.parent_pid = os.getppid()
        """The notebook, or the zygote that forked this rank (it ends with the notebook): a change means both are gone."""
        self.driver_pid = int(os.environ.get(private_dir.DRIVER_PID) or self.parent_pid)
        """The notebook's process: whose private folder this rank removes if it died."""
        self.other_output: queue.SimpleQueue = queue.SimpleQueue()
        self.last_driver_contact = time.monotonic()
        self.settings: dict[str, Any] = {}
        self.private_dir = private
        """The pool's private folder (local ranks): removed on the way out if the driver died."""
        self.prepare_traceback = ""
        self.timeline: dict[str, float] = {}
        """When each step of this rank's start happened (time.monotonic, shared by the machine's processes)."""

    # -- handshake -----------------------------------------------------------------------------
    def handshake(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Knock until the driver answers with a challenge echoing our nonce, say hello, receive the settings.

        The welcome is signed, so it proves the driver holds the key; our hello
        echoes its challenge, signed, which proves we do. Only then does the
        driver tell us how to start. A connection the driver closes before we
        proved ourselves (it refuses or closes strangers when too many crowd in, e.g. in a
        flood) is replaced by a new one, until `timeout_s` has passed.
        """
        deadline = time.monotonic() + timeout_s
        problem = "no answer from the driver at the given address"
        while time.monotonic() < deadline:
            if self.local and os.getppid() != self.parent_pid:
                private_dir.remove_if_driver_gone(self.private_dir, self.driver_pid)
                raise SystemExit(f"workbench worker rank {self.rank}: the notebook is gone")
            try:
                if self.main is None:
                    self.main = _Link(self.address, self.key, f"r{self.rank}:{self.incarnation}:main")
                if self._handshake(deadline):
                    return
            except (EOFError, OSError) as e:
                problem = f"the notebook hung up during the handshake ({e})"
                if self.main is not None:
                    self.main.sock.close()
                self.main = None
                time.sleep(0.05)
        raise SystemExit(f"workbench worker rank {self.rank}: {problem}")

    def _handshake(self, deadline: float) -> bool:
        nonce = secrets.token_hex(16)
        knock = handshake.knock(self.rank, self.incarnation, nonce)
        while time.monotonic() < deadline:
            wire.send_all(self.main.sock, knock)
            blob = self.main.reader.next(0.5)  # re-knock now and then: a driver between sessions drops knocks
            if blob is None:
                continue
            try:
                _, welcome = self.main.verifier.open(blob, adopt_session=True)
            except protocol.Rejected as e:
                print(f"workbench worker: ignored a bad welcome ({e})", file=sys.__stderr__)
                continue
            if welcome.get("type") != "welcome" or welcome.get("nonce") != nonce:
                continue  # a stale or replayed welcome: keep knocking
            self.main.signer.session = self.main.verifier.session
            self.main.send({"type": "hello", "challenge": welcome["challenge"], "rank": self.rank,
                            "world_size": self.world_size, "pid": os.getpid(), "host": socket.gethostname()})
            while time.monotonic() < deadline:
                msg = self.main.recv(timeout_ms=int(max(0.0, deadline - time.monotonic()) * 1000))
                if msg is not None and msg.get("type") == "settings":
                    self.settings = msg["settings"]
                    self.io = _Link(self.address, self.key, f"r{self.rank}:{self.incarnation}:io",
                                    self.main.verifier.session)
                    return True
        return False

    # -- output and messages -------------------------------------------------------------------
    def send_output(self, stream: str, line: str) -> None:
        self.send_message({"type": "output", "stream": stream, "line": line})

    def send_message(self, msg: dict) -> None:
        """From the main thread straight out (keeps order with results); from others via the I/O thread."""
        if threading.get_ident() == self.main_thread:
            self.main.send(msg)
        else:
            self.other_output.put(msg)

    # -- I/O thread ----------------------------------------------------------------------------
    def io_loop(self) -> None:
        try:
            self._serve_io()
        except (EOFError, OSError):
            pass  # the notebook closed our connection, or it broke: the notebook is gone
        private_dir.remove_if_driver_gone(self.private_dir, self.driver_pid)
        os._exit(3)

    def _serve_io(self) -> None:
        interval = self.settings["heartbeat_s"]
        orphan_after = self.settings["orphan_timeout_s"]
        # Our first message is a heartbeat, and nothing else goes out until the driver has answered on this
        # connection: until it has bound the connection to us, it takes only small frames from it.
        self.io.send({"type": "heartbeat", "cpu_s": time.process_time()})
        next_beat, heard = time.monotonic() + interval, False
        while True:
            msg = self.io.recv(timeout_ms=int(interval * 250))
            now = time.monotonic()
            if msg is not None:
                self.last_driver_contact, heard = now, True
                self.handle_control(msg)
            while heard and not self.other_output.empty():
                self.io.send(self.other_output.get())
            if now >= next_beat:
                self.io.send({"type": "heartbeat", "cpu_s": time.process_time()})
                next_beat = now + interval
            # The driver is gone: our parent changed (local ranks) or it stopped answering.
            if (self.local and os.getppid() != self.parent_pid) or now - self.last_driver_contact > orphan_after:
                return

    def handle_control(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "flag":
            rank_api.set_flag(msg["name"], msg["value"])
        elif kind == "stack":
            frame = sys._current_frames().get(self.main_thread)
            stack = "".join(traceback.format_stack(frame)) if frame else "(main thread not found)"
            self.io.send({"type": "stack", "stack": stack, "diagnostics": rank_api.diagnostics()})
        elif kind == "shutdown":
            sys.__stderr__.flush()
            os._exit(0)

    # -- main thread ---------------------------------------------------------------------------
    def command_loop(self) -> None:
        while True:
            try:
                msg = self.main.recv(timeout_ms=None)
            except EOFError:
                # The notebook is gone. This thread's exit ends the process: remove a dead driver's folder first
                # (the I/O thread may be doing so too; the process's exit must not cut that short).
                private_dir.remove_if_driver_gone(self.private_dir, self.driver_pid)
                return
            if msg["type"] == "shutdown":
                return
            if msg["type"] != "call":
                continue
            reply: dict[str, Any] = {"type": "result", "id": msg["id"]}
            try:
                fn, args, kwargs = pickle.loads(msg["call"])
                value = fn(*args, **kwargs)
                # Its own pickle, so a value the notebook cannot unpickle fails this command, not the channel.
                reply.update(ok=True, value=protocol.dumps(value))
            except BaseException as e:  # noqa: BLE001 - every failure must reach the notebook
                reply.update(ok=False, exc_type=type(e).__name__, message=str(e), traceback=traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            self.main.send(reply)

    def stand_by(self, prepare: dict[str, Any], nice: bool) -> world.Prepared | BaseException:
        """A local rank before its session: prepare (or fail trying), say so, wait for the pool's word on stdin.

        A failure is kept, not raised: the rank still joins its session, to report it with its traceback.
        """
        go = threading.Event()
        threading.Thread(target=self._watch_stdin, args=(go,), name="workbench-stdin", daemon=True).start()
        lowered = world.lower_priority() if nice else None
        try:
            prepared: world.Prepared | BaseException = world.prepare(prepare, self.local_rank, self.local_world_size)
        except Exception as e:  # noqa: BLE001 - reported once the rank has joined
            self.prepare_traceback = traceback.format_exc()
            prepared = e
        else:
            self.timeline.update(prepared.marks)
        self.timeline["prepared"] = time.monotonic()
        sys.__stdout__.write(PREPARED + "\n")
        sys.__stdout__.flush()
        go.wait()
        self.timeline["go"] = time.monotonic()
        if lowered is not None:
            world.restore_priority(lowered)
        return prepared

    def _watch_stdin(self, go: threading.Event) -> None:
        """The pool's word to connect comes on stdin, and stdin's end means the pool no longer needs this process
        (or its driver died): then it exits at once, even in the middle of preparing."""
        while sys.stdin.buffer.readline():
            go.set()
        private_dir.remove_if_driver_gone(self.private_dir, self.driver_pid)
        os._exit(0)

    def serve(self, prepare: dict[str, Any] | None = None, nice: bool = False) -> None:
        prepared = self.stand_by(prepare, nice) if prepare is not None else None
        self.handshake()
        self.timeline["connected"] = self.last_driver_contact = time.monotonic()
        # Environment first: torch reads these when it is imported and when the world starts (local ranks had
        # them from their start).
        os.environ.update(self.settings["env"])
        threading.Thread(target=self.io_loop, name="workbench-io", daemon=True).start()
        rank_api.host(self.send_message)
        sys.stdout, sys.stderr = _RankStream(self, "stdout"), _RankStream(self, "stderr")
        try:
            if prepared is None:
                prepared = world.prepare(self.settings, self.local_rank, self.local_world_size)
                self.timeline.update(prepared.marks, prepared=time.monotonic())
            if isinstance(prepared, BaseException):
                self.main.send({"type": "failed", "message": f"{type(prepared).__name__}: {prepared}",
                                "traceback": self.prepare_traceback})
                raise SystemExit(1)
            world.join(prepared, self.settings, self.rank, self.world_size, self.local_rank)
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001
            self.main.send({"type": "failed", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            raise
        self.timeline["joined"] = time.monotonic()
        self.main.send({"type": "ready", "device": rank_api.info.device, "backend": rank_api.info.backend,
                        "timeline": self.timeline})
        self.command_loop()


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    # A crash in native code (torch, gloo, NCCL, the recording extension) prints every thread's Python stack to
    # file descriptor 2, which the pool keeps and reports with the rank's death: what it was doing when it died.
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    p = argparse.ArgumentParser(prog="python -m workbench.pool.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", required=True, help="HOST:PORT of the notebook's pool (or unix://PATH locally)")
    p.add_argument("--key-file", required=True, help="file holding the pool's key (mode 0600)")
    p.add_argument("--rank", type=int, default=None, help="default: $RANK (torchrun/srun)")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE")
    p.add_argument("--local", action="store_true", help="started by a local Pool: exit when the parent exits")
    p.add_argument("--standby", action="store_true",
                   help="prepare first (settings in $WORKBENCH_PREPARE), then wait for a line on stdin to connect")
    p.add_argument("--nice", action="store_true", help="prepare at a lower CPU priority (a standby filled ahead)")
    a = p.parse_args(argv)
    env = os.environ
    rank = a.rank if a.rank is not None else int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    world_size = a.world_size if a.world_size is not None else int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", rank if a.local else 0)))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world_size if a.local else 1))
    name_process(f"wb-rank-{rank}")
    prepare = json.loads(env["WORKBENCH_PREPARE"]) if a.standby else None
    worker = Worker(a.connect, read_key_file(a.key_file), rank, world_size, local_rank, local_world, a.local,
                    private=(prepare or {}).get("private_dir"))
    worker.timeline["main"] = started
    try:
        worker.serve(prepare, a.nice)
    except SystemExit as e:
        # A rank that gives up (its driver gone, a handshake that never completed) says why and exits with a code
        # of its own: the interpreter's teardown would instead die of SIGABRT on the stdin watcher's lock, and the
        # pool would report a crash rather than the reason.
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if e.code is None else e.code if isinstance(e.code, int) else 1)  # as the interpreter would
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo/NCCL threads can hang it


if __name__ == "__main__":
    main()
