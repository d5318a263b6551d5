"""Only the key holder is heard; nothing listens beyond loopback; the key stays private."""

from __future__ import annotations

import json
import os
import stat

import psutil
import zmq

import workbench as wb
from workbench.pool import protocol
from tests.pool import rank_fns


def _intruder(pool):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.connect(pool.address if pool.address.startswith("ipc://") else f"tcp://{pool.address}")
    return sock


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


def test_forged_tampered_and_replayed_messages_are_dropped_and_the_pool_keeps_working(pool):
    if os.path.exists("/tmp/workbench-pwned"):
        os.remove("/tmp/workbench-pwned")
    before = pool.rejected_messages
    sock = _intruder(pool)
    session = pool._transport.session
    rank0 = pool._transport.ranks[0]
    sender = f"r0:{rank0.incarnation}:main"

    # forged: a payload that would run code, signed with the wrong key
    forger = protocol.Signer(protocol.new_key(), sender, session)
    sock.send(forger.seal(_Boom()))
    # tampered: correctly signed, then one payload byte flipped
    legit = protocol.Signer(pool._key, sender, session, seq=10**9)
    blob = legit.seal({"type": "event", "event": "tampered"})
    sock.send(blob[:-1] + bytes([blob[-1] ^ 1]))
    # replayed: a correctly signed message with a sequence number already used by rank 0
    old = protocol.Signer(pool._key, sender, session, seq=0)
    sock.send(old.seal({"type": "event", "event": "replayed"}))
    # a valid signature but from another session (an earlier life of the pool)
    stale = protocol.Signer(pool._key, sender, "0" * 16, seq=10**9)
    sock.send(stale.seal({"type": "event", "event": "stale"}))
    # garbage
    sock.send_multipart([b"not", b"a message"])
    sock.send(json.dumps({"v": 1}).encode())

    assert _wait_rejected(pool, before + 6) >= before + 6
    sock.close()
    assert not os.path.exists("/tmp/workbench-pwned")
    assert not pool.broken
    assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]


def test_an_intruder_knocking_without_the_key_cannot_join(pool):
    sock = _intruder(pool)
    sock.send_multipart([protocol.KNOCK, b"0", b"deadbeef", b"nonce"])
    sock.send_multipart([protocol.KNOCK, b"7", b"deadbeef", b"nonce"])
    assert sock.poll(500) == 0, "a knock from a wrong identity gets no answer"
    sock.close()
    assert pool.run(rank_fns.whoami)[0][0] == 0


def test_every_pool_process_listens_on_loopback_only(pool):
    loopback = {"127.0.0.1", "::1"}
    for per_rank in pool.run(rank_fns.listening_sockets):
        assert per_rank, "gloo listens for its peers"
        assert {ip for ip, _ in per_rank} <= loopback, per_rank
    # The notebook's end listens on a unix socket in the pool's private directory: no TCP port at all.
    assert pool.address.startswith("ipc://")
    path = pool.address.removeprefix("ipc://")
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
