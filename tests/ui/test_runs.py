"""Runs as records: every apply starts one, Restart and new models add runs instead of erasing, branches from a
checkpoint never mix, and `bench.runs` / the report summarise each from its own steps."""

from __future__ import annotations

import statistics
import time

import pytest

import workbench as wb
from tests.ui.fakes import fake_workbench, step_metrics
from workbench.telemetry import run_summary
from workbench.telemetry.store import TelemetryStore
from workbench.ui.dashboard import dashboard, run_label
from workbench.ui.live import LivePlots


def _train(store: TelemetryStore, steps: range, ranks: int = 2, **kw) -> None:
    for step in steps:
        for r in range(ranks):
            store.add(r, step_metrics(r, step, **kw))


# -- the store -------------------------------------------------------------------------------------------
def test_a_new_model_starts_a_new_history_and_keeps_the_old_run():
    store = TelemetryStore()
    store.start_run(wb.Config(dp=2), 0, continues=False)
    _train(store, range(3))
    store.start_run(wb.Config(tp=2), 3, continues=True)  # a reshard: the history goes on
    _train(store, range(3, 5), layout="tp2")
    store.start_run(wb.Config(dp=2, seed=1), 0, continues=False, origin="ranks restarted")
    _train(store, range(2))
    snap = store.snapshot()
    assert [(r.id, r.model, r.parent, r.origin) for r in snap.runs] == [
        (1, 1, None, "new model"), (2, 1, 1, "resharded from run 1"), (3, 2, None, "ranks restarted")]
    assert [m.step for m in snap.steps(0)] == [0, 1]  # the current history: the new model's
    assert [m.step for r in snap.runs[:2] for m in r.steps(0)] == [0, 1, 2, 3, 4]  # nothing erased
    assert [(c.step, c.layout) for c in snap.layout_changes] == [(0, "dp2")]


def test_a_run_that_trained_nothing_is_replaced_so_no_two_markers_share_a_step():
    store = TelemetryStore()
    store.start_run(wb.Config(dp=2), 0, continues=False)
    _train(store, range(2))
    store.start_run(wb.Config(tp=2), 2, continues=True)
    store.start_run(wb.Config(dp=2, zero=1), 2, continues=True, name="zero one")
    snap = store.snapshot()
    assert [(r.id, r.name, r.parent) for r in snap.runs] == [(1, "1 · dp2", None), (2, "zero one", 1)]
    assert [c.step for c in snap.layout_changes] == [0, 2]


def test_two_branches_from_one_checkpoint_keep_their_own_steps():
    """Notebook 05's experiment: 4 steps, a checkpoint at 4, then steps 4–6 twice. Each branch's history is the
    4 shared steps and its own 3; neither overwrites the other although their step numbers are the same."""
    store = TelemetryStore()
    store.start_run(wb.Config(dp=2), 0, continues=False)
    _train(store, range(4))
    store.start_run(wb.Config(dp=2), 4, continues=True, origin="loaded ckpt", name="a")
    _train(store, range(4, 7), loss=1.0)
    store.start_run(wb.Config(dp=2, lr=1e-3), 7, continues=True)  # an apply, then the load it is replaced by
    store.start_run(wb.Config(dp=2, lr=1e-3), 4, continues=True, origin="loaded ckpt", name="b")
    _train(store, range(4, 7), loss=2.0)
    snap = store.snapshot()
    a, b = snap.runs[1], snap.runs[2]
    assert (a.name, b.name, b.parent, b.first_step) == ("a", "b", 2, 4)
    assert [m.step for m in snap.steps(0)] == list(range(7))
    assert [m.loss for m in snap.steps(0)][4:] == [2.0] * 3  # branch b's history holds b's steps, not a's
    assert [m.loss for m in a.steps(0)] == [1.0] * 3
    assert [r.id for r in snap.compare([2]).picked] == [2]


def test_memory_stays_bounded_across_runs():
    store = TelemetryStore(max_steps=5)
    store.start_run(wb.Config(dp=2), 0, continues=False)
    _train(store, range(4), ranks=1)
    store.start_run(wb.Config(dp=2, seed=1), 0, continues=False)
    _train(store, range(4), ranks=1)
    runs = store.snapshot().runs
    assert [len(r.steps(0)) for r in runs] == [1, 4]  # the oldest run's oldest steps went first


# -- the summaries -----------------------------------------------------------------------------------------
def test_each_runs_summary_is_its_own_steps():
    store = TelemetryStore()
    store.start_run(wb.Config(dp=2), 0, continues=False)
    for step in range(4):
        for r in range(2):
            m = step_metrics(r, step, skipped=step == 1)
            store.add(r, m.__class__(**{**{f: getattr(m, f) for f in m.__slots__},
                                        "step_time_s": 0.1 * (step + 1), "tokens_per_s": 1000.0 * (step + 1)}))
    run = store.snapshot().runs[0]
    s = run_summary.summarize(run)
    trained = [m for m in run.steps(0) if not m.skipped]  # steps 0, 2, 3
    assert s.steps == 4 and s.tokens_per_s == pytest.approx(statistics.mean(m.tokens_per_s for m in trained))
    assert s.step_time_s == pytest.approx((0.1 + 0.3 + 0.4) / 3)
    assert s.peak_memory["activations"] == 20_000_001  # rank 1's, the larger
    assert s.mfu == pytest.approx(0.05) and s.mfu_basis == "a datasheet peak (fake)" and s.model == "tiny"
    row = s.row()
    assert row["peak activations MiB"] == pytest.approx(20_000_001 / 2**20) and row["step ms"] == pytest.approx(
        800 / 3)


