"""The dashboard as one widget: buttons drive the Workbench, the plots follow what the ranks report."""

from __future__ import annotations

import statistics

import time

import pytest

import workbench as wb
from tests.ui.fakes import fake_workbench
from workbench.ui.dashboard import Dashboard, dashboard


def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture
def bench():
    return fake_workbench(world_size=2, step_s=0.01)


def test_apply_and_train_fill_the_plots(bench):
    d = dashboard(bench)
    try:
        assert isinstance(d, Dashboard) and d.children[1] is d.controls.widget and d.children[3] is d.plots.widget
        d.controls.apply_button.click()
        d.controls.wait(5)
        d.controls.steps.value = 20
        d.controls.train_button.click()
        d.controls.wait(10)
        loss = d.plots.figures["loss"]
        _until(lambda: loss.data[0].x is not None and len(loss.data[0].x) == 20)
        assert [a.text for a in loss.layout.annotations] == ["dp2"]
        _until(lambda: len(d.plots.figures["memory"].data[0].y) == 6)  # end of step, peak, predicted: per rank
        _until(lambda: "20 steps trained" in d.controls.status.value)
    finally:
        d.close()


def test_a_layout_applied_from_a_cell_is_marked_too(bench):
    d = dashboard(bench)
    try:
        bench.apply(wb.Config(dp=2))
        bench.train(3).wait()
        bench.apply(wb.Config(tp=2))
        bench.train(3).wait()
        loss = d.plots.figures["loss"]
        _until(lambda: [a.text for a in loss.layout.annotations] == ["dp2", "tp2"])
        assert [s.x0 for s in loss.layout.shapes] == [-0.5, 2.5]
    finally:
        d.close()


def test_a_new_dashboard_takes_over_the_live_updates(bench):
    first = dashboard(bench)
    second = dashboard(bench)
    try:
        _until(lambda: not first.ticker.alive, timeout=5)
        assert second.ticker.alive and second.store is first.store
    finally:
        second.close()


def test_a_fresh_model_starts_the_plots_afresh(bench):
    d = dashboard(bench)
    try:
        bench.apply(wb.Config(dp=2))
        bench.train(5).wait()
        bench.apply(wb.Config(dp=2, model=wb.ModelConfig.preset("small")))  # a new shape: a new model at step 0
        bench.train(2).wait()
        loss = d.plots.figures["loss"]
        _until(lambda: loss.data[0].x is not None and list(loss.data[0].x) == [0, 1])
        assert [a.text for a in loss.layout.annotations] == ["dp2"] and len(loss.layout.shapes) == 1
    finally:
        d.close()


def test_the_workbench_store_holds_every_rank_and_the_layout_changes(pool):
    bench = wb.Workbench(pool=pool)
    try:
        bench.apply(wb.Config(dp=2), fresh=True)
        bench.train(4).wait()
        assert [m.step for m in bench.store.steps(0)] == [0, 1, 2, 3] == [m.step for m in bench.store.steps(1)]
        assert [c.step for c in bench.store.layout_changes] == [0]
    finally:
        bench.close()


def test_with_real_ranks(pool):
    """Two CPU ranks: Apply and Train from the buttons, and the loss plot gains the steps they trained."""
    bench = wb.Workbench(pool=pool)
    d = dashboard(bench)
    try:
        d.controls.apply_button.click()
        d.controls.wait(120)
        assert d.controls.error is None and "applied dp2" in d.controls.status.value, d.controls.message.value
        d.controls.steps.value = 3
        d.controls.train_button.click()
        d.controls.wait(120)
        loss = d.plots.figures["loss"]
        _until(lambda: loss.data[0].x is not None and len(loss.data[0].x) >= 3)
        assert list(loss.data[0].y) == pytest.approx([m.loss for m in bench.history[-3:]])
    finally:
        d.close()


def test_the_estimate_stands_beside_the_measurement_and_follows_the_layout(bench):
    """Predicted beside measured, live: after a step the dashboard shows the last layout's estimate next to what
    its ranks measured, each row with its error; another layout redraws it for that layout."""
    from workbench.estimate import estimate
    from workbench.hardware import cpu_with_peak, profile_for

    d = dashboard(bench)
    try:
        assert "after its first step" in d.predicted.value or d.predicted.value == ""
        bench.apply(wb.Config(dp=2, zero=1))
        bench.train(3).wait()
        _until(lambda: "Predicted beside measured (dp2·zero1, cpu)" in d.predicted.value)
        for row in ("memory: activations", "step time: compute", "step time: exposed communication",
                    "bytes: all_reduce"):
            assert row in d.predicted.value, row
        assert "%" in d.predicted.value  # the errors
        bench.apply(wb.Config(dp=2, zero=3))
        bench.train(2).wait()
        _until(lambda: "(dp2·zero3, cpu)" in d.predicted.value)
        assert "bytes: all_gather" in d.predicted.value
        # On CPU the table says what its step time assumes (40% of the ranks' measured peak) and how they ran.
        since = bench.store.snapshot().layout_changes[-1].step
        mfu = statistics.median(m.mfu for r in range(2) for m in bench.store.steps(r) if m.step >= since and m.mfu)
        _until(lambda: f"ran at {mfu:.0%} of it" in d.predicted.value)
        assert "compute at 40% of the matmul peak the ranks measured" in d.predicted.value
        # The memory plot's hatched bars are this layout's estimate, rank by rank (each rank's stage's figures).
        memory = d.plots.figures["memory"]
        _until(lambda: list(memory.data[0].x[1]).count("predicted") == 2)
        stage = estimate(wb.Config(dp=2, zero=3), cpu_with_peak("fp32", 1.0)).stages[0].memory
        by_cat = {t.name: [y for y, label in zip(t.y, t.x[1]) if label == "predicted"] for t in memory.data}
        for category in ("parameters", "optimizer", "gradients", "activations"):
            assert by_cat[category] == [getattr(stage, category)] * 2, category
    finally:
        d.close()
    assert profile_for("cuda:0", "NVIDIA H100 80GB HBM3") == "h100" and profile_for("cuda:0", "Tesla T4") is None
