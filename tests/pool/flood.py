"""A stranger flooding a pool's control socket: the drills of issue 17, as a process of its own.

    python -m tests.pool.flood ADDRESS knocks --count 4000 --size 60000
    python -m tests.pool.flood ADDRESS forged --count 20000
    python -m tests.pool.flood ADDRESS churn --seconds 5

knocks: knock frames padded to `size` bytes (a huge nonce), never reading an answer; forged: frames shaped like
signed messages but with a MAC of another key; churn: connect, knock, hang up, as fast as it can; spin: a busy
loop that never connects (the baseline for a flood's CPU). It reconnects whenever the pool closes a connection,
prints "flooding" once under way and one JSON line of what it sent. Loopback or a unix socket only.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

from workbench.pool import protocol, wire


def _connect(address: str) -> socket.socket:
    sock = wire.connect(address, timeout_s=5)
    sock.settimeout(0.2)  # a pool that stops reading must not stall the flood: reconnect instead
    return sock


def flood(address: str, kind: str, count: int, size: int, seconds: float) -> dict:
    if not (wire.is_unix(address) or address.startswith(("127.", "localhost", "[::1]"))):
        raise SystemExit("the flood only targets this machine")
    forger = protocol.Signer(protocol.new_key(), "r0:0123456789abcdef:main", "0" * 16)
    deadline = time.monotonic() + seconds
    sent = connections = closed = 0
    sock = None
    print("flooding", flush=True)  # for whoever waits for the flood to be under way
    while sent < count and time.monotonic() < deadline:
        if sock is None:
            sock = _connect(address)
            connections += 1
        if kind == "knocks":
            blob = protocol.KNOCK + b" 0 %016x " % connections + b"n" * max(0, size - 40)
        elif kind == "forged":
            blob = forger.seal({"type": "event", "event": "x" * size})
        else:
            blob = protocol.KNOCK + b" 0 %016x %032x" % (connections, sent)
        try:
            wire.send_all(sock, blob)
            sent += 1
        except OSError:  # closed by the pool, or it stopped reading
            closed += 1
            sock.close()
            sock = None
            continue
        if kind == "churn":
            sock.close()
            sock = None
    if sock is not None:
        sock.close()
    return {"kind": kind, "sent": sent, "connections": connections, "closed_by_pool": closed}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("kind", choices=["knocks", "forged", "churn", "spin"])
    p.add_argument("--count", type=int, default=10**9)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    a = p.parse_args()
    if a.kind == "spin":  # the baseline: as busy as a flood, without touching the pool
        print("flooding", flush=True)
        deadline = time.monotonic() + a.seconds
        while time.monotonic() < deadline:
            pass
        return
    print(json.dumps(flood(a.address, a.kind, a.count, a.size, a.seconds)), flush=True)


if __name__ == "__main__":
    main()
