"""The plots drawn from a store fed with synthetic StepMetrics: what they show, and what they refuse to invent."""

from __future__ import annotations

import threading
import time

import comm
import pytest
from comm.base_comm import BaseComm

import workbench as wb
from tests.ui.fakes import step_metrics
from workbench.schedules import ideal_bubble_fraction, measured_bubble, schedule_grid
from workbench.telemetry.store import TelemetryStore
from workbench.ui.live import LivePlots, Ticker
from workbench.ui.panels import pipeline_intervals, static_figures


def _fed(steps: int = 5, telemetry: bool = True, **kw) -> TelemetryStore:
    store = TelemetryStore()
    store.add_layout_change(0, wb.Config(dp=2))
    for step in range(steps):
        for r in range(2):
            store.add(r, step_metrics(r, step, telemetry=telemetry, **kw))
    return store


def _notes(fig) -> list[str]:
    return [a.text for a in fig.layout.annotations]


def test_loss_per_step_with_a_marker_where_the_layout_changed():
    store = _fed(5)
    store.add_layout_change(5, wb.Config(tp=2))
    for r in range(2):
        store.add(r, step_metrics(r, 5, layout="tp2", skipped=True))
    fig = LivePlots(store, 2).figures["loss"]
    assert list(fig.data[0].x) == [0, 1, 2, 3, 4, 5]
    assert list(fig.data[0].y) == [m.loss for m in store.steps(0)]
    assert list(fig.data[1].x) == [5]  # the skipped step is marked
    assert [s.x0 for s in fig.layout.shapes] == [-0.5, 4.5]
    assert _notes(fig) == ["dp2", "tp2"]


def test_a_recovery_is_marked_on_its_runs_loss_with_the_steps_replayed_and_not_on_a_new_models():
    from workbench.telemetry.runs import Recovery

    store = _fed(6)
    store.truncate(4)
    store.add_recovery(Recovery(step=4, replayed=2, reason="rank 1 died (SIGKILL)", seconds=1.2))
    for step in (4, 5):
        for r in range(2):
            store.add(r, step_metrics(r, step))
    fig = LivePlots(store, 2).figures["loss"]
    assert list(fig.data[0].x) == [0, 1, 2, 3, 4, 5]  # every step once
    assert [s.x0 for s in fig.layout.shapes] == [-0.5, 3.5] and fig.layout.shapes[1].line.color == "#E45756"
    assert _notes(fig) == ["dp2", "recovered · 2 replayed"]
    assert "rank 1 died" in fig.layout.annotations[1].hovertext
    store.start_run(wb.Config(dp=2, seed=1), 0, continues=False)  # a new model: its history has no recovery
    for r in range(2):
        store.add(r, step_metrics(r, 0))
    fig = LivePlots(store, 2).figures["loss"]
    assert "recovered · 2 replayed" not in _notes(fig)


def test_throughput_step_time_and_mfu_with_its_basis_come_from_the_records():
    fig = LivePlots(_fed(4), 2).figures["throughput"]
    slots = len(fig.data) // 2
    tokens, step_time = fig.data[0], fig.data[slots]
    assert list(tokens.y) == [10240.0] * 4 and list(step_time.y) == [200.0] * 4  # ms
    assert all(not t.y for t in fig.data[1:slots] + fig.data[slots + 1:])  # nothing picked to compare
    # MFU per rank, labelled with what it is a fraction of (the probes say where the peak comes from).
    assert "MFU rank 0 5.0%, rank 1 5.0% — of a datasheet" in fig.layout.title.text


def test_memory_per_rank_stacked_by_category_with_the_peak():
    fig = LivePlots(_fed(3), 2).figures["memory"]
    by_cat = {t.name: list(t.y) for t in fig.data}
    assert list(fig.data[0].x[0]) == ["rank 0", "rank 0", "rank 1", "rank 1"]
    assert list(fig.data[0].x[1]) == ["end of step", "peak"] * 2
    assert by_cat["parameters"] == [3_600_000, 3_600_000, 3_600_001, 3_600_000]
    assert by_cat["activations"] == [0, 20_000_000, 0, 20_000_001]
    assert fig.layout.barmode == "stack" and "step 2" in fig.layout.title.text
    assert [t.visible for t in fig.data] == [True, True, True, True, "legendonly"]  # "other": one click away


