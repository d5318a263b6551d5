"""TelemetryStore: per-rank steps in order, layout changes, subscribers, and safety across threads."""

from __future__ import annotations

import threading

import workbench as wb
from tests.ui.fakes import step_metrics
from workbench.telemetry.runs import RunRecord
from workbench.telemetry.store import TelemetryStore


def test_keeps_each_ranks_steps_in_step_order():
    store = TelemetryStore()
    for step in (2, 0, 1):
        store.add(0, step_metrics(0, step))
    store.add(1, step_metrics(1, 0))
    snap = store.snapshot()
    assert [m.step for m in snap.steps(0)] == [0, 1, 2]
    assert [m.step for m in snap.steps(1)] == [0]
    assert snap.ranks == [0, 1] and len(store) == 3


def test_the_same_step_twice_is_stored_once():
    store = TelemetryStore()
    store.add(0, step_metrics(0, 5, loss=1.0))
    store.add(0, step_metrics(0, 5, loss=2.0))
    assert [m.loss for m in store.steps(0)] == [2.0]


def test_on_event_keeps_step_metrics_and_ignores_other_events():
    store = TelemetryStore()
    store.on_event(0, "some other event")
    store.on_event(1, step_metrics(1, 0))
    assert store.snapshot().ranks == [1]


def test_oldest_steps_are_dropped_beyond_max_steps():
    store = TelemetryStore(max_steps=3)
    for step in range(5):
        store.add(0, step_metrics(0, step))
    assert [m.step for m in store.steps(0)] == [2, 3, 4]


def test_layout_changes_and_the_current_config():
    store = TelemetryStore()
    assert store.snapshot().config is None
    store.add_layout_change(0, wb.Config(dp=2))
    store.add(0, step_metrics(0, 6))
    store.add_layout_change(7, wb.Config(tp=2))
    assert [(c.step, c.layout) for c in store.layout_changes] == [(0, "dp2"), (7, "tp2")]
    assert store.snapshot().config == wb.Config(tp=2)


def test_common_latest_compares_ranks_on_one_step():
    store = TelemetryStore()
    for step in range(4):
        store.add(0, step_metrics(0, step))
    for step in range(3):
        store.add(1, step_metrics(1, step))
    snap = store.snapshot()
    assert {r: m.step for r, m in snap.common_latest().items()} == {0: 2, 1: 2}
    assert {r: m.step for r, m in snap.latest().items()} == {0: 3, 1: 2}


def test_subscribers_hear_every_change_until_they_unsubscribe():
    store = TelemetryStore()
    heard = []
    unsubscribe = store.subscribe(heard.append)
    m = step_metrics(0, 0)
    store.add(0, m)
    store.add_layout_change(1, wb.Config(dp=2))
    unsubscribe()
    store.add(0, step_metrics(0, 1))
    assert heard[0] is m and isinstance(heard[1], RunRecord) and len(heard) == 2


def test_a_failing_subscriber_does_not_stop_the_others():
    store = TelemetryStore()
    heard = []
    store.subscribe(lambda record: 1 / 0)
    store.subscribe(heard.append)
    store.add(0, step_metrics(0, 0))
    assert len(heard) == 1


def test_writers_and_readers_on_many_threads():
    store = TelemetryStore()
    versions = []

    def write(rank: int) -> None:
        for step in range(300):
            store.add(rank, step_metrics(rank, step, telemetry=False))

    def read() -> None:
        for _ in range(100):
            snap = store.snapshot()
            versions.append(snap.version)
            for ms in snap.by_rank.values():
                assert [m.step for m in ms] == sorted(m.step for m in ms)

    threads = [threading.Thread(target=write, args=(r,)) for r in range(4)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = store.snapshot()
    assert {r: len(ms) for r, ms in snap.by_rank.items()} == {r: 300 for r in range(4)}
    assert snap.version == 1200 and versions == sorted(versions)
