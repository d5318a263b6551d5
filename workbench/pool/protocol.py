"""Signed control messages between the notebook (the driver) and the ranks.

Every message is three frames: a JSON header, a cloudpickle payload and an
HMAC-SHA256 over both. The MAC is checked *before* the payload is unpickled,
so a peer without the key can never make us deserialize anything. Replays are
refused because each header carries the session id the driver handed out in
its challenge and a sequence number that must strictly increase per sender.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pickle
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

KEY_BYTES = 32
VERSION = 1
KNOCK = b"workbench-knock"
"""The one unsigned frame: a rank asking for a challenge. It is never unpickled."""


class Rejected(Exception):
    """A message that failed authentication or replay checks; it was not deserialized."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def dumps(obj: Any) -> bytes:
    """cloudpickle, so functions and lambdas defined in a notebook cell travel by value."""
    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _mac(key: bytes, header: bytes, payload: bytes) -> bytes:
    # Length-prefix the header so bytes cannot be shifted between the two frames.
    return hmac.new(key, struct.pack("!I", len(header)) + header + payload, hashlib.sha256).digest()


@dataclass
class Signer:
    """Signs what one sender sends in one session."""

    key: bytes
    sender: str
    session: str = ""
    seq: int = 0

    def seal(self, obj: Any) -> list[bytes]:
        return self.seal_payload(dumps(obj))

    def seal_payload(self, payload: bytes) -> list[bytes]:
        """Sign an already pickled payload (one pickle, many recipients)."""
        self.seq += 1
        header = json.dumps({"v": VERSION, "from": self.sender, "session": self.session, "seq": self.seq},
                            separators=(",", ":")).encode()
        return [header, payload, _mac(self.key, header, payload)]


@dataclass
class Verifier:
    """Checks what arrives: MAC first, then session and sequence, and only then unpickles."""

    key: bytes
    session: str = ""
    last_seq: dict[str, int] = field(default_factory=dict)

    def open(self, frames: list[bytes], *, adopt_session: bool = False) -> tuple[str, Any]:
        """Verify and unpickle; `adopt_session` takes the sender's session (a rank reading its challenge)."""
        if len(frames) != 3:
            raise Rejected(f"expected 3 frames, got {len(frames)}")
        header, payload, mac = frames
        if not hmac.compare_digest(mac, _mac(self.key, header, payload)):
            raise Rejected("bad signature")
        try:
            meta = json.loads(header)
            sender, session, seq = str(meta["from"]), str(meta["session"]), int(meta["seq"])
        except (ValueError, KeyError, TypeError) as e:
            raise Rejected(f"malformed header: {e}") from None
        if meta.get("v") != VERSION:
            raise Rejected(f"protocol version {meta.get('v')} != {VERSION}")
        if adopt_session:
            self.session, self.last_seq = session, {}
        elif session != self.session:
            raise Rejected(f"session {session!r} is not the current one")
        if seq <= self.last_seq.get(sender, 0):
            raise Rejected(f"replayed or reordered message from {sender} (seq {seq})")
        self.last_seq[sender] = seq
        return sender, pickle.loads(payload)
