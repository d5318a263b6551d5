"""A rank: one long-lived process that runs the notebook's commands.

Started by the Pool (`python -m workbench.pool.worker --connect HOST:PORT
--key-file FILE --rank R --world-size N --local`) or, on other machines, by
torchrun/srun (rank and world size then come from the environment). It
connects back to the notebook, proves it holds the key, initialises one
torch.distributed world and keeps it until it exits.

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
import gc
import importlib
import io
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

from workbench.pool import protocol, rank as rank_api, wire
from workbench.pool.launch import read_key_file

CONNECT_TIMEOUT_S = 60.0
"""How long a rank tries to reach (and be welcomed by) the notebook before it gives up."""


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
                 local_world_size: int, local: bool) -> None:
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size, self.local = local_rank, local_world_size, local
        self.incarnation = secrets.token_hex(8)
        self.address, self.key = address, key
        self.main = _Link(address, key, f"r{rank}:{self.incarnation}:main")
        self.io: _Link | None = None  # connected once the handshake has given us the session
        self.main_thread = threading.get_ident()
        self.parent_pid = os.getppid()
        self.other_output: queue.SimpleQueue = queue.SimpleQueue()
        self.last_driver_contact = time.monotonic()
        self.settings: dict[str, Any] = {}

    # -- handshake -----------------------------------------------------------------------------
    def handshake(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Knock until the driver answers with a challenge echoing our nonce, say hello, receive the settings.

        The welcome is signed, so it proves the driver holds the key; our hello
        echoes its challenge, signed, which proves we do. Only then does the
        driver tell us how to start.
        """
        try:
            self._handshake(timeout_s)
        except (EOFError, OSError) as e:
            raise SystemExit(f"workbench worker rank {self.rank}: the notebook hung up during the handshake ({e})")

    def _handshake(self, timeout_s: float) -> None:
        nonce = secrets.token_hex(16)
        knock = protocol.KNOCK + f" {self.rank} {self.incarnation} {nonce}".encode()
        deadline = time.monotonic() + timeout_s
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
                    return
        raise SystemExit(f"workbench worker rank {self.rank}: no answer from the driver at the given address")

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
        os._exit(3)

    def _serve_io(self) -> None:
        interval = self.settings["heartbeat_s"]
        orphan_after = self.settings["orphan_timeout_s"]
        next_beat = 0.0
        while True:
            msg = self.io.recv(timeout_ms=int(interval * 250))
            now = time.monotonic()
            if msg is not None:
                self.last_driver_contact = now
                self.handle_control(msg)
            while not self.other_output.empty():
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
            self.io.send({"type": "stack", "stack": stack})
        elif kind == "shutdown":
            sys.__stderr__.flush()
            os._exit(0)

    # -- main thread ---------------------------------------------------------------------------
    def init_distributed(self) -> None:
        s = self.settings
        import torch
        import torch.distributed as dist
        from datetime import timedelta

        torch.set_num_threads(s["threads"] or max(1, (os.cpu_count() or 1) // self.local_world_size))
        device = s["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= self.local_world_size else "cpu"
        if device == "cuda":
            torch.cuda.set_device(self.local_rank)
            device = f"cuda:{self.local_rank}"
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if s.get("backend_setup"):
            module, _, function = s["backend_setup"].partition(":")
            backend = getattr(importlib.import_module(module), function)()
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=s["pg_timeout_s"])}
        if device.startswith("cuda"):
            kwargs["device_id"] = torch.device(device)
        if s["store"].startswith("file:"):
            store = dist.FileStore(s["store"][5:], self.world_size)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, **kwargs)
        else:  # torchrun / srun: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in the environment
            dist.init_process_group(backend, init_method="env://", rank=self.rank, world_size=self.world_size,
                                    **kwargs)
        if s["check_collectives"]:
            from workbench.pool import collective_check

            collective_check.install()
        rank_api.info = rank_api.RankInfo(self.rank, self.world_size, self.local_rank, device, backend,
                                          socket.gethostname())
        for module in s["preload"]:
            __import__(module)
        # The first optimizer built in a process imports torch._dynamo (~2 s); pay that now, not in apply().
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        # What start-up built (torch and the modules) lives as long as the rank: freezing it leaves the garbage
        # collector only what commands create to scan, ~1 ms instead of ~0.1-0.8 s per full collection.
        gc.freeze()

    def command_loop(self) -> None:
        while True:
            try:
                msg = self.main.recv(timeout_ms=None)
            except EOFError:
                return  # the notebook is gone
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

    def serve(self) -> None:
        self.handshake()
        # Environment first: torch reads these when it is imported and when the world starts.
        os.environ.update(self.settings["env"])
        threading.Thread(target=self.io_loop, name="workbench-io", daemon=True).start()
        rank_api.host(self.send_message)
        sys.stdout, sys.stderr = _RankStream(self, "stdout"), _RankStream(self, "stderr")
        try:
            self.init_distributed()
        except BaseException as e:  # noqa: BLE001
            self.main.send({"type": "failed", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            raise
        self.main.send({"type": "ready", "device": rank_api.info.device, "backend": rank_api.info.backend})
        self.command_loop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m workbench.pool.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", required=True, help="HOST:PORT of the notebook's pool (or unix://PATH locally)")
    p.add_argument("--key-file", required=True, help="file holding the pool's key (mode 0600)")
    p.add_argument("--rank", type=int, default=None, help="default: $RANK (torchrun/srun)")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE")
    p.add_argument("--local", action="store_true", help="started by a local Pool: exit when the parent exits")
    a = p.parse_args(argv)
    env = os.environ
    rank = a.rank if a.rank is not None else int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    world = a.world_size if a.world_size is not None else int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", rank if a.local else 0)))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world if a.local else 1))
    worker = Worker(a.connect, read_key_file(a.key_file), rank, world, local_rank, local_world, a.local)
    worker.serve()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo/NCCL threads can hang it


if __name__ == "__main__":
    main()