def test_the_estimate_stands_hatched_beside_each_ranks_measured_memory():
    store = TelemetryStore()
    predicted = {r: {"parameters": 3_000_000, "optimizer": 6_000_000, "gradients": 3_000_000,
                     "activations": 18_000_000 + r} for r in range(2)}
    store.start_run(wb.Config(dp=2), 0, continues=False, predicted_memory=predicted)
    for step in range(2):
        for r in range(2):
            store.add(r, step_metrics(r, step))
    fig = LivePlots(store, 2).figures["memory"]
    by_cat = {t.name: list(t.y) for t in fig.data}
    assert list(fig.data[0].x[1]) == ["end of step", "peak", "predicted"] * 2
    assert by_cat["activations"][2::3] == [18_000_000, 18_000_001]
    assert by_cat["optimizer"][2::3] == [6_000_000] * 2 and by_cat["other"][2::3] == [None] * 2  # not modelled
    assert list(fig.data[0].marker.pattern.shape) == ["", "", "/"] * 2
    # Its hover names what it predicts, read as the comparison table reads it, with the error.
    hover = {t.name: list(t.customdata) for t in fig.data}
    assert hover["activations"][2] == "<br>measured 20 MB at its peak (-10.0%)"
    assert hover["parameters"][5] == "<br>measured 3.6 MB at rest (-16.7%)"
    assert hover["activations"][:2] == ["", ""] and "%{customdata}" in fig.data[0].hovertemplate
    # A run without an estimate (a GPU with no profile) draws the measurement alone.
    store.start_run(wb.Config(dp=2, seed=1), 0, continues=False)
    for r in range(2):
        store.add(r, step_metrics(r, 0))
    fig = LivePlots(store, 2).figures["memory"]
    assert list(fig.data[0].x[1]) == ["end of step", "peak"] * 2


def _traces(fig) -> dict:
    return {t.name: t for t in fig.data}


def test_timeline_of_the_latest_step_with_overlap_in_the_title_and_a_legend():
    fig = LivePlots(_fed(3), 2).figures["timeline"]
    t = _traces(fig)
    assert list(t["forward"].y) == ["rank 0 compute", "rank 1 compute"] and list(t["forward"].base) == [0.0, 0.0]
    assert list(t["backward"].text) == ["backward"] * 2 and list(t["optimizer"].base) == [7.0, 7.0]
    wait = t["waiting on a collective"]
    assert list(wait.y) == ["rank 0 wait", "rank 1 wait"] and list(wait.base) == [6.0, 6.0]
    rows = [f"rank {r} {kind}" for r in (0, 1) for kind in ("compute", "wait", "comm")]
    assert list(fig.layout.yaxis.categoryarray) == rows
    comm_ = t["all_reduce"]
    assert list(comm_.text) == ["all_reduce"] * 2 and list(comm_.base) == [4.0, 4.0] and list(comm_.x) == [3.0, 3.0]
    assert list(comm_.y) == ["rank 0 comm", "rank 1 comm"]
    # The legend names each colour this step has, and nothing it has not.
    assert {name for name, trace in t.items() if trace.showlegend} == {
        "forward", "backward", "optimizer", "waiting on a collective", "all_reduce"}
    assert len({trace.marker.color for trace in fig.data}) == len(fig.data)
    assert fig.layout.title.text.startswith("Timeline of step 2<br><sup>rank 0: 67% of comm overlapped, 1.0 ms exposed")


def test_interleaved_actions_name_their_stage():
    from workbench.schedules import Action

    store = TelemetryStore()
    store.add_layout_change(0, wb.Config(pp=2, micro_batches=2, schedule="interleaved_1f1b", stages_per_rank=2))
    store.add(0, step_metrics(0, 0, actions=[(Action(0, "F", 0), 10, 11), (Action(2, "F", 0), 11, 12)]))
    figs = LivePlots(store, 2).figures
    assert list(_traces(figs["timeline"])["forward"].text) == ["forward", "0F0", "2F0"]
    ideal = figs["pipeline"].data[0]
    assert "0F0" in ideal.text and "2F0" in ideal.text  # not two cells reading "F0"


