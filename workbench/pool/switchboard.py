"""The notebook's sockets: a listener, one connection per rank thread, sends that never block.

The switchboard knows nothing of messages, only of frames and of who each
connection has proved to be: the transport tells it (`bind`) once a frame
from a connection passed the MAC check, and from then on addresses that
connection by name. Until then a connection is a stranger, and a stranger
costs bounded memory and time: it may send only small frames, read a few
KiB at a time; what waits to be sent to it is capped (a peer that does not
read is closed, not queued for); it is closed after `STRANGER_TTL_S`; and at
most `MAX_STRANGERS` are connected at once.

Who makes room when that many crowd in decides whether a flood can keep the
ranks out. A rank knocks the moment it connects and answers its welcome in
milliseconds, so:
- a connection that was welcomed (sent a well-formed knock) is left alone by
  newcomers for `HANDSHAKE_S`, long enough to say its signed hello;
- room is made by closing the oldest stranger not in that window, so idle
  connections cannot lock ranks out either; when every stranger is in it,
  the newcomer is the one refused;
- newcomers the listener announces in one round are accepted at the start
  of the next, after the transport has answered what this round read, so
  strangers that already hung up (a welcome to a closed peer fails at once)
  are gone before the newcomers are counted.
Before this, a churn of connect-knock-hang-up still had its last round's
dead connections counted, hit the cap in every round and closed the oldest
stranger, which was the real rank between its welcome and its hello, for as
long as the flood lasted. A rank whose connection was closed or refused
before it proved itself connects again.

Not thread-safe: only the thread that owns the transport's sockets calls
it, except `wake`, which any thread may call.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from workbench.pool import wire
from workbench.pool.ratelimit import RateLimitedLog

log = logging.getLogger("workbench.pool")

MAX_STRANGERS = 64
"""Connections that have not yet proved they hold the key; past this, one of them is closed (see above)."""
HANDSHAKE_S = 5.0
"""From its first welcome, how long a connection is safe from newcomers while it says its hello (a rank needs
milliseconds; a loaded machine, a little more). After that it is a stranger like any other until its TTL."""
STRANGER_TTL_S = 10.0
"""A connection that has not proved it holds the key within this long is closed (a rank proves it in
milliseconds, once the driver answers its knock)."""
STRANGER_BACKLOG = 8 * 1024
"""Bytes that may wait to be sent to a stranger; past this it is closed instead of queued for."""
ACCEPTS_PER_POLL = 32
"""New connections taken per round of I/O, so a flood of them cannot starve the ranks' messages."""


@dataclass(eq=False)
class Peer:
    """One connection: what it has sent so far, what waits to go out, and who it proved to be."""

    sock: socket.socket
    reader: wire.FrameReader
    name: bytes | None = None
    out: collections.deque = field(default_factory=collections.deque)
    queued: int = 0
    """Bytes in `out`."""
    watching_writable: bool = False
    connected_at: float = field(default_factory=time.monotonic)
    welcomed_at: float | None = None
    """When it was first answered a knock: from then on it has `HANDSHAKE_S` to say hello, undisturbed."""
    pending: Any = None
    """What the handshake expects next from this stranger (handshake.Pending); gone with the connection."""


