"""Checkpoints that cost less, through the ranks: a background save overlaps training and loads bit-identically;
what the chunk store already holds is not written again; every save is reported as a span.

Tolerance: none. Within one layout a load reproduces the saved run exactly (floats compared with ==).
"""

from __future__ import annotations

import threading
import time

import pytest

import workbench as wb
from workbench import checkpoints as ck
from workbench.checkpoints import store
from workbench.config import Config
from workbench.engine import checkpoint
from workbench.engine.session import drop
from workbench.pool import rank
from workbench.telemetry.events import CheckpointSave

from tests.engine.test_checkpoint import CFG, _session, _train, trained_straight

ZERO3 = Config(dp=2, zero=3, batch_size=8, seq_len=64)
"""Sharded (DTensor) state: what DCP's stager must copy to host memory correctly."""


# -- on the ranks ---------------------------------------------------------------------------------------
def save_in_the_background_while_training(cfg: Config, directory: str) -> dict:
    """Train 2 steps, start a background save whose chunk writes are held until 3 more steps have trained, then
    let it finish; load it into a new trainer and train the same 3 steps again."""
    with rank.unchecked():
        session = _session(cfg)
        _train(session, 2)
        release, real_put = threading.Event(), store.put

        def held_put(root, data):
            release.wait(timeout=120)  # bounds a hang, never reached unless training waited for the save
            return real_put(root, data)

        store.put = held_put
        try:
            final = checkpoint.save(session.trainer, session.next_step, directory, None, "a5a5", asynchronous=True)
            after = _train(session, 3)  # would never return if the save blocked training
            in_flight = not rank.state["checkpoint.pending"].future.done()
            release.set()
            checkpoint.finish_pending()
        finally:
            store.put = real_put
        saved = ck.resume_state(ck.verify(final))
        again = _session(cfg)
        checkpoint.load(again.trainer, final, saved)
        again.next_step = saved["next_step"]
        return {"after": after, "again": _train(again, 3), "in_flight": in_flight, "step": saved["next_step"]}


def events_of(pool) -> tuple[list, callable]:
    seen: list[tuple[int, CheckpointSave]] = []
    unsubscribe = pool.subscribe(lambda r, e: seen.append((r, e)) if isinstance(e, CheckpointSave) else None)
    return seen, unsubscribe


def wait_for(events: list, count: int) -> None:
    """Events cross on the pool's I/O thread, after the command's result: give them a moment (bounded)."""
    deadline = time.monotonic() + 10
    while len(events) < count and time.monotonic() < deadline:
        time.sleep(0.01)


# -- tests --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def straight(_session_pool) -> list[float]:
    return trained_straight(_session_pool, 12)


def test_training_goes_on_during_a_background_save_and_the_checkpoint_loads_bit_identically(pool, tmp_path):
    seen, unsubscribe = events_of(pool)
    try:
        out = pool.run(save_in_the_background_while_training, ZERO3, str(tmp_path))
        wait_for(seen, 2)
    finally:
        unsubscribe()
    for r in out:
        assert r["in_flight"], "3 steps trained while the save's writes were held: it ran in the background"
        assert r["again"] == r["after"]  # the state as it was at the save, not as training changed it after
    assert out[0]["step"] == 2
    spans = sorted(seen, key=lambda x: x[0])
    assert [r for r, _ in spans] == [0, 1]
    for r, event in spans:
        assert event.asynchronous and not event.error and event.step == 2
        assert event.start_ns <= event.staged_ns < event.durable_ns
        assert event.bytes_written > 0  # a first save (a few bytes may match what the other rank wrote first)


def test_periodic_background_saves_keep_the_last_k_and_each_resumes_exactly(pool, straight, tmp_path):
    pool.run(drop)
    bench = wb.Workbench(pool=pool, telemetry=False)
    seen, unsubscribe = events_of(pool)
    try:
        bench.apply(CFG)
        bench.train(12, save_every=4, save_to=tmp_path, keep=2, async_save=True).wait()
        wait_for(seen, 6)
        assert [c.name for _, c in ck.complete(tmp_path)] == ["step-000008", "step-000012"]  # durable at wait()
        assert bench.load(tmp_path)["step"] == 12
        bench.load(tmp_path / "step-000008")
        assert [m.loss for m in bench.train(4).wait()] == straight[8:12]
    finally:
        unsubscribe()
        pool.run(drop)
    assert sorted((e.step, r) for r, e in seen) == [(s, r) for s in (4, 8, 12) for r in (0, 1)]
    assert all(e.asynchronous and not e.error for _, e in seen)
    assert bench.store.snapshot().saves == tuple(e for _, e in seen)  # what the dashboard's timeline draws


def test_saving_the_same_step_twice_writes_no_chunk_again(pool, tmp_path):
    pool.run(drop)
    bench = wb.Workbench(pool=pool, telemetry=False)
    seen, unsubscribe = events_of(pool)
    try:
        bench.apply(CFG)
        bench.train(3).wait()
        first = bench.save(tmp_path)
        chunks = {p: p.stat().st_mtime_ns for p in (tmp_path / "chunks").glob("*/*")}
        second = bench.save(tmp_path)
        wait_for(seen, 4)
        assert first == second and ck.verify(second)["next_step"] == 3
        assert {p: p.stat().st_mtime_ns for p in (tmp_path / "chunks").glob("*/*")} == chunks
        bench.load(tmp_path)
    finally:
        unsubscribe()
        pool.run(drop)
    per_rank = {r: [e for q, e in seen if q == r] for r in (0, 1)}
    firsts, seconds = [e[0] for e in per_rank.values()], [e[1] for e in per_rank.values()]
    total = sum(e.bytes_written + e.bytes_reused for e in firsts)
    assert sum(e.bytes_written for e in firsts) > 0.99 * total  # (equal chunks of two ranks are written once)
    assert sum(e.bytes_written for e in seconds) == 0  # the second save: every chunk already there
    assert sum(e.bytes_reused for e in seconds) == total
