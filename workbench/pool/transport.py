"""The notebook's end of the pool's control plane: its sockets, the ranks' state, and who does the I/O.

Latency of a round trip to the ranks is dominated by thread handoffs, not by
signing or pickling (~30 µs together). So there is no dedicated I/O thread
that every message passes through: the sockets are *owned* by whichever
thread needs them. A caller waiting for its command's results takes them and
polls them itself (no handoff); between commands a background thread takes
them over to deliver events, heartbeats and health checks. Messages sent from
other threads (flags, a Stop button) go to an outbox that the current owner
flushes, woken through a socket pair. Session state is guarded by `lock`,
held only briefly, never while polling.

Each rank opens two connections (see worker.py). The first message on a
connection that passes the MAC check binds it to its signer's name, and from
then on only that signer may speak on it (switchboard.py keeps the
connections; sends there never block). health.py decides when a rank is dead,
hung, or left waiting on a failed one.
"""

from __future__ import annotations

import collections
import logging
import pickle
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from workbench.pool import protocol
from workbench.pool.errors import PoolBroken, RemoteError
from workbench.pool.health import HealthChecks
from workbench.pool.switchboard import Peer, Switchboard

log = logging.getLogger("workbench.pool")



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
    disconnected_at: float | None = None

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

    def __init__(self, command: _Command, world_size: int, transport: "Transport") -> None:
        self._command, self._world_size, self._transport = command, world_size, transport

    def done(self) -> bool:
        return self._command.done.is_set()

    def result(self, timeout: float | None = None) -> list:
        if not self._transport.wait(self._command, timeout):
            raise TimeoutError(f"the command is still running after {timeout} s (it keeps running on the ranks)")
        if self._command.failure is not None:
            raise self._command.failure
        return [self._command.results[r] for r in range(self._world_size)]


