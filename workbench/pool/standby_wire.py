"""Between the user's standby and the kernels it forks ranks for: where it listens, and the signed datagrams.

One standby per way of preparing ranks (its fingerprint: `user_standby.fingerprint`), named after a hash of it,
in the user's runtime folder (mode 0700, `runtime_dir`): NAME.sock (a SOCK_SEQPACKET Unix socket, mode 0600:
never a listener beyond the machine), NAME.key (its HMAC key, 0600), NAME.lock (held by the running standby, so
two never run for one name), NAME.json (its pid and fingerprint, to say why it does not fit another kernel),
NAME.log (its own errors). Each datagram is one message of `protocol` (HMAC-SHA256 checked before anything is
unpickled, sequence numbers against replay), with the three file descriptors of a fork request.

A connection proves itself as a rank does (handshake.py): the kernel knocks (the one unsigned datagram, of one
fixed shape, never unpickled); the standby answers, signed, echoing the knock's nonce with a challenge and a
session of its own (it holds the key); the kernel's signed hello echoes the challenge (so does the kernel). Until
then a connection may send only small datagrams, and one knock, within `HANDSHAKE_S`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.pool import protocol

KNOCK = re.compile(re.escape(protocol.KNOCK) + rb" standby ([0-9a-f]{32})")
UNAUTHENTICATED_BYTES = 4096
"""The largest datagram read from a connection that has not proved itself (a knock is 50 bytes, a hello < 1 KiB);
a longer one closes it."""
REQUEST_BYTES = 1 << 20
"""The largest fork request (arguments, environment): a message a kernel sent, never a stranger's."""
REPLY_BYTES = 1 << 16
HANDSHAKE_ENV = "WORKBENCH_STANDBY_HANDSHAKE_S"
HANDSHAKE_S = float(os.environ.get(HANDSHAKE_ENV, 10.0))
"""How long a new connection has to prove itself before it is closed (a kernel proves itself in milliseconds; the
drills that wait out the silent ones set less)."""
MAX_STRANGERS = 16
"""Connections that have not proved themselves, at most, at once: more are closed as they come."""
FINGERPRINT_ENV = "WORKBENCH_STANDBY_FINGERPRINT"
"""How the kernel that starts a standby tells it what it is prepared for (JSON)."""


@dataclass(frozen=True)
class Paths:
    folder: Path
    name: str

    def _file(self, suffix: str) -> Path:
        return self.folder / f"{self.name}.{suffix}"

    @property
    def socket(self) -> Path:
        return self._file("sock")

    @property
    def key(self) -> Path:
        return self._file("key")

    @property
    def lock(self) -> Path:
        return self._file("lock")

    @property
    def description(self) -> Path:
        return self._file("json")

    @property
    def log(self) -> Path:
        return self._file("log")


def name_for(fingerprint: dict[str, Any]) -> str:
    return "standby-" + hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def knock(nonce: str) -> bytes:
    return protocol.KNOCK + b" standby " + nonce.encode()


class Truncated(protocol.Rejected):
    """A datagram longer than the reader allows (it was cut, so it is refused)."""


class SignedChannel:
    """One side's signer and verifier on a connected SOCK_SEQPACKET socket."""

    def __init__(self, sock: socket.socket, key: bytes, sender: str, session: str,
                 verifier: protocol.Verifier | None = None) -> None:
        self.sock = sock
        self.signer = protocol.Signer(key, sender, session)
        self.verifier = verifier or protocol.Verifier(key, session)

    def send(self, message: dict, fds: list[int] | None = None) -> None:
        socket.send_fds(self.sock, [self.signer.seal(message)], fds or [])

    def recv(self, limit: int, max_fds: int = 0) -> tuple[dict | None, list[int]]:
        """The next message (None: the peer closed) and the descriptors that came with it. Rejected: forged,
        replayed or too long (the caller closes what came with it)."""
        return open_datagram(self.verifier, *receive(self.sock, limit, max_fds))


def receive(sock: socket.socket, limit: int, max_fds: int) -> tuple[bytes, list[int]]:
    """One datagram of at most `limit` bytes and its descriptors; Truncated (descriptors closed) if it was longer."""
    data, fds, flags, _ = socket.recv_fds(sock, limit, max_fds)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_all(fds)
        raise Truncated(f"a datagram over {limit} bytes or {max_fds} descriptors")
    return data, fds


def open_datagram(verifier: protocol.Verifier, data: bytes, fds: list[int]) -> tuple[dict | None, list[int]]:
    if not data:
        close_all(fds)
        return None, []
    try:
        _, message = verifier.open(data)
    except protocol.Rejected:
        close_all(fds)
        raise
    if not isinstance(message, dict):
        close_all(fds)
        raise protocol.Rejected(f"a {type(message).__name__}, not a message")
    return message, fds


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