def test_predictions_have_a_place_beside_each_row():
    store = TelemetryStore()
    store.start_run(wb.Config(dp=2), 0, continues=False)
    _train(store, range(2))
    rows = run_summary.table(run_summary.summaries(store.runs, beside=lambda run: {"predicted": run.layout}))
    first = rows.iloc[0] if hasattr(rows, "iloc") else rows[0]
    assert first["predicted"] == "dp2"


def test_the_table_needs_no_pandas(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pandas(name, *args, **kwargs):
        if name == "pandas":
            raise ImportError("no pandas here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pandas)
    store = TelemetryStore()
    store.start_run(wb.Config(dp=2), 0, continues=False)
    _train(store, range(3))
    rows = run_summary.table(run_summary.summaries(store.runs))
    assert isinstance(rows, list) and rows[0]["steps"] == 3 and "1 · dp2" in repr(rows)
    assert "no runs yet" in repr(run_summary.table([]))


# -- through a Workbench ------------------------------------------------------------------------------------
@pytest.fixture
def bench():
    return fake_workbench(world_size=2, step_s=0.0)


def test_restart_and_a_new_model_add_runs_and_bench_runs_lists_them(bench):
    bench.apply(wb.Config(dp=2))
    bench.train(3).wait()
    bench.apply(wb.Config(tp=2))
    bench.train(2).wait()
    bench.restart()
    bench.train(2).wait()
    bench.apply(wb.Config(dp=2, model=wb.ModelConfig.preset("small")), run="small one")
    bench.train(1).wait()
    runs = bench.run_records
    assert [(r.layout, r.origin, len(r.steps(0))) for r in runs] == [
        ("dp2", "new model", 3), ("tp2", "resharded from run 1", 2), ("tp2", "ranks restarted", 2),
        ("dp2", "new model", 1)]
    assert [m.step for m in bench.history] == [0] and runs[-1].name == "small one"
    table = bench.runs
    rows = table.to_dict("records") if hasattr(table, "to_dict") else list(table)
    assert [row["steps"] for row in rows] == [3, 2, 2, 1] and rows[3]["model"] == "small"


def test_the_report_covers_every_run(bench, tmp_path):
    bench.apply(wb.Config(dp=2))
    bench.train(3).wait()
    bench.restart()
    bench.train(2).wait()
    text = bench.report(tmp_path / "r.html").read_text()
    assert text.count("<td>ranks restarted</td>") == 1 and text.count("<td>new model</td>") == 1
    assert "<th>tokens/s</th>" in text and "<th>peak activations MiB</th>" in text


def test_the_plots_overlay_the_runs_picked_in_the_dashboard(bench):
    d = dashboard(bench)
    try:
        bench.apply(wb.Config(dp=2))
        bench.train(4).wait()
        bench.restart()
        bench.train(2).wait()
        d.tick()
        labels = [label for label, _ in d.runs.options]
        assert len(set(labels)) == 2 and labels[0].startswith("2 · dp2 (now)")
        d.runs.value = (1,)  # compare with the first run
        loss = d.plots.figures["loss"]
        assert list(loss.data[0].x) == [0, 1] and list(loss.data[2].x) == [0, 1, 2, 3]
        assert loss.data[2].name == "1 · dp2" and loss.data[2].showlegend
        throughput = d.plots.figures["throughput"]
        assert list(throughput.data[1].y) == [10240.0] * 4
        memory = d.plots.figures["memory"]
        assert "run 1 peak" in list(memory.data[0].x[1])
    finally:
        d.close()


def test_run_labels_are_distinct():
    store = TelemetryStore()
    for seed in range(3):
        store.start_run(wb.Config(dp=2, seed=seed), 0, continues=False, name="same name")
        _train(store, range(2))
    snap = store.snapshot()
    assert len({run_label(r, snap.current) for r in snap.runs}) == 3


def test_a_closed_workbenchs_dashboard_stops_and_says_so(bench):
    d = dashboard(bench)
    bench.close()
    deadline = time.monotonic() + 10
    while d.ticker.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not d.ticker.alive and d.controls.apply_button.disabled and "closed" in d.controls.message.value
    bench.close()  # twice is harmless


def test_panels_the_layout_lacks_collapse_to_one_line():
    store = TelemetryStore()
    store.start_run(wb.Config(tp=2), 0, continues=False)
    _train(store, range(2))
    plots = LivePlots(store, 2)
    assert set(plots.absent) == {"pipeline", "sync_bytes", "expert_load", "routing"}
    assert plots.cells["pipeline"].layout.display == "none" and "tp2 has no pipeline" in plots.absent_lines.value
    store.start_run(wb.Config(pp=2, micro_batches=2), 2, continues=True)
    plots.refresh()
    assert plots.cells["pipeline"].layout.display == "block" and "Pipeline" not in plots.absent_lines.value
