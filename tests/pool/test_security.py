"""Only the key holder is heard; nothing listens beyond loopback; the key stays private."""

from __future__ import annotations

import json
import os
import stat

import psutil
import pytest

import workbench as wb
from workbench.pool import handshake, protocol, wire
from tests.pool import rank_fns


class _Intruder:
    """A process on this machine that connects to the pool's socket but does not hold the key."""

    def __init__(self, pool):
        self.sock = wire.connect(pool.address, timeout_s=5)
        self.reader = wire.FrameReader(self.sock, max_frame=None)

    def send(self, blob: bytes) -> None:
        wire.send_all(self.sock, blob)

    def answer(self, timeout_s: float):
        """The next frame the pool sends us; None if none comes; EOFError if the pool hung up."""
        return self.reader.next(timeout_s)

    def close(self) -> None:
        self.sock.close()


class _Boom:
    """Unpickling this would run code: proof that nothing is unpickled before the MAC check."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/workbench-pwned",))


def _wait_rejected(pool, at_least, timeout_s=5.0):
    import time

    deadline = time.monotonic() + timeout_s
    while pool.rejected_messages < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return pool.rejected_messages


def _closed_by_pool(intruder: _Intruder, timeout_s: float = 5.0) -> bool:
    """Whether the pool hung up on this connection (rather than answering or waiting)."""
    try:
        intruder.answer(timeout_s)
    except EOFError:
        return True
    return False


def test_forged_tampered_and_replayed_messages_are_dropped_and_the_pool_keeps_working(pool):
    if os.path.exists("/tmp/workbench-pwned"):
        os.remove("/tmp/workbench-pwned")
    before = pool.rejected_messages
    session = pool._transport.session
    rank0 = pool._transport.ranks[0]
    sender = f"r0:{rank0.incarnation}:main"
    bad = [
        # forged: a payload that would run code, signed with the wrong key
        protocol.Signer(protocol.new_key(), sender, session).seal(_Boom()),
        # replayed: a correctly signed message with a sequence number already used by rank 0
        protocol.Signer(pool._key, sender, session, seq=0).seal({"type": "event", "event": "replayed"}),
        # a valid signature but from another session (an earlier life of the pool)
        protocol.Signer(pool._key, sender, "0" * 16, seq=10**9).seal({"type": "event", "event": "stale"}),
        # garbage
        b"not a message",
        json.dumps({"v": 1}).encode(),
    ]
    # tampered: correctly signed, then one payload byte flipped
    blob = protocol.Signer(pool._key, sender, session, seq=10**9).seal({"type": "event", "event": "tampered"})
    bad.append(blob[:-1] + bytes([blob[-1] ^ 1]))
    for frame in bad:
        # A connection that has not proved itself gets one try: the pool hangs up after a bad frame.
        sock = _Intruder(pool)
        sock.send(frame)
        assert _closed_by_pool(sock)
        sock.close()
    assert _wait_rejected(pool, before + 6) >= before + 6
    # a connection that has not proved it holds the key may not make the notebook buffer a huge frame
    hog = _Intruder(pool)
    hog.sock.sendall(wire.PREFIX.pack(10**12) + b"x" * 100)
    assert _wait_rejected(pool, before + 7) >= before + 7
    assert _closed_by_pool(hog)
    hog.close()
    assert not os.path.exists("/tmp/workbench-pwned")
    assert not pool.broken
    assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]


def test_an_intruder_knocking_without_the_key_cannot_join(pool):
    before = pool.rejected_messages
    for knock in (handshake.knock(7, "deadbeefdeadbeef", "0" * 32),  # a rank the pool does not have
                  protocol.KNOCK + b" 0 deadbeef nonce",  # not the shape of a knock
                  handshake.knock(0, "deadbeefdeadbeef", "0" * 32) + b"x" * 1000):  # padded
        out_of_range = _Intruder(pool)
        out_of_range.send(knock)
        assert _closed_by_pool(out_of_range), "refused without an answer"
        out_of_range.close()

    sock = _Intruder(pool)
    sock.send(handshake.knock(0, "deadbeefdeadbeef", "1" * 32))
    welcome = sock.answer(5)
    # The challenge is signed by the pool, and says nothing of how ranks start (no settings, no environment).
    _, message = protocol.Verifier(pool._key).open(welcome, adopt_session=True)
    assert set(message) == {"type", "nonce", "challenge"} and message["nonce"] == "1" * 32
    # Answering it needs the key: a hello signed with another key is dropped, and nothing joins.
    forged = protocol.Signer(protocol.new_key(), "r0:deadbeefdeadbeef:main", pool._transport.session)
    sock.send(forged.seal({"type": "hello", "challenge": message["challenge"], "pid": os.getpid(), "host": "x"}))
    assert _wait_rejected(pool, before + 4) >= before + 4
    assert _closed_by_pool(sock), "no settings for a rank that did not prove it holds the key"
    sock.close()
    assert pool.run(rank_fns.whoami)[0][0] == 0
    assert len(pool.pids) == pool.world_size


def test_every_pool_process_listens_on_loopback_only(pool):
    loopback = {"127.0.0.1", "::1"}
    for per_rank in pool.run(rank_fns.listening_sockets):
        assert per_rank, "gloo listens for its peers"
        assert {ip for ip, _ in per_rank} <= loopback, per_rank
    # The notebook's end listens on a unix socket in the pool's private directory: no TCP port at all.
    assert pool.address.startswith("unix://")
    path = pool.address.removeprefix("unix://")
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    tcp_listeners = [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert all(c.laddr.ip in loopback for c in tcp_listeners), tcp_listeners


def test_an_external_pool_binds_loopback_unless_asked(tmp_path):
    with wb.Pool(1, device="cpu", external=True, key_file=str(tmp_path / "k")) as ext:
        host, port = ext.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        mine = [c for c in psutil.Process().net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)]
        assert mine and all(c.laddr.ip == "127.0.0.1" for c in mine)


def test_the_key_file_is_readable_by_its_owner_only(pool, tmp_path):
    mode = stat.S_IMODE(os.stat(pool.key_file).st_mode)
    assert mode == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(pool.key_file)).st_mode) == 0o700

    from workbench.pool.launch import read_key_file, write_key_file

    path = tmp_path / "k"
    write_key_file(path)
    os.chmod(path, 0o644)
    import pytest

    with pytest.raises(PermissionError, match="chmod 600"):
        read_key_file(path)


def test_protocol_rejects_before_unpickling():
    import struct

    import pytest

    key = protocol.new_key()
    signer, verifier = protocol.Signer(key, "a", "s"), protocol.Verifier(key, "s")
    blob = signer.seal({"x": 1})
    assert verifier.open(blob) == ("a", {"x": 1})
    with pytest.raises(protocol.Rejected, match="replayed"):
        verifier.open(blob)
    evil = protocol.Signer(protocol.new_key(), "a", "s", seq=5).seal(_Boom())
    with pytest.raises(protocol.Rejected, match="signature"):
        verifier.open(evil)
    # claiming a longer header (moving payload bytes into it) must not keep the MAC valid
    blob = signer.seal("ab")
    version, header_len = struct.unpack_from("!BH", blob)
    with pytest.raises(protocol.Rejected):
        verifier.open(struct.pack("!BH", version, header_len + 1) + blob[3:])
    with pytest.raises(protocol.Rejected, match="too short"):
        verifier.open(blob[:10])


def test_idle_connections_cannot_lock_new_ranks_out(pool):
    from workbench.pool.switchboard import MAX_STRANGERS

    idle = [_Intruder(pool) for _ in range(MAX_STRANGERS + 5)]
    latecomer = _Intruder(pool)
    latecomer.send(handshake.knock(0, "deadbeefdeadbeef", "2" * 32))
    assert latecomer.answer(5) is not None, "the newest connection is still heard"
    for sock in idle + [latecomer]:
        sock.close()
    assert pool.run(rank_fns.whoami)[0][0] == 0
