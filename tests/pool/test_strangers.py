"""Strangers cost nothing: the floods of issue 17 (loopback only, bounded in count and time) against a live pool.

Each flood is a process of its own (tests/pool/flood.py), so what this
process's tracemalloc sees is the driver's own memory.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

from tests.pool import rank_fns
from workbench.pool.ratelimit import RateLimitedLog

ROOT = Path(__file__).resolve().parents[2]


def _flood(pool, kind: str, *args: str, seconds: float = 60) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.pool.flood", pool.address, kind, "--seconds", str(seconds),
                          *args], cwd=ROOT, capture_output=True, text=True, timeout=seconds + 60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "workbench.pool" and r.levelno >= logging.WARNING]


def _line_budget(seconds: float) -> int:
    """What the rate limit allows in `seconds`: a burst and one summary line per period begun."""
    limiter = RateLimitedLog(logging.getLogger("x"))
    return (limiter.burst + 1) * (int(seconds / limiter.period_s) + 2)


def test_four_thousand_large_knocks_leave_the_driver_memory_bounded(pool, caplog):
    # The drill: 4,000 knocks of ~60 KB each (~240 MB) from a peer that never reads. Before the fix each one
    # left a challenge and a queued answer echoing its nonce: the driver grew from 22 to 406 MB and stayed there.
    caplog.set_level(logging.WARNING, logger="workbench.pool")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        t0 = time.monotonic()
        sent = _flood(pool, "knocks", "--count", "4000", "--size", "60000")
        small = _flood(pool, "knocks", "--count", "4000", "--size", "72")  # well-formed knocks, never read
        assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]
        after, peak = tracemalloc.get_traced_memory()
        elapsed = time.monotonic() - t0
    finally:
        tracemalloc.stop()
    print(f"\nknocks sent {sent['sent']} (+{small['sent']} small) on {sent['connections'] + small['connections']} "
          f"connections; driver memory peak +{(peak - before) / 2**20:.1f} MiB, after +{(after - before) / 2**20:.2f} "
          f"MiB; {len(_warnings(caplog))} warning lines")
    assert sent["sent"] == small["sent"] == 4000
    assert peak - before < 16 * 2**20, "bounded while the flood lasts"
    assert after - before < 2 * 2**20, "nothing kept once the stranger is gone"
    assert len(_warnings(caplog)) <= _line_budget(elapsed), "warnings are rate-limited"
    assert not pool.broken


def test_wrong_mac_frames_are_counted_with_a_few_log_lines_and_cost_a_connection_each(pool, caplog):
    caplog.set_level(logging.WARNING, logger="workbench.pool")
    before = pool.rejected_messages
    t0 = time.monotonic()
    sent = _flood(pool, "forged", "--count", "3000")
    elapsed = time.monotonic() - t0
    assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]
    rejected = pool.rejected_messages - before
    lines = _warnings(caplog)
    print(f"\n{sent['sent']} forged frames on {sent['connections']} connections: {rejected} rejected, "
          f"{len(lines)} warning lines")
    assert sent["sent"] == 3000
    # A stranger gets one try: the first forged frame on a connection is counted and the connection closed,
    # whatever else it wrote into the socket; it must connect again to be read again.
    assert sent["connections"] - 1 <= rejected <= sent["connections"] + 2
    assert len(lines) <= _line_budget(elapsed)


def test_a_flood_during_restart_cannot_keep_the_ranks_from_joining(pool):
    # Connect, knock, hang up, as fast as one process can, for as long as the restart takes. Until the
    # switchboard counted only live strangers and left a welcomed one alone, this flood closed the restarting
    # ranks' connections between welcome and hello for their whole CONNECT_TIMEOUT_S (test_admission.py).
    # What is under test is the handshake under the flood, not torch imported on cores the flood shares: a
    # prepared standby (bounded wait; the restart is only slower without one).
    deadline = time.monotonic() + 120
    while not pool.standby.ready and time.monotonic() < deadline:
        time.sleep(0.2)
    flood = subprocess.Popen([sys.executable, "-m", "tests.pool.flood", pool.address, "churn", "--seconds", "120"],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout.readline().strip() == "flooding"
        pool.restart()
        assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]
        assert flood.poll() is None, "the flood lasted the whole restart"
    finally:
        flood.kill()
        flood.wait(10)
    assert not pool.broken
