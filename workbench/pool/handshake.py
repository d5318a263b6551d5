"""How a rank joins a session: knock, signed challenge, signed hello.

A new rank's first frame is the one unsigned frame there is, a knock naming
its rank, incarnation and a nonce. The driver answers with a signed welcome
echoing the nonce and carrying a fresh challenge, which proves the driver
holds the key; the rank's hello, signed, echoes the challenge, which proves
the rank does. Only then is the rank told how to start.
"""

from __future__ import annotations

import secrets

from workbench.pool import protocol


class Gatekeeper:
    """The driver's side of the handshake for one session: answers knocks and admits hellos."""

    def __init__(self, signer: protocol.Signer, world_size: int) -> None:
        self.signer, self.world_size = signer, world_size
        self.challenges: dict[bytes, tuple[int, str, str]] = {}

    def answer(self, blob: bytes) -> bytes | None:
        """The signed welcome for a knock, or None for a malformed one. It carries nothing but nonce and challenge."""
        try:
            rank_text, incarnation, nonce = blob[len(protocol.KNOCK):].decode("ascii").split()
            rank = int(rank_text)
        except (ValueError, UnicodeDecodeError):
            return None
        if not 0 <= rank < self.world_size:
            return None
        ident = f"r{rank}:{incarnation}:main".encode()
        challenge = self.challenges.get(ident, (0, "", secrets.token_hex(16)))[2]
        self.challenges[ident] = (rank, incarnation, challenge)
        return self.signer.seal({"type": "welcome", "nonce": nonce, "challenge": challenge})

    def admit(self, ident: bytes, msg: dict) -> bool:
        """Whether a hello from `ident` (its MAC already checked) answers the challenge we gave it."""
        expected = self.challenges.pop(ident, None)
        return expected is not None and expected[2] == msg.get("challenge") and ident.endswith(b":main")
