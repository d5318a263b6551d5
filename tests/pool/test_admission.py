"""Who the switchboard lets in when strangers crowd its socket: a bare Switchboard, no ranks, milliseconds.

The live drill (a churn flood during a restart) is in test_strangers.py; these pin the policy it relies on.
"""

from __future__ import annotations

import shutil
import socket
import tempfile

import pytest

from workbench.pool import switchboard, wire
from workbench.pool.switchboard import MAX_STRANGERS, Switchboard


@pytest.fixture
def board():
    folder = tempfile.mkdtemp(prefix="wb-adm-", dir="/tmp")  # a unix socket path must stay under 108 bytes
    b = Switchboard(f"unix://{folder}/s")
    yield b
    b.close()
    shutil.rmtree(folder, ignore_errors=True)


def _connect(board: Switchboard, n: int = 1) -> list[socket.socket]:
    return [wire.connect(board.address, timeout_s=5) for _ in range(n)]


def _settle(board: Switchboard, rounds: int = 10) -> list:
    """Poll until nothing new happens (accepts come one round after the listener announces them)."""
    frames = []
    for _ in range(rounds):
        got, _ = board.poll(0.01)
        frames += got
    return frames


def _newest(board: Switchboard) -> switchboard.Peer:
    return list(board.strangers)[-1]


def _closed(sock: socket.socket, wait_s: float = 0.2) -> bool:
    """Whether the board hung up on `sock` (a hang-up is seen at once; staying open takes `wait_s` to tell)."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_welcomed_connection_outlasts_any_crowd_of_newcomers(board):
    rank = _connect(board)[0]
    _settle(board)
    welcomed = _newest(board)
    board.welcome(welcomed, b"welcome")
    crowd = _connect(board, 2 * MAX_STRANGERS)
    _settle(board, rounds=20)
    assert welcomed in board.peers, "newcomers made room by closing the idle ones, not the rank in its handshake"
    assert len(board.strangers) == MAX_STRANGERS
    assert not _closed(rank)
    for sock in crowd + [rank]:
        sock.close()


def test_when_every_stranger_is_in_its_handshake_the_newcomer_is_refused_until_one_times_out(board, monkeypatch):
    socks = _connect(board, MAX_STRANGERS)
    _settle(board)
    assert len(board.strangers) == MAX_STRANGERS
    for peer in list(board.strangers):
        board.welcome(peer, b"welcome")
    refused_before = board.refused
    late = _connect(board)[0]
    _settle(board)
    assert _closed(late), "no room: the newcomer is refused"
    assert board.refused == refused_before + 1
    assert all(p.sock.fileno() >= 0 for p in board.strangers), "nobody in a handshake was closed"
    # Once the oldest one's time to say hello is up, a newcomer may take its place.
    oldest = next(iter(board.strangers))
    monkeypatch.setattr(switchboard, "HANDSHAKE_S", 0.0)
    later = _connect(board)[0]
    _settle(board)
    assert oldest not in board.peers and not _closed(later)
    for sock in socks + [late, later]:
        sock.close()


def test_strangers_that_hung_up_do_not_count_against_newcomers(board):
    # The churn flood that kept ranks out: a round reads the knocks of connections that hung up right after
    # sending them, while as many newcomers wait at the listener. Counted together they passed the cap and the
    # oldest stranger was closed: here, a rank whose knock has not been read yet.
    rank = _connect(board)[0]
    _settle(board)
    rank_peer = _newest(board)
    churn = _connect(board, MAX_STRANGERS - 1)
    _settle(board)
    assert len(board.strangers) == MAX_STRANGERS
    for sock in churn:
        wire.send_all(sock, b"knock")
        sock.close()
    newcomers = _connect(board, switchboard.ACCEPTS_PER_POLL)
    frames, _ = board.poll(0.5)
    assert len(frames) == MAX_STRANGERS - 1
    for peer, _blob in frames:  # what the transport does with a well-formed knock: the peer is gone, it fails
        board.welcome(peer, b"welcome")
    _settle(board)
    assert rank_peer in board.peers, "the rank's connection was not closed to make room"
    assert len(board.strangers) == 1 + switchboard.ACCEPTS_PER_POLL
    for sock in newcomers + [rank]:
        sock.close()
