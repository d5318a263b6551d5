"""The notebook's side of the rank pool: start ranks, run functions on all of them, notice trouble.

`Pool` is the facade a notebook holds. The work happens in `_Transport`, which
owns the one listening socket and an I/O thread; the facade owns neither, so
when a notebook drops its last reference the pool is collected and its ranks
are ended (no orphans), even without close().
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import zmq

from workbench.pool import launch, protocol
from workbench.pool.errors import CollectiveTimeout, PoolBroken, PoolError, RemoteError, WorkerDied

log = logging.getLogger("workbench.pool")

Device = Literal["auto", "cpu", "cuda"]

HEARTBEAT_S = 0.25
"""How often ranks and driver tell each other they are alive."""
WAITING_CPU = 0.1
"""A rank using less than this fraction of a core is waiting, not working."""
ERROR_GRACE_S = 1.0
"""After one rank fails, how long the others get to finish before we look at whether they wait on it."""


@dataclass
class _Command:
    id: int
    ranks: set[int]
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, dict] = field(default_factory=dict)
    first_error_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Any = None
    failure: BaseException | None = None


@dataclass
class _Rank:
    """What the driver knows about one rank of the current session."""

    rank: int
    incarnation: str
    main_id: bytes
    pid: int
    host: str
    io_id: bytes | None = None
    proc: subprocess.Popen | None = None
    ready: bool = False
    device: str = ""
    backend: str = ""
    last_activity: float = field(default_factory=time.monotonic)
    last_heartbeat: float = field(default_factory=time.monotonic)
    cpu: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    outstanding: collections.deque = field(default_factory=collections.deque)
    stack: str | None = None

    def cpu_rate(self, window_s: float = 1.0) -> float | None:
        """Cores used over about the last second, from heartbeat CPU stamps; None if too few stamps."""
        if len(self.cpu) < 2:
            return None
        t1, c1 = self.cpu[-1]
        older = [(t, c) for t, c in self.cpu if t1 - t >= window_s * 0.8]
        if not older:
            return None
        t0, c0 = older[-1]
        return (c1 - c0) / max(t1 - t0, 1e-6)


class Handle:
    """A command running on every rank; `result()` gives the per-rank values in rank order."""

    def __init__(self, command: _Command, world_size: int) -> None:
        self._command, self._world_size = command, world_size

    def done(self) -> bool:
        return self._command.done.is_set()

    def result(self, timeout: float | None = None) -> list:
        if not self._command.done.wait(timeout):
            raise TimeoutError(f"the command is still running after {timeout} s (it keeps running on the ranks)")
        if self._command.failure is not None:
            raise self._command.failure
        return [self._command.results[r] for r in range(self._world_size)]


class _Transport:
    """One listening socket, one I/O thread, and everything the thread shares with callers."""

    def __init__(self, key: bytes, bind: str, port: int, timeout_s: float, heartbeat_timeout_s: float,
                 on_output: Callable[[int, str, str], None], subscribers: list) -> None:
        self.key, self.timeout_s, self.heartbeat_timeout_s = key, timeout_s, heartbeat_timeout_s
        self.on_output, self.subscribers = on_output, subscribers
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if port:
            self.router.bind(f"tcp://{bind}:{port}")
        else:
            port = self.router.bind_to_random_port(f"tcp://{bind}")
        self.address = f"{bind}:{port}"
        wake_addr = f"inproc://wake-{secrets.token_hex(4)}"
        self.wake_rx = self.ctx.socket(zmq.PAIR)
        self.wake_rx.bind(wake_addr)
        self.wake_tx = self.ctx.socket(zmq.PAIR)
        self.wake_tx.connect(wake_addr)
        self.lock = threading.RLock()  # guards everything below that callers touch
        self.outbox: collections.deque = collections.deque()
        self.rejected = 0
        self.running = True
        self.new_session(world_size=0, settings={}, local_pids=None)
        self.thread = threading.Thread(target=self._loop, name="workbench-pool-io", daemon=True)
        self.thread.start()

    # -- session state (reset by restart) -----------------------------------------------------------
    def new_session(self, world_size: int, settings: dict, local_pids: dict[int, subprocess.Popen] | None) -> None:
        with self.lock:
            self.session = secrets.token_hex(8)
            self.signer = protocol.Signer(self.key, "driver", self.session)
            self.verifier = protocol.Verifier(self.key, self.session)
            self.world_size, self.settings, self.local = world_size, settings, local_pids
            self.ranks: dict[int, _Rank] = {}
            self.challenges: dict[bytes, tuple[int, str, str]] = {}
            self.commands: dict[int, _Command] = {}
            self.broken: BaseException | None = None
            self.startup_failure: BaseException | None = None
            self.all_ready = threading.Event()
            self.hang_diagnosis_at: float | None = None
            self.next_ping = 0.0

    # -- called from user threads -------------------------------------------------------------------
    def send(self, identities: list[bytes], obj: Any) -> None:
        payload = protocol.dumps(obj)  # once, in the caller's thread; the I/O thread only signs
        with self.lock:
            self.outbox.append((identities, payload))
            self.wake_tx.send(b"")

    def submit(self, command: _Command, message: dict) -> None:
        with self.lock:
            if self.broken is not None:
                raise PoolBroken(f"the pool is broken: {self.broken}. Call restart().") from self.broken
            now = time.monotonic()
            self.commands[command.id] = command
            for r in command.ranks:
                link = self.ranks[r]
                if not link.outstanding:
                    link.last_activity = now
                link.outstanding.append(command.id)
            self.send([self.ranks[r].main_id for r in sorted(command.ranks)], message)

    def control(self, obj: dict) -> None:
        """A message for the ranks' I/O threads: acted on even while a command runs."""
        with self.lock:
            ids = [link.io_id for link in self.ranks.values() if link.io_id is not None]
        if ids:
            self.send(ids, obj)

    # -- the I/O thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.wake_rx, zmq.POLLIN)
        while self.running:
            try:
                events = dict(poller.poll(50))
                if self.wake_rx in events:
                    while self.wake_rx.poll(0):
                        self.wake_rx.recv()
                    self._flush_outbox()
                if self.router in events:
                    while self.router.poll(0):
                        self._receive(self.router.recv_multipart())
                self._check_health()
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - the I/O thread must survive anything a message does
                log.exception("workbench pool I/O thread error")

    def _flush_outbox(self) -> None:
        while self.outbox:
            identities, payload = self.outbox.popleft()
            for ident in identities:
                self.router.send_multipart([ident, *self.signer.seal_payload(payload)])

    def _send_now(self, ident: bytes, obj: Any) -> None:
        self.router.send_multipart([ident, *self.signer.seal(obj)])

    def _receive(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        if body and body[0] == protocol.KNOCK:
            return self._answer_knock(ident, body)
        try:
            sender, msg = self.verifier.open(body)
            if sender.encode() != ident:
                raise protocol.Rejected(f"signed by {sender} but sent from {ident!r}")
        except protocol.Rejected as e:
            self.rejected += 1
            log.warning("workbench pool dropped a message from %r: %s", ident[:40], e)
            return
        rank_part, incarnation, role = sender.split(":")
        rank = int(rank_part[1:])
        with self.lock:
            if msg.get("type") == "hello":
                return self._register(ident, rank, incarnation, msg)
            link = self.ranks.get(rank)
            if link is None or link.incarnation != incarnation:
                return  # a rank from an earlier life of this session: ignore it
            if role == "io":
                link.io_id = ident
            self._dispatch(link, msg)

    def _answer_knock(self, ident: bytes, body: list[bytes]) -> None:
        try:
            rank, incarnation, nonce = int(body[1]), body[2].decode(), body[3].decode()
        except (IndexError, ValueError, UnicodeDecodeError):
            self.rejected += 1
            return
        with self.lock:
            if not 0 <= rank < self.world_size or ident != f"r{rank}:{incarnation}:main".encode():
                self.rejected += 1
                return
            challenge = self.challenges.get(ident, (0, "", secrets.token_hex(16)))[2]
            self.challenges[ident] = (rank, incarnation, challenge)
            self._send_now(ident, {"type": "welcome", "nonce": nonce, "challenge": challenge,
                                   "settings": self.settings})

    def _register(self, ident: bytes, rank: int, incarnation: str, msg: dict) -> None:
        expected = self.challenges.pop(ident, None)
        if expected is None or expected[2] != msg.get("challenge"):
            self.rejected += 1
            log.warning("workbench pool: hello from %r without our challenge; dropped", ident)
            return
        proc = (self.local or {}).get(rank)
        if proc is not None and proc.pid != msg["pid"]:
            self.rejected += 1
            log.warning("workbench pool: rank %d says pid %s but we started pid %s; dropped", rank, msg["pid"], proc.pid)
            return
        self.ranks[rank] = _Rank(rank, incarnation, ident, msg["pid"], msg["host"], proc=proc)

    def _dispatch(self, link: _Rank, msg: dict) -> None:
        kind, now = msg.get("type"), time.monotonic()
        if kind == "heartbeat":
            link.last_heartbeat = now
            link.cpu.append((now, msg["cpu_s"]))
            return
        link.last_activity = now
        if kind == "output":
            self.on_output(link.rank, msg["stream"], msg["line"])
        elif kind == "event":
            for callback in list(self.subscribers):
                try:
                    callback(link.rank, msg["event"])
                except Exception:  # noqa: BLE001 - a bad subscriber must not stop the pool
                    log.exception("workbench pool: event subscriber failed")
        elif kind == "result":
            self._result(link, msg)
        elif kind == "stack":
            link.stack = msg["stack"]
        elif kind == "ready":
            link.ready, link.device, link.backend = True, msg["device"], msg["backend"]
            if len(self.ranks) == self.world_size and all(r.ready for r in self.ranks.values()):
                self.all_ready.set()
        elif kind == "failed":
            self.startup_failure = RemoteError(link.rank, "StartupError", msg["message"], msg["traceback"])
            self.all_ready.set()

    def _result(self, link: _Rank, msg: dict) -> None:
        command = self.commands.get(msg["id"])
        if link.outstanding and link.outstanding[0] == msg["id"]:
            link.outstanding.popleft()
        if command is None or command.done.is_set():
            return
        command.ranks.discard(link.rank)
        if msg["ok"]:
            command.results[link.rank] = msg["value"]
        else:
            command.errors[link.rank] = msg
            command.first_error_at = command.first_error_at or time.monotonic()
        if not command.ranks:
            if command.errors:
                self._finish(command, self._remote_error(command))
            else:
                self._finish(command, None)

    def _remote_error(self, command: _Command, note: str = "") -> RemoteError:
        first = min(command.errors)
        e = command.errors[first]
        others = sorted(set(command.errors) - {first})
        if others:
            note = f"(ranks {others} raised too.) {note}"
        return RemoteError(first, e["exc_type"], e["message"], e["traceback"], note)

    def _finish(self, command: _Command, failure: BaseException | None) -> None:
        command.failure = failure
        self.commands.pop(command.id, None)
        command.done.set()

    # -- health: deaths, hangs, ranks left waiting on a failed one ---------------------------------
    def _check_health(self) -> None:
        now = time.monotonic()
        with self.lock:
            if self.broken is not None:
                return
            for r, proc in (self.local or {}).items():
                code = proc.poll()
                if code is not None:
                    return self.break_pool(WorkerDied(r, code))
            for link in list(self.ranks.values()):
                if link.proc is None and now - link.last_heartbeat > self.heartbeat_timeout_s:
                    return self.break_pool(WorkerDied(link.rank, None, f"no heartbeat for "
                                                                       f"{now - link.last_heartbeat:.1f} s"))
            if now >= self.next_ping:
                self.next_ping = now + HEARTBEAT_S
                for link in self.ranks.values():
                    if link.io_id is not None:
                        self._send_now(link.io_id, {"type": "ping"})
            for command in list(self.commands.values()):
                if command.first_error_at is not None and now - command.first_error_at > ERROR_GRACE_S:
                    self._check_left_waiting(command)
            self._check_hangs(now)

    def _check_left_waiting(self, command: _Command) -> None:
        """One rank failed; if every rank still running only waits, it waits for the failed one."""
        rates = {r: self.ranks[r].cpu_rate() for r in command.ranks}
        if all(rate is not None and rate < WAITING_CPU for rate in rates.values()):
            note = (f"Ranks {sorted(rates)} were left waiting for rank {min(command.errors)} (idle, most likely in a "
                    "collective it never joined), so the pool was stopped: call restart().")
            self.break_pool(self._remote_error(command, note))

    def _check_hangs(self, now: float) -> None:
        stuck = [link for link in self.ranks.values()
                 if link.outstanding and now - link.last_activity > self.timeout_s]
        if not stuck:
            self.hang_diagnosis_at = None
            return
        if self.hang_diagnosis_at is None:
            # Ask the stuck ranks where they are, give them a moment to answer, then decide.
            for link in stuck:
                link.stack = None
                if link.io_id is not None:
                    self._send_now(link.io_id, {"type": "stack"})
            self.hang_diagnosis_at = now + 0.5
            return
        if now < self.hang_diagnosis_at and not all(link.stack for link in stuck):
            return
        self.break_pool(self._diagnose(stuck, now))

    def _diagnose(self, stuck: list[_Rank], now: float) -> CollectiveTimeout:
        lines, frozen, working = [], [], []
        for link in stuck:
            silent = now - link.last_heartbeat
            if silent > 4 * HEARTBEAT_S:
                frozen.append(link.rank)
                lines.append(f"rank {link.rank}: not responding for {silent:.1f} s (stopped or frozen process)")
                continue
            rate = link.cpu_rate()
            waiting = rate is not None and rate < WAITING_CPU
            if not waiting:
                working.append(link.rank)
            where = (link.stack or "(no stack received)").rstrip().splitlines()[-4:]
            lines.append(f"rank {link.rank}: {'waiting' if waiting else 'busy'} "
                         f"(cpu {rate if rate is not None else float('nan'):.2f} cores), at:\n    "
                         + "\n    ".join(where))
        culprit = (frozen or working or [stuck[0].rank])[0]
        return CollectiveTimeout(culprit, self.timeout_s, sorted(link.rank for link in stuck), "\n".join(lines))

    def break_pool(self, error: BaseException) -> None:
        """Fail every pending command with `error` and stop all ranks: a half-alive world cannot be trusted."""
        with self.lock:
            if self.broken is not None:
                return
            self.broken = error
            for command in list(self.commands.values()):
                self._finish(command, error)
            self.all_ready.set()
            self._stop_ranks(graceful=False)

    def _stop_ranks(self, graceful: bool) -> None:
        for link in self.ranks.values():
            if link.io_id is not None:
                try:
                    self._send_now(link.io_id, {"type": "shutdown"})
                except zmq.ZMQError:
                    pass
        procs = list((self.local or {}).values())
        deadline = time.monotonic() + (2.0 if graceful else 0.0)
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                proc.kill()  # also ends a SIGSTOPped rank
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("workbench pool: rank pid %d did not exit after SIGKILL", proc.pid)

    def close(self) -> None:
        with self.lock:
            if not self.running:
                return
            if self.broken is None:
                self.broken = PoolBroken("the pool was closed")
                for command in list(self.commands.values()):
                    self._finish(command, self.broken)
            self._stop_ranks(graceful=True)
            self.running = False
        self.thread.join(2)
        self.ctx.destroy(linger=0)


def _default_output(rank: int, stream: str, line: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(f"[rank {rank}] {line}\n")


class Pool:
    """A pool of long-lived ranks that notebook cells drive.

    Local ranks are spawned fresh interpreters (never forked), so the notebook
    never touches CUDA. They form one torch.distributed world (gloo on CPU,
    NCCL on GPUs) that lives as long as the pool. `fn` passed to `run` can be
    any function, lambdas from notebook cells included; state that should
    outlive a call goes in `workbench.pool.rank.state`.

    timeout_s: a rank that runs a command without any sign of progress (a
    result, an event, printed output or `rank.progress()`) for this long is
    declared stuck: `CollectiveTimeout`. check_collectives: ranks compare
    each collective that user code issues on the world group before running
    it, so mismatched ops or shapes fail at once on every rank (a
    `CollectiveMismatch` naming what each rank called) instead of hanging
    or, on gloo, silently succeeding; ~1 ms per collective. False gives that
    protection up (see workbench/pool/collective_check.py for why this is
    not torch's TORCH_DISTRIBUTED_DEBUG=DETAIL, which env= can still set).
    """

    def __init__(self, world_size: int, *, device: Device = "auto", timeout_s: float = 300.0,
                 check_collectives: bool = True, threads_per_rank: int | None = None, bind: str = "127.0.0.1",
                 port: int = 0, external: bool = False, key_file: str | None = None,
                 heartbeat_timeout_s: float = 10.0, start_timeout_s: float = 120.0, preload: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, on_output: Callable[[int, str, str], None] | None = None) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size: must be a positive integer, got {world_size!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: {device!r} is not one of 'auto', 'cpu', 'cuda'")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s}")
        if external and key_file is None:
            key_file = os.path.expanduser("~/.workbench/pool.key")
        self.world_size, self.device_request, self.timeout_s = world_size, device, timeout_s
        self.external, self.start_timeout_s = external, start_timeout_s
        self._private_dir = tempfile.mkdtemp(prefix="workbench-")  # mode 0700: store and key live here
        self.key_file = key_file or os.path.join(self._private_dir, "pool.key")
        self._key = launch.write_key_file(self.key_file)
        self._subscribers: list = []
        self._ids = itertools.count(1)
        self._settings_base = {
            "device": device, "backend": None, "heartbeat_s": HEARTBEAT_S, "orphan_timeout_s": heartbeat_timeout_s,
            "pg_timeout_s": 2 * timeout_s + 30, "threads": threads_per_rank, "preload": list(preload),
            "check_collectives": check_collectives, "env": dict(env or {}),
        }
        self._transport = _Transport(self._key, bind, port, timeout_s, heartbeat_timeout_s,
                                     on_output or _default_output, self._subscribers)
        self._finalizer = weakref.finalize(self, _cleanup, self._transport, self._private_dir)
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the ranks of a fresh session (local pools); external pools wait for ranks to connect."""
        t = self._transport
        settings = dict(self._settings_base, env=dict(self._settings_base["env"]))
        if self.external:
            settings["store"] = "env"
            t.new_session(self.world_size, settings, None)
            return
        settings["store"] = "file:" + os.path.join(self._private_dir, f"store-{secrets.token_hex(4)}")
        threads = settings["threads"] or max(1, (os.cpu_count() or 1) // self.world_size)
        settings["threads"] = threads
        # Loopback only: gloo and NCCL then never listen on other interfaces.
        settings["env"].update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join(filter(None, [launch.package_root(), os.environ.get("PYTHONPATH")])))
        for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(var, None)
        procs: dict[int, subprocess.Popen] = {}
        t.new_session(self.world_size, settings, procs)
        for r in range(self.world_size):
            procs[r] = subprocess.Popen(launch.local_worker_argv(t.address, self.key_file, r, self.world_size),
                                        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
            for stream in ("stdout", "stderr"):
                threading.Thread(target=_pump, args=(getattr(procs[r], stream), r, stream, t.on_output),
                                 daemon=True, name=f"workbench-rank{r}-{stream}").start()
        self.wait_ready(self.start_timeout_s)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every rank has connected and joined the world."""
        t = self._transport
        if not t.all_ready.wait(timeout):
            missing = sorted(set(range(self.world_size)) - {r for r, l in t.ranks.items() if l.ready})
            t.break_pool(PoolError(f"ranks {missing} did not start within {timeout} s"))
        if t.startup_failure is not None:
            t.break_pool(t.startup_failure)
        if t.broken is not None:
            raise t.broken

    def restart(self) -> None:
        """Stop every rank and start a fresh world; rank state is lost (reload a checkpoint)."""
        t = self._transport
        with t.lock:
            if t.broken is None:
                t.broken = PoolBroken("the pool is restarting")
                for command in list(t.commands.values()):
                    t._finish(command, t.broken)
            t._stop_ranks(graceful=True)
        self.start()

    def close(self) -> None:
        """End every rank (within a few seconds, whatever they are doing) and release the port."""
        self._finalizer()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands ----------------------------------------------------------------------------------
    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Run fn(*args, **kwargs) on every rank; the results in rank order."""
        return self.run_async(fn, *args, **kwargs).result()

    def run_async(self, fn: Callable, *args: Any, **kwargs: Any) -> Handle:
        """Start fn on every rank and return at once; commands run on the ranks one after another."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if self.external and not self._transport.all_ready.is_set():
            self.wait_ready(self.start_timeout_s)
        command = _Command(next(self._ids), set(range(self.world_size)))
        # The call travels as its own pickle inside the message, so a rank that cannot unpickle it (a module
        # it cannot import) answers with an error for this command instead of dying.
        call = protocol.dumps((fn, args, kwargs))
        self._transport.submit(command, {"type": "call", "id": command.id, "call": call})
        return Handle(command, self.world_size)

    def set_flag(self, name: str, value: Any) -> None:
        """Set `workbench.pool.rank.flag(name)` on every rank, even while a command is running."""
        self._transport.control({"type": "flag", "name": name, "value": value})

    def subscribe(self, callback: Callable[[int, Any], None]) -> Callable[[], None]:
        """Call callback(rank, event) for each `rank.emit(event)`; returns a function that unsubscribes.

        Callbacks run on the pool's I/O thread: keep them short (store and return).
        """
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    # -- introspection -----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._transport.address

    @property
    def pids(self) -> list[int]:
        ranks = self._transport.ranks
        return [ranks[r].pid for r in sorted(ranks)]

    @property
    def broken(self) -> bool:
        return self._transport.broken is not None

    @property
    def broken_reason(self) -> str | None:
        b = self._transport.broken
        return None if b is None else str(b)

    @property
    def device(self) -> str:
        """"cpu" or "cuda" once ranks are up."""
        ranks = self._transport.ranks
        return ranks[0].device.split(":")[0] if 0 in ranks and ranks[0].ready else self.device_request

    @property
    def backend(self) -> str:
        ranks = self._transport.ranks
        return ranks[0].backend if 0 in ranks else ""

    @property
    def rejected_messages(self) -> int:
        """Control messages dropped because they failed authentication or replay checks."""
        return self._transport.rejected

    def launch_command(self, *, nnodes: int, nproc_per_node: int, host: str | None = None,
                       master_port: int = 29500) -> str:
        """The torchrun command to start this pool's ranks on other machines (external pools)."""
        port = self.address.rsplit(":", 1)[1]
        address = f"{host or self.address.rsplit(':', 1)[0]}:{port}"
        return launch.torchrun_command(address, self.key_file, nnodes=nnodes, nproc_per_node=nproc_per_node,
                                       master_port=master_port)

    def __repr__(self) -> str:
        state = f"broken: {self.broken_reason}" if self.broken else "healthy"
        return f"Pool(world_size={self.world_size}, device={self.device!r}, backend={self.backend!r}, {state})"


def _pump(pipe, rank: int, stream: str, on_output: Callable[[int, str, str], None]) -> None:
    """Forward what a local rank writes to its file descriptors (C++ warnings, crashes) to the notebook."""
    for raw in iter(pipe.readline, b""):
        on_output(rank, stream, raw.decode(errors="replace").rstrip("\n"))
    pipe.close()


def _cleanup(transport: _Transport, private_dir: str) -> None:
    transport.close()
    shutil.rmtree(private_dir, ignore_errors=True)
