"""The notebook's end of the control plane: messages to and from the ranks of the current session.

Each rank opens two connections (see worker.py). The first message on a
connection that passes the MAC check binds it to its signer's name, and from
then on only that signer may speak on it. The pieces, one job each:
switchboard.py keeps the connections (sends there never block), handshake.py
admits new ranks, commands.py keeps the commands in flight, owner.py decides
which thread does the I/O, health.py gives the verdict on the ranks, and
lifecycle.py (through the pool) owns the processes. Session state is guarded
by `lock`, held only briefly, never while polling.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from typing import Any, Callable, Protocol

from workbench.pool import health, protocol
from workbench.pool.commands import Command, CommandTable
from workbench.pool.errors import PoolBroken, RemoteError, WorkerDied
from workbench.pool.handshake import Gatekeeper
from workbench.pool.owner import SocketOwner
from workbench.pool.ratelimit import RateLimitedLog
from workbench.pool.roster import RankState
from workbench.pool.switchboard import Peer, Switchboard

log = logging.getLogger("workbench.pool")


class Processes(Protocol):
    """What the transport may ask of a session's local processes (`lifecycle.LocalRanks`)."""

    def pid(self, rank: int) -> int | None: ...

    def exit_codes(self) -> dict[int, int | None]: ...

    def sample(self, rank: int) -> health.ProcessSample | None: ...

    def last_words(self, rank: int) -> list[str]: ...

    def stop(self, grace_s: float) -> None: ...