def test_overlap_over_steps_per_rank():
    fig = LivePlots(_fed(4), 2).figures["overlap"]
    assert [list(t.x) for t in fig.data] == [[0, 1, 2, 3]] * 2
    assert list(fig.data[0].y) == [pytest.approx(2 / 3)] * 4


def test_without_telemetry_the_plots_say_so_and_invent_nothing():
    figs = LivePlots(_fed(3, telemetry=False), 2).figures
    assert list(figs["loss"].data[0].x) == [0, 1, 2]
    assert "MFU: not reported yet" in figs["throughput"].layout.title.text
    assert all(not t.y for t in figs["memory"].data)
    assert _notes(figs["memory"]) == ["memory by category: not reported yet"]
    assert all(not t.x for t in figs["timeline"].data) and "not reported yet" in _notes(figs["timeline"])[0]
    assert not any(t.showlegend for t in figs["timeline"].data)
    assert all(not t.y for t in figs["overlap"].data) and "not reported yet" in _notes(figs["overlap"])[0]
    assert "no pipeline" in _notes(figs["pipeline"])[0]


def test_an_empty_store_shows_no_steps_yet():
    figs = LivePlots(TelemetryStore(), 2).figures
    for name in ("loss", "throughput", "memory", "timeline", "overlap"):
        assert "no steps yet" in _notes(figs[name])[-1], name


def _pipeline_store(schedule: str = "1f1b", pp: int = 2, m: int = 4) -> TelemetryStore:
    store = TelemetryStore()
    store.add_layout_change(0, wb.Config(pp=pp, micro_batches=m, schedule=schedule))
    grid = schedule_grid(schedule, pp, m)
    for r in range(pp):
        # Measured: each action takes 1 ms plus B twice as long, placed at its ideal time step × 3 ms.
        actions = [(a, 3 * t, 3 * t + (2 if a.kind == "B" else 1)) for t in range(grid.steps)
                   if (a := grid.at(r, t)) is not None]
        store.add(r, step_metrics(r, 0, layout="pp2", actions=actions))
    return store


def test_pipeline_grid_measured_beside_the_ideal():
    store = _pipeline_store()
    fig = LivePlots(store, 2).figures["pipeline"]
    ideal_f, ideal_b, _, _, measured_f, measured_b, _, _ = fig.data  # F, B, I, W for each grid
    assert len(ideal_f.x) == len(ideal_b.x) == len(measured_f.x) == len(measured_b.x) == 2 * 4
    assert list(ideal_f.text[:2]) == ["F0", "F1"] and set(ideal_b.text) == {"B0", "B1", "B2", "B3"}
    measured = pipeline_intervals(store.snapshot().common_latest(), 2)
    assert [(iv.rank, iv.stage, iv.kind, iv.microbatch) for iv in measured[:2]] == [(0, 0, "F", 0), (0, 0, "F", 1)]
    title = fig.layout.title.text
    assert f"measured {measured_bubble(measured).fraction:.0%}" in title
    assert f"ideal (p−1)/(m+p−1) = {ideal_bubble_fraction(2, 4):.0%}" in title
    assert _notes(fig) == []


def test_pipeline_ideal_grid_shows_before_any_measurement():
    store = TelemetryStore()
    store.add_layout_change(0, wb.Config(pp=2, micro_batches=4, schedule="interleaved_1f1b", stages_per_rank=2))
    fig = LivePlots(store, 2).figures["pipeline"]
    assert len(fig.data[0].x) == 2 * 4 * 2  # F of 4 micro-batches through 2 stages on each of 2 ranks
    assert "(p−1)/(v·m+p−1) = " + f"{ideal_bubble_fraction(2, 4, 2):.0%}" in fig.layout.title.text
    assert "not reported yet" in _notes(fig)[0]


class _RecordingComm(BaseComm):
    sent: list = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        self.sent.append((self.comm_id, data))


@pytest.fixture
def recorded(monkeypatch):
    _RecordingComm.sent = []
    monkeypatch.setattr(comm, "create_comm", lambda **kw: _RecordingComm(**kw))
    return _RecordingComm.sent