class Switchboard:
    def __init__(self, endpoint: str, warnings: RateLimitedLog | None = None) -> None:
        self.listener, self.address = wire.listen(endpoint)
        self.wake_rx, self.wake_tx = socket.socketpair()
        self.wake_rx.setblocking(False)
        self.wake_tx.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(self.wake_rx, selectors.EVENT_READ, "wake")
        self.peers: set[Peer] = set()
        self.strangers: dict[Peer, None] = {}
        """The peers that have not proved themselves yet, oldest first (a dict keeps the order it was filled in)."""
        self.routes: dict[bytes, Peer] = {}
        self.refused = 0  # connections closed for sending too much before proving themselves, or for crowding
        self.hung_up: list[bytes] = []  # names whose connection closed since the last poll
        self.warnings = warnings or RateLimitedLog(log)
        self.next_sweep = 0.0
        self.accept_due = False  # the listener has newcomers: taken at the start of the next poll

    def wake(self) -> None:
        """Make a `poll` in another thread return now."""
        try:
            self.wake_tx.send(b"\0")
        except OSError:
            pass  # full: plenty of wake-ups are waiting already; closed: nobody to wake

    def poll(self, timeout_s: float) -> tuple[list[tuple[Peer, bytes]], list[bytes]]:
        """Wait up to `timeout_s` for I/O and do it: the frames received (in order), the names that hung up."""
        frames: list[tuple[Peer, bytes]] = []
        if self.accept_due:
            self.accept_due = False
            self._accept()
        for key, mask in self.selector.select(timeout_s):
            if key.data == "wake":
                try:
                    while self.wake_rx.recv(4096):
                        pass
                except BlockingIOError:
                    pass
            elif key.data == "listen":
                self.accept_due = True  # next round: strangers that hung up in this one must not count
            else:
                peer = key.data
                if mask & selectors.EVENT_WRITE:
                    self._push(peer)
                if mask & selectors.EVENT_READ and peer in self.peers:
                    self._read(peer, frames)
        now = time.monotonic()
        if now >= self.next_sweep:
            self.next_sweep = now + 1.0
            for peer in [p for p in self.strangers if now - p.connected_at > STRANGER_TTL_S]:
                self.refused += 1
                self._drop(peer)
        closed, self.hung_up = self.hung_up, []
        return frames, closed

    def bind(self, peer: Peer, name: bytes) -> None:
        """`peer` proved it holds the key and signs as `name`: route to it, and let it send frames of any size."""
        peer.name, peer.reader.max_frame = name, None
        self.strangers.pop(peer, None)
        self.routes[name] = peer

    def welcome(self, peer: Peer, blob: bytes) -> None:
        """Answer a stranger's well-formed knock; from the first answer on, it has `HANDSHAKE_S` to say hello
        before a newcomer may take its place."""
        if peer.welcomed_at is None:
            peer.welcomed_at = time.monotonic()
        self.reply(peer, blob)

    def send(self, name: bytes, blob: bytes) -> None:
        """To the connection bound to `name`; dropped if there is none (a gone rank is noticed elsewhere)."""
        peer = self.routes.get(name)
        if peer is not None:
            self.reply(peer, blob)

    def reply(self, peer: Peer, blob: bytes) -> None:
        """Send what the socket takes now; the rest waits for it to be writable (never block the owner)."""
        if peer not in self.peers:
            return
        if peer.name is None and peer.queued + len(blob) > STRANGER_BACKLOG:
            self.refused += 1
            return self._drop(peer)  # a stranger that does not read: close it rather than queue for it
        peer.out.append(memoryview(wire.frame(blob)))
        peer.queued += len(peer.out[-1])
        if len(peer.out) == 1:  # otherwise it queues behind frames that already wait for the socket
            self._push(peer)

    def hang_up(self, peer: Peer) -> None:
        """Close one connection (a stranger that said something wrong)."""
        self._drop(peer)

    def hang_up_all(self) -> None:
        for peer in list(self.peers):
            self._drop(peer)
        self.hung_up.clear()

    def close(self) -> None:
        self.hang_up_all()
        self.selector.close()
        for sock in (self.listener, self.wake_rx, self.wake_tx):
            sock.close()

    # -- internals ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_POLL):  # the rest wait in the listen backlog for the next round
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: keep serving the ranks we have
                self.warnings.warning("workbench pool: could not accept a connection: %s", e)
                return
            if len(self.strangers) >= MAX_STRANGERS:
                self.refused += 1
                victim = self._evictable(time.monotonic())
                if victim is None:  # every stranger is in its handshake: the newcomer waits its turn
                    sock.close()
                    continue
                self._drop(victim)
            sock.setblocking(False)
            wire.tune(sock)
            peer = Peer(sock, wire.FrameReader(sock))
            self.peers.add(peer)
            self.strangers[peer] = None
            self.selector.register(sock, selectors.EVENT_READ, peer)

    def _evictable(self, now: float) -> Peer | None:
        """The stranger that makes room for a newcomer: the oldest one not within its handshake; None if all are."""
        for peer in self.strangers:  # oldest first
            if peer.welcomed_at is None or now - peer.welcomed_at > HANDSHAKE_S:
                return peer
        return None

    def _push(self, peer: Peer) -> None:
        """Send queued frames until the socket is full; watch for writability only while some still wait."""
        while peer.out:
            try:
                sent = peer.sock.send(peer.out[0])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return self._drop(peer)
            peer.queued -= sent
            if sent == len(peer.out[0]):
                peer.out.popleft()
            else:
                peer.out[0] = peer.out[0][sent:]
        waiting = bool(peer.out)
        if waiting != peer.watching_writable:  # an epoll change only when the state changes, not per send
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
            self.selector.modify(peer.sock, events, peer)
            peer.watching_writable = waiting

    def _read(self, peer: Peer, frames: list) -> None:
        try:
            frames.extend((peer, blob) for blob in peer.reader.available())
        except wire.FrameTooLarge as e:
            self.refused += 1
            self.warnings.warning("workbench pool: closed a connection that had not proved it holds the key: %s", e)
            self._drop(peer)
            return
        if peer.reader.closed:
            self._drop(peer)

    def _drop(self, peer: Peer) -> None:
        if peer not in self.peers:
            return
        self.peers.discard(peer)
        self.strangers.pop(peer, None)
        self.selector.unregister(peer.sock)
        peer.sock.close()
        peer.out.clear()
        peer.queued, peer.pending = 0, None
        if peer.name is not None and self.routes.get(peer.name) is peer:
            del self.routes[peer.name]
            self.hung_up.append(peer.name)
