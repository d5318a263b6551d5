"""How a rank joins a session: knock, signed challenge, signed hello.

A new rank's first frame is the one unsigned frame there is, a knock naming
its rank, incarnation and a nonce. The driver answers with a signed welcome
echoing the nonce and carrying a fresh challenge, which proves the driver
holds the key; the rank's hello, signed and on the same connection, echoes
the challenge, which proves the rank does. Only then is the rank told how to
start.

Strangers cost nothing: a knock is a few dozen bytes of a fixed shape (any
other is refused without an answer), its challenge lives on the connection
it came on (so it goes when the connection goes, and the switchboard caps
and times out connections that have not proved themselves), and one
connection gets a bounded number of answers.
"""

from __future__ import annotations

import hmac
import re
import secrets
from dataclasses import dataclass

from workbench.pool import protocol

MAX_KNOCKS = 8
"""Answers one connection gets before it is closed: a rank re-knocks twice a second while the driver is between
sessions, and reconnects when closed."""

_KNOCK = re.compile(rb" (\d{1,6}) ([0-9a-f]{16}) ([0-9a-f]{32})")
"""After the KNOCK prefix: rank, incarnation (8 random bytes in hex), nonce (16 random bytes in hex)."""
KNOCK_BYTES = len(protocol.KNOCK) + 1 + 6 + 1 + 16 + 1 + 32
"""The longest knock there is."""


@dataclass
class Pending:
    """What the handshake expects next from one connection; kept on that connection."""

    ident: bytes
    challenge: str
    knocks: int = 0


def knock(rank: int, incarnation: str, nonce: str) -> bytes:
    """The knock a rank sends (the one unsigned frame)."""
    return protocol.KNOCK + f" {rank} {incarnation} {nonce}".encode()


class Gatekeeper:
    """The driver's side of the handshake for one session: answers knocks and admits hellos."""

    def __init__(self, signer: protocol.Signer, world_size: int) -> None:
        self.signer, self.world_size = signer, world_size

    def answer(self, pending: Pending | None, blob: bytes) -> tuple[Pending | None, bytes | None]:
        """(what this connection is now expected to say, the signed welcome to send it); no welcome: refuse.

        The welcome carries nothing but the nonce and the challenge: a stranger learns nothing from it.
        """
        match = _KNOCK.fullmatch(blob, len(protocol.KNOCK))
        if match is None:
            return pending, None
        rank = int(match[1])
        if not 0 <= rank < self.world_size:
            return pending, None
        ident = b"r%d:%s:main" % (rank, match[2])
        if pending is None or pending.ident != ident:
            pending = Pending(ident, secrets.token_hex(16))
        pending.knocks += 1
        if pending.knocks > MAX_KNOCKS:
            return pending, None
        welcome = {"type": "welcome", "nonce": match[3].decode(), "challenge": pending.challenge}
        return pending, self.signer.seal(welcome)

    @staticmethod
    def admit(pending: Pending | None, ident: bytes, msg: dict) -> bool:
        """Whether a hello from `ident` (its MAC already checked) answers the challenge given on its connection."""
        challenge = msg.get("challenge")
        return (pending is not None and pending.ident == ident and isinstance(challenge, str)
                and hmac.compare_digest(pending.challenge, challenge))