def test_one_update_message_per_figure_per_tick_and_none_without_news(recorded):
    store = _fed(2)
    plots = LivePlots(store, 2, resync_s=3600)  # only the incremental updates here
    names = {fig.comm.comm_id: name for name, fig in plots.figures.items()}
    recorded.clear()
    for r in range(2):
        store.add(r, step_metrics(r, 2))
    assert plots.refresh()
    updates = [names[cid] for cid, data in recorded if cid in names and data["state"].get("_py2js_update")]
    # Each figure whose data changed sends one update carrying all of its edits (the pipeline panel,
    # pp = 1 here, has nothing new).
    assert sorted(updates) == ["loss", "memory", "overlap", "sync_bytes", "throughput", "timeline"]
    recorded.clear()
    assert not plots.refresh() and recorded == []


def test_the_whole_figure_is_also_kept_as_widget_state():
    """Views rendered after updates were sent (a slow front end, a page reload) start from the full figure."""
    store = _fed(2)
    plots = LivePlots(store, 2, resync_s=0)
    for r in range(2):
        store.add(r, step_metrics(r, 2))
    plots.refresh()
    fig = plots.figures["loss"]
    assert fig._widget_data[0]["x"] == [0, 1, 2] and fig._widget_layout["title"]["text"] == "Loss per step"


def test_ticker_redraws_on_news_at_a_bounded_rate():
    calls = []
    ticker = Ticker(lambda: calls.append(time.monotonic()), min_interval_s=0.1, idle_s=10)
    try:
        for _ in range(50):
            ticker.wake.set()
            time.sleep(0.005)
        time.sleep(0.3)
    finally:
        ticker.stop()
    assert 1 <= len(calls) <= 6
    assert all(b - a >= 0.09 for a, b in zip(calls, calls[1:]))


def test_ticker_stops_when_its_owner_is_gone():
    class Owner:
        def tick(self) -> None:
            pass

    owner = Owner()
    ticker = Ticker(owner.tick, min_interval_s=0.01, idle_s=0.05)
    del owner
    deadline = time.monotonic() + 5
    while ticker.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ticker.alive


def test_static_figures_draw_the_same_as_the_live_ones():
    store = _fed(3)
    live = LivePlots(store, 2).figures
    static = static_figures(store.snapshot(), 2)
    assert set(static) == set(live)
    for name in static:
        drawn = [{k: v for k, v in trace.items() if k != "uid"} for trace in live[name].to_dict()["data"]]
        assert static[name].to_dict()["data"] == drawn, name


def test_plots_read_a_store_written_from_another_thread():
    store = TelemetryStore()
    plots = LivePlots(store, 2)

    def feed() -> None:
        for step in range(200):
            for r in range(2):
                store.add(r, step_metrics(r, step, telemetry=False))

    writer = threading.Thread(target=feed)
    writer.start()
    while writer.is_alive():
        plots.refresh()
    writer.join()
    plots.refresh()
    assert len(plots.figures["loss"].data[0].x) == 200


def test_sync_bytes_panel_draws_the_measured_bytes_with_layout_changes():
    import dataclasses

    store = TelemetryStore()
    store.add_layout_change(0, wb.Config(dp=2))
    for step in range(6):
        if step == 3:
            store.add_layout_change(3, wb.Config(dp=2, compression="int8"))
        for r in range(2):
            sent = 4000 if step < 3 else 1000 + r
            store.add(r, dataclasses.replace(step_metrics(r, step), grad_sync_bytes=sent))
    fig = LivePlots(store, 2).figures["sync_bytes"]
    assert list(fig.data[0].y) == [4000] * 3 + [1000] * 3 and list(fig.data[1].y) == [4000] * 3 + [1001] * 3
    assert [s.x0 for s in fig.layout.shapes] == [-0.5, 2.5]
    assert _notes(fig) == ["dp2", "dp2·int8-sync"]


def test_sync_bytes_panel_says_when_nothing_was_measured():
    fig = LivePlots(_fed(3), 2).figures["sync_bytes"]
    assert any("no data-parallel gradient sync" in n for n in _notes(fig))