class Transport:
    """The switchboard, the session's state, and what the messages do to it."""

    def __init__(self, key: bytes, endpoint: str, limits: health.Limits,
                 on_output: Callable[[int, str, str], None], subscribers: list,
                 explain: health.Explain | None = None) -> None:
        self.key, self.limits, self.explain = key, limits, explain
        self.on_output, self.subscribers = on_output, subscribers
        self.warnings = RateLimitedLog(log)  # one budget of lines for everything strangers make us say
        self.board = Switchboard(endpoint, self.warnings)
        self.address = self.board.address
        self.lock = threading.RLock()  # guards the session state below, briefly; never held while polling
        self.next_health = 0.0
        self.outbox: collections.deque = collections.deque()
        self.rejected_messages = 0
        self.new_session(world_size=0, settings={}, processes=None)
        self.owner = SocketOwner(self._serve, self.board.wake)
        self.owner.start()

    # -- session state (reset by restart) -----------------------------------------------------------
    def new_session(self, world_size: int, settings: dict, processes: Processes | None) -> None:
        with self.lock:
            self.session = secrets.token_hex(8)
            self.signer = protocol.Signer(self.key, "driver", self.session)
            self.verifier = protocol.Verifier(self.key, self.session)
            self.gate = Gatekeeper(self.signer, world_size)
            self.world_size, self.settings, self.processes = world_size, settings, processes
            self.ranks: dict[int, RankState] = {}
            self.commands = CommandTable()
            self.broken: BaseException | None = None
            self.startup_failure: BaseException | None = None
            self.all_ready = threading.Event()
            self.asked_at: float | None = None
            self.next_ping = 0.0

    # -- called from user threads -------------------------------------------------------------------
    def send(self, identities: list[bytes], obj: Any) -> None:
        """Queue a message; the owner of the socket signs and sends it (at once, if it is polling)."""
        payload = protocol.dumps(obj)  # once, in the caller's thread; the owner only signs
        with self.lock:
            self.outbox.append((identities, payload))
        self.owner.wake_if_polling()

    @property
    def rejected(self) -> int:
        """Messages dropped by the MAC or replay checks, and connections closed before they proved themselves."""
        return self.rejected_messages + self.board.refused

    def submit(self, command: Command, message: dict) -> None:
        with self.lock:
            if self.broken is not None:
                raise PoolBroken(f"the pool is broken: {self.broken}. Call restart().") from self.broken
            now = time.monotonic()
            self.commands.add(command)
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

    def wait(self, done: threading.Event, timeout: float | None) -> bool:
        return self.owner.wait(done, timeout)

    # -- one round of I/O, by the owner of the sockets ----------------------------------------------
    def _serve(self, timeout_ms: int) -> None:
        self._flush_outbox()
        self.owner.polling = True
        try:
            frames, hung_up = self.board.poll(timeout_ms / 1000)
        finally:
            self.owner.polling = False
        for peer, blob in frames:
            self._receive(peer, blob)
        if hung_up:
            self._note_hang_ups(hung_up)
        self._flush_outbox()
        now = time.monotonic()
        if now >= self.next_health:
            self.next_health = now + 0.02
            self._check_health(now)

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

    # -- health ---------------------------------------------------------------------------------------
    def _check_health(self, now: float) -> None:
        with self.lock:
            if self.broken is not None:
                return
            if now >= self.next_ping:
                self.next_ping = now + health.HEARTBEAT_S
                for link in self.ranks.values():
                    if link.io_id is not None:
                        self._send_now(link.io_id, {"type": "ping"})
            exits, samples = {}, {}
            if self.processes is not None:
                exits = self.processes.exit_codes()
                samples = {r: s for r in health.silent(self.ranks, now, self.limits)
                           if (s := self.processes.sample(r)) is not None}
            verdict = health.judge(self.ranks, exits, samples, self.commands.values(), now, self.limits,
                                   self.asked_at, self.explain)
            if isinstance(verdict, health.Healthy):
                self.asked_at = None
            elif isinstance(verdict, health.AskWhere):
                self.asked_at = now
                for r in verdict.ranks:
                    link = self.ranks[r]
                    link.stack = link.diagnostics = None
                    if link.io_id is not None:
                        self._send_now(link.io_id, {"type": "stack"})
            elif isinstance(verdict, health.Broken):
                error = verdict.error
                if isinstance(error, WorkerDied) and error.exitcode is not None and self.processes is not None:
                    error = error.with_last_words(self.processes.last_words(error.rank))
                self.break_pool(error)

    # -- messages -----------------------------------------------------------------------------------
    def _receive(self, peer: Peer, blob: bytes) -> None:
        if peer not in self.board.peers:
            return  # a stranger closed earlier in this round: the rest of what it sent is not read
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
            self.warnings.warning("workbench pool dropped a message from %s: %s",
                                  peer.name.decode() if peer.name else "a new connection", e)
            if peer.name is None:
                self.board.hang_up(peer)  # a stranger gets one try: a flood costs it a connection per frame
            return
        if peer.name is None:
            self.board.bind(peer, ident)
        with self.lock:
            if msg.get("type") == "hello":
                return self._register(peer, ident, rank, incarnation, msg)
            link = self.ranks.get(rank)
            if link is None or link.incarnation != incarnation:
                return  # a rank from an earlier life of this session: ignore it
            if role == "io":
                link.io_id = ident
            self._dispatch(link, msg)

    def _answer_knock(self, peer: Peer, blob: bytes) -> None:
        if peer.name is not None:
            self.rejected_messages += 1
            return
        with self.lock:
            peer.pending, welcome = self.gate.answer(peer.pending, blob)
        if welcome is None:  # malformed, for a rank this session does not have, or one knock too many
            self.rejected_messages += 1
            self.board.hang_up(peer)
            return
        self.board.welcome(peer, welcome)

    def _register(self, peer: Peer, ident: bytes, rank: int, incarnation: str, msg: dict) -> None:
        pending, peer.pending = peer.pending, None
        if not self.gate.admit(pending, ident, msg):
            self.rejected_messages += 1
            self.warnings.warning("workbench pool: hello from %r without our challenge; dropped", ident)
            return
        pid = self.processes.pid(rank) if self.processes is not None else None
        if pid is not None and pid != msg["pid"]:
            self.rejected_messages += 1
            self.warnings.warning("workbench pool: rank %d says pid %s but we started pid %s; dropped",
                                  rank, msg["pid"], pid)
            return
        self.ranks[rank] = RankState(rank, incarnation, ident, msg["pid"], msg["host"], local=pid is not None)
        # Only now, to a rank that proved it holds the key: how to start (environment, store, threads).
        self._send_now(ident, {"type": "settings", "settings": self.settings})

    def _dispatch(self, link: RankState, msg: dict) -> None:
        kind, now = msg.get("type"), time.monotonic()
        if kind == "heartbeat":
            link.last_heartbeat = now
            link.cpu.append((now, msg["cpu_s"]))
            return
        if kind == "stack":  # an answer to "where are you?" from the I/O thread: no sign of progress
            link.stack, link.diagnostics = msg["stack"], msg.get("diagnostics")
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
            if link.outstanding and link.outstanding[0] == msg["id"]:
                link.outstanding.popleft()
            self.commands.answer(link.rank, msg)
        elif kind == "ready":
            link.ready, link.device, link.backend = True, msg["device"], msg["backend"]
            link.ready_at, link.timeline = now, msg.get("timeline", {})
            if len(self.ranks) == self.world_size and all(r.ready for r in self.ranks.values()):
                self.all_ready.set()
        elif kind == "failed":
            self.startup_failure = RemoteError(link.rank, "StartupError", msg["message"], msg["traceback"])
            self.all_ready.set()

    # -- ending ---------------------------------------------------------------------------------------
    def break_pool(self, error: BaseException) -> None:
        """Fail every pending command with `error` and stop all ranks: a half-alive world cannot be trusted."""
        with self.lock:
            if self.broken is not None:
                return
            self.broken = error
            self.commands.fail_all(error)
            self.all_ready.set()
            self._stop_ranks(grace_s=0.0)

    def _stop_ranks(self, grace_s: float) -> None:
        for link in self.ranks.values():
            if link.io_id is not None:
                self._send_now(link.io_id, {"type": "shutdown"})
        if self.processes is not None:
            self.processes.stop(grace_s)

    def stop_session(self, reason: str) -> None:
        """End the current ranks (restart or close): pending commands fail with `reason`."""
        with self.owner.owning(), self.lock:
            if self.broken is None:
                self.broken = PoolBroken(reason)
                self.commands.fail_all(self.broken)
            self._stop_ranks(grace_s=2.0)
            self.board.hang_up_all()

    def close(self) -> None:
        if not self.owner.running:
            return
        self.stop_session("the pool was closed")
        self.owner.stop()
        with self.owner.owning():
            self.board.close()
