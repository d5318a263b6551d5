"""Frames on a stream socket: the bytes between the notebook and its ranks.

A frame is an 8-byte big-endian length and that many bytes (one signed
message from `protocol`, or a knock). Local ranks use a unix socket in the
pool's private directory; ranks on other machines use TCP. Plain sockets and
not a messaging library: a round trip then costs two kernel hops, not the
four of a library that moves every message through its own I/O thread, and
on a 2-core machine those thread hops were most of the pool's latency.

Who may send how much is decided here too: a connection that has not yet
proved it holds the key may only send small frames, and is read a little at
a time, so a stranger cannot make the notebook buffer more than a few KiB.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import time

PREFIX = struct.Struct("!Q")
MAX_UNAUTHENTICATED = 4 * 1024
"""The largest frame a connection may send before one of its messages has passed the MAC check (a knock is
under 100 bytes, a rank's first signed message under 1 KiB)."""


class FrameTooLarge(Exception):
    pass


def frame(blob: bytes) -> bytes:
    return PREFIX.pack(len(blob)) + blob


def is_unix(address: str) -> bool:
    return address.startswith("unix://")


def _host_port(address: str) -> tuple[str, int]:
    """`HOST:PORT`, `tcp://HOST:PORT` or `[V6HOST]:PORT` -> (host without brackets, port)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


def listen(endpoint: str) -> tuple[socket.socket, str]:
    """Bind `unix://PATH` or `tcp://HOST:PORT` (port 0: any free one); returns the socket and its address."""
    if is_unix(endpoint):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(endpoint.removeprefix("unix://"))
        address = endpoint
    else:
        host, port = _host_port(endpoint)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    sock.listen(128)
    sock.setblocking(False)
    return sock, address


def tune(sock: socket.socket) -> None:
    """Small control messages must not wait for Nagle's algorithm."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(address: str, timeout_s: float) -> socket.socket:
    """Connect to `unix://PATH` or `HOST:PORT`, retrying until the notebook listens or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if is_unix(address):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(address.removeprefix("unix://"))
            else:
                sock = socket.create_connection(_host_port(address), timeout=5)
                sock.settimeout(None)
            tune(sock)
            return sock
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


class FrameReader:
    """Whole frames out of a stream socket, however the bytes arrive."""

    def __init__(self, sock: socket.socket, max_frame: int | None = MAX_UNAUTHENTICATED) -> None:
        self.sock, self.max_frame = sock, max_frame
        self.buffer = bytearray()
        self.closed = False  # the peer has closed; the frames it sent before are still delivered

    def _next_buffered(self) -> bytes | None:
        if len(self.buffer) < PREFIX.size:
            return None
        (length,) = PREFIX.unpack_from(self.buffer)
        if self.max_frame is not None and length > self.max_frame:
            raise FrameTooLarge(f"a {length}-byte frame (at most {self.max_frame} allowed here)")
        end = PREFIX.size + length
        if len(self.buffer) < end:
            return None
        blob = bytes(self.buffer[PREFIX.size:end])
        del self.buffer[:end]
        return blob

    def _fill(self, flags: int) -> bool:
        """One recv into the buffer; True if it may have left more to read (it filled what it asked for)."""
        want = 1 << 16
        if self.max_frame is not None:  # a stranger: never hold more than one frame of it
            want = max(1, PREFIX.size + self.max_frame - len(self.buffer))
        elif len(self.buffer) >= PREFIX.size:
            want = max(want, PREFIX.size + PREFIX.unpack_from(self.buffer)[0] - len(self.buffer))
        try:
            chunk = self.sock.recv(want, flags)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return False
            chunk = b""  # reset by the peer: as good as closed
        if not chunk:
            self.closed = True
            return False
        self.buffer += chunk
        return len(chunk) == want

    def available(self) -> list[bytes]:
        """The frames that can be read without waiting (the socket was reported readable); see `closed` after.

        Stops at the first short read rather than asking again for an EAGAIN:
        the poller reports the socket again if more has come. A stranger gets
        one read per round, however much it sends.
        """
        frames = []
        more = self._fill(socket.MSG_DONTWAIT)
        while True:
            blob = self._next_buffered()
            if blob is not None:
                frames.append(blob)
            elif more and self.max_frame is None:
                more = self._fill(socket.MSG_DONTWAIT)
            else:
                return frames

    def next(self, timeout_s: float | None) -> bytes | None:
        """The next frame, waiting at most `timeout_s` (None: for ever); None on timeout; EOFError once closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            blob = self._next_buffered()
            if blob is not None:
                return blob
            if self.closed:
                raise EOFError("the notebook closed the connection")
            if deadline is None:
                self._fill(0)  # block in recv itself: one system call
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            self._fill(socket.MSG_DONTWAIT)


def send_all(sock: socket.socket, blob: bytes) -> None:
    """A whole frame on a blocking socket (the ranks' side)."""
    if len(blob) < 1 << 16:
        sock.sendall(frame(blob))
    else:  # no copy of a large payload just to put 8 bytes before it
        sock.sendall(PREFIX.pack(len(blob)))
        sock.sendall(blob)
