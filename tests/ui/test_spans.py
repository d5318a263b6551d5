"""Checkpoint saves and compilations beside the steps: the store keeps them (bounded), the timeline draws those
that overlap the latest step on a row of their own (an async save as its held part and its background write),
and the status line says "compiling" while one runs."""

from __future__ import annotations

import time

import pytest

import workbench as wb
from tests.ui.fakes import fake_workbench, step_metrics
from workbench.telemetry.events import CheckpointSave, Compilation
from workbench.telemetry.store import TelemetryStore
from workbench.ui.controls import Controls
from workbench.ui.live import LivePlots

MS = 1_000_000
STEP2 = 1_000_000_000 + 2 * 20 * MS
"""Where `step_metrics` puts step 2's first interval (its steps are 20 ms apart and 8 ms long)."""


def _save(rank: int, start_ms: float, staged_ms: float, durable_ms: float, *, asynchronous: bool = True,
          step: int = 3) -> CheckpointSave:
    return CheckpointSave(rank=rank, step=step, path=f"ckpt/step-{step}", asynchronous=asynchronous,
                          start_ns=STEP2 + int(start_ms * MS), staged_ns=STEP2 + int(staged_ms * MS),
                          durable_ns=STEP2 + int(durable_ms * MS), bytes_written=4096, bytes_reused=1024)


def _compilation(rank: int, start_ms: float, end_ms: float | None) -> Compilation:
    return Compilation(rank=rank, compile_id="0/0", trigger="dynamo", start_ns=STEP2 + int(start_ms * MS),
                       end_ns=None if end_ms is None else STEP2 + int(end_ms * MS))


def _store() -> TelemetryStore:
    store = TelemetryStore()
    store.add_layout_change(0, wb.Config(dp=2))
    for step in range(3):
        for r in range(2):
            store.add(r, step_metrics(r, step))
    return store


def _traces(fig) -> dict:
    return {t.name: t for t in fig.data}


def test_the_store_keeps_saves_and_each_compilation_once_bounded():
    store = TelemetryStore(max_spans=2)
    seen = []
    store.subscribe(seen.append)
    start = _compilation(0, 0.5, None)
    store.on_event(0, start)
    assert store.snapshot().compiling == (start,) and store.compiling() == (start,)
    end = _compilation(0, 0.5, 1.5)
    store.on_event(0, end)  # its end replaces its start
    assert store.snapshot().compilations == (end,) and store.compiling() == () and seen == [start, end]
    saves = [_save(0, 1, 2, 3, step=s) for s in (1, 2, 3)]
    for s in saves:
        store.on_event(0, s)
    assert store.snapshot().saves == tuple(saves[-2:])  # the latest max_spans
    for i in range(3):
        store.on_event(0, Compilation(0, f"{i}/0", "dynamo", i, i + 1))
    assert [c.compile_id for c in store.snapshot().compilations] == ["1/0", "2/0"]
    store.clear()
    assert store.snapshot().saves == () and store.snapshot().compilations == ()


def test_the_timeline_draws_saves_and_compilations_that_overlap_the_latest_step():
    store = _store()
    store.on_event(0, _compilation(0, 0.5, 1.5))
    store.on_event(1, _save(1, 7.5, 8.0, 30.0))                                   # async: held, then written
    store.on_event(0, _save(0, 7.0, 7.6, 7.6, asynchronous=False))                # blocking: all held
    store.on_event(0, _save(0, -30.0, -29.0, -25.0, step=1))                      # in step 1: not drawn
    store.on_event(1, _compilation(1, 2.0, None))                                 # still compiling: not drawn
    fig = LivePlots(store, 2).figures["timeline"]
    t = _traces(fig)
    compiling = t["compiling"]
    assert list(compiling.y) == ["rank 0 save/compile"] and list(compiling.base) == [0.5]
    assert list(compiling.x) == pytest.approx([1.0]) and "frame 0/0 (dynamo)" in compiling.customdata[0][1]
    held = t["checkpoint: training held"]
    assert list(held.y) == ["rank 0 save/compile", "rank 1 save/compile"]
    assert list(held.base) == pytest.approx([7.0, 7.5]) and list(held.x) == pytest.approx([0.6, 0.5])
    background = t["checkpoint: background write"]
    assert list(background.y) == ["rank 1 save/compile"]
    assert list(background.base) == pytest.approx([8.0]) and list(background.x) == pytest.approx([22.0])
    assert "4,096 B written, 1,024 B already stored" in background.customdata[0][1]
    assert len({trace.marker.color for trace in fig.data}) == len(fig.data)  # one colour per kind
    assert all(t[name].showlegend for name in ("compiling", "checkpoint: training held",
                                              "checkpoint: background write"))
    rows = list(fig.layout.yaxis.categoryarray)
    assert rows == [f"rank {r} {kind}" for r in (0, 1) for kind in ("compute", "wait", "comm", "save/compile")]


def test_without_spans_the_timeline_has_no_extra_row_or_legend():
    fig = LivePlots(_store(), 2).figures["timeline"]
    assert not any(kind.endswith("save/compile") for kind in fig.layout.yaxis.categoryarray)
    assert not _traces(fig)["compiling"].showlegend and not _traces(fig)["compiling"].x


def test_the_status_line_says_compiling_while_a_rank_compiles():
    bench = fake_workbench(world_size=2, step_s=0.05)
    c = Controls(bench)
    bench.apply(wb.Config(dp=2))
    run = bench.train(200)
    try:
        for r in (0, 1):
            bench.pool.emit(r, _compilation(r, 0, None))
        c.refresh_status()
        assert "compiling on ranks 0, 1 … · training · step " in c.status.value
        bench.pool.emit(0, _compilation(0, 0, 5))
        c.refresh_status()
        assert "compiling on rank 1 … · training" in c.status.value
        bench.pool.emit(1, _compilation(1, 0, 5))
        c.refresh_status()
        assert "compiling" not in c.status.value and "training · step " in c.status.value
    finally:
        run.stop()
    deadline = time.monotonic() + 5
    while bench.running is not None and time.monotonic() < deadline:
        time.sleep(0.01)