class Transport(HealthChecks):
    """The switchboard, the session's state, and the rule for who may touch the sockets; the checks of the
    ranks' health run in whichever thread owns the sockets (`HealthChecks`)."""

    def __init__(self, key: bytes, endpoint: str, timeout_s: float, heartbeat_timeout_s: float,
                 on_output: Callable[[int, str, str], None], subscribers: list) -> None:
        self.key, self.timeout_s, self.heartbeat_timeout_s = key, timeout_s, heartbeat_timeout_s
        self.on_output, self.subscribers = on_output, subscribers
        self.board = Switchboard(endpoint)
        self.address = self.board.address
        self.lock = threading.RLock()  # guards the session state below, briefly; never held while polling
        self.owner = threading.Lock()  # whoever holds it does the socket I/O (see the module docstring)
        self.turns = threading.Condition()
        self.waiters = 0
        self.last_caller_io = 0.0
        self.polling = False
        self.next_health = 0.0
        self.outbox: collections.deque = collections.deque()
        self.rejected_messages = 0
        self.running = True
        self.new_session(world_size=0, settings={}, local_pids=None)
        self.thread = threading.Thread(target=self._background, name="workbench-pool-io", daemon=True)
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
        """Queue a message; the owner of the socket signs and sends it (at once, if it is polling)."""
        payload = protocol.dumps(obj)  # once, in the caller's thread; the owner only signs
        with self.lock:
            self.outbox.append((identities, payload))
        if self.polling:
            self._wake()

    @property
    def rejected(self) -> int:
        """Messages dropped by the MAC or replay checks, and connections closed before they proved themselves."""
        return self.rejected_messages + self.board.refused

    def _wake(self) -> None:
        self.board.wake()

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

    # -- socket ownership ---------------------------------------------------------------------------
    def wait(self, command: _Command, timeout: float | None) -> bool:
        """Wait for `command`, doing the socket I/O in this thread when no one else is: no thread handoff."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.turns:
            self.waiters += 1
        try:
            while not command.done.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if self.polling:
                    self._wake()  # the background thread yields when it sees a waiter
                if self.owner.acquire(timeout=0.01):
                    try:
                        while not command.done.is_set() and self.running:
                            left = None if deadline is None else deadline - time.monotonic()
                            if left is not None and left <= 0:
                                return False
                            self._serve(50 if left is None else max(0, min(50, int(left * 1000))))
                    finally:
                        self.owner.release()
                else:
                    command.done.wait(0.01)
            return True
        finally:
            # No notify: waking the background thread here would make it contend for the GIL with this caller's
            # next command; it looks again within 20 ms anyway.
            with self.turns:
                self.waiters -= 1
                self.last_caller_io = time.monotonic()

    def owning(self):
        """Context manager: hold the socket (for close/restart), taking it from the background thread."""
        transport = self

        class _Owning:
            def __enter__(self):
                with transport.turns:
                    transport.waiters += 1
                if transport.polling:
                    transport._wake()
                transport.owner.acquire()

            def __exit__(self, *exc):
                transport.owner.release()
                with transport.turns:
                    transport.waiters -= 1
                    transport.turns.notify_all()

        return _Owning()

    def _background(self) -> None:
        """Serve the socket while no caller waits: events, heartbeats and health between commands."""
        while self.running:
            with self.turns:
                # A caller that just waited will likely wait again soon (a loop of pool.run): leave it the socket.
                if self.waiters or time.monotonic() - self.last_caller_io < 0.1:
                    self.turns.wait(0.02)
                    continue
            if not self.owner.acquire(timeout=0.02):
                continue
            try:
                if self.running:
                    self._serve(20)
            except Exception:  # noqa: BLE001 - the I/O must survive anything a message does
                if not self.running:
                    return
                log.exception("workbench pool I/O error")
            finally:
                self.owner.release()

    def _serve(self, timeout_ms: int) -> None:
        """One round of socket I/O; the caller holds `owner`."""
        self._flush_outbox()
        self.polling = True
        try:
            frames, hung_up = self.board.poll(timeout_ms / 1000)
        finally:
            self.polling = False
        for peer, blob in frames:
            self._receive(peer, blob)
        if hung_up:
            self._note_hang_ups(hung_up)
        self._flush_outbox()
        now = time.monotonic()
        if now >= self.next_health:
            self.next_health = now + 0.02
            self._check_health()

    def _flush_outbox(self) -> None:
        while self.outbox:
            with self.lock:
                identities, payload = self.outbox.popleft()
            blob = self.signer.seal_payload(payload)  # one MAC for all recipients: each checks its own sequence
            for ident in identities:
                self.board.send(ident, blob)

    def _send_now(self, ident: bytes, obj: Any) -> None:
        self.board.send(ident, self.signer.seal(obj))

    def _note_hang_ups(self, names: list[bytes]) -> None:
        with self.lock:
            for link in self.ranks.values():
                if (link.main_id in names or link.io_id in names) and link.disconnected_at is None:
                    link.disconnected_at = time.monotonic()

    # -- messages -----------------------------------------------------------------------------------
    def _receive(self, peer: Peer, blob: bytes) -> None:
        if blob.startswith(protocol.KNOCK):
            return self._answer_knock(peer, blob)
        try:
            sender, msg = self.verifier.open(blob)
            ident = sender.encode()
            if peer.name is not None and peer.name != ident:
                raise protocol.Rejected(f"signed by {sender} on the connection of {peer.name.decode()}")
            rank_part, incarnation, role = sender.split(":")
            rank = int(rank_part[1:])
        except (protocol.Rejected, ValueError) as e:
            self.rejected_messages += 1
            log.warning("workbench pool dropped a message from %s: %s",
                        peer.name.decode() if peer.name else "a new connection", e)
            return
        if peer.name is None:
            self.board.bind(peer, ident)
        with self.lock:
            if msg.get("type") == "hello":
                return self._register(ident, rank, incarnation, msg)
            link = self.ranks.get(rank)
            if link is None or link.incarnation != incarnation:
                return  # a rank from an earlier life of this session: ignore it
            if role == "io":
                link.io_id = ident
            self._dispatch(link, msg)

    def _answer_knock(self, peer: Peer, blob: bytes) -> None:
        """A new rank asks for a challenge. The answer proves we hold the key; it carries nothing else."""
        try:
            rank_text, incarnation, nonce = blob[len(protocol.KNOCK):].decode("ascii").split()
            rank = int(rank_text)
        except (ValueError, UnicodeDecodeError):
            self.rejected_messages += 1
            return
        ident = f"r{rank}:{incarnation}:main".encode()
        with self.lock:
            if not 0 <= rank < self.world_size or peer.name is not None:
                self.rejected_messages += 1
                return
            challenge = self.challenges.get(ident, (0, "", secrets.token_hex(16)))[2]
            self.challenges[ident] = (rank, incarnation, challenge)
            self.board.reply(peer, self.signer.seal({"type": "welcome", "nonce": nonce, "challenge": challenge}))

    def _register(self, ident: bytes, rank: int, incarnation: str, msg: dict) -> None:
        expected = self.challenges.pop(ident, None)
        if expected is None or expected[2] != msg.get("challenge") or not ident.endswith(b":main"):
            self.rejected_messages += 1
            log.warning("workbench pool: hello from %r without our challenge; dropped", ident)
            return
        proc = (self.local or {}).get(rank)
        if proc is not None and proc.pid != msg["pid"]:
            self.rejected_messages += 1
            log.warning("workbench pool: rank %d says pid %s but we started pid %s; dropped", rank, msg["pid"], proc.pid)
            return
        self.ranks[rank] = _Rank(rank, incarnation, ident, msg["pid"], msg["host"], proc=proc)
        # Only now, to a rank that proved it holds the key: how to start (environment, store, threads).
        self._send_now(ident, {"type": "settings", "settings": self.settings})

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
            try:
                command.results[link.rank] = pickle.loads(msg["value"])
            except Exception as e:  # noqa: BLE001 - e.g. a class the notebook cannot import
                msg = {"ok": False, "exc_type": type(e).__name__, "traceback": "",
                       "message": f"the result reached the notebook but could not be unpickled here: {e}"}
        if not msg["ok"]:
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
                self._send_now(link.io_id, {"type": "shutdown"})
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

    def stop_session(self, reason: str) -> None:
        """End the current ranks (restart or close): pending commands fail with `reason`."""
        with self.owning(), self.lock:
            if self.broken is None:
                self.broken = PoolBroken(reason)
                for command in list(self.commands.values()):
                    self._finish(command, self.broken)
            self._stop_ranks(graceful=True)
            self.board.hang_up_all()

    def close(self) -> None:
        if not self.running:
            return
        self.stop_session("the pool was closed")
        self.running = False
        self.thread.join(2)
        with self.owning():
            self.board.close()
