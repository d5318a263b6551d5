"""The activation meter watches some steps only: which ones (pure), and that a run reports on every step what the
meter measured, with the step it measured it at, measuring again when the batch's shape changes."""

from __future__ import annotations

import pytest

from tests.telemetry import probe_rank_fns as fns
from workbench.config import Config, ModelConfig
from workbench.telemetry.activations import MeterSampling

SHAPE, OTHER = ((4, 64), "int64"), ((4, 32), "int64")


def _run(sampling: MeterSampling, figures: list[int], shapes: list[tuple] | None = None) -> list[int]:
    """The steps `sampling` watches when step i's meter would read figures[i] (peak; live 0)."""
    watched = []
    for step, peak in enumerate(figures):
        if sampling.watch(shapes[step] if shapes else SHAPE):
            watched.append(step)
            sampling.measured(step, peak, 0)
    return watched


def test_a_layout_is_watched_until_two_steps_agree_then_one_step_in_every():
    assert _run(MeterSampling(every=4), [5, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]) == [0, 1, 2, 6, 10]


def test_a_remeasure_that_disagrees_watches_every_step_until_two_agree_again():
    figures = [7, 7, 7, 7, 9, 9, 9, 9, 9, 9]
    assert _run(MeterSampling(every=3), figures) == [0, 1, 4, 5, 8]


def test_a_new_batch_shape_is_watched_at_once():
    shapes = [SHAPE] * 5 + [OTHER] * 5
    assert _run(MeterSampling(every=10), [7] * 5 + [4] * 5, shapes) == [0, 1, 5, 6]


def test_every_step_watches_every_step_and_every_one_is_the_default_figure():
    sampling = MeterSampling(every=10, every_step=True)
    assert _run(sampling, [7] * 6) == list(range(6))
    assert sampling.latest.step == 5 and sampling.latest.peak == 7
    assert _run(MeterSampling(every=1), [7] * 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="every"):
        MeterSampling(every=0)


DENSE = Config(dp=2, model=ModelConfig.preset("tiny"), batch_size=4, seq_len=32)


def test_every_step_reports_the_figure_the_meter_measured_and_when(pool):
    # every=3 and the batch halved from step 5: watched 0, 1 (agrees: settled), 4, then 5 (new shape) and 6.
    for rows in pool.run(fns.train_sampled, DENSE, 8, 3, 5):
        watched = [r["step"] for r in rows if r["packs"]]
        assert watched == [0, 1, 4, 5, 6], rows
        for r in rows:
            # A step reports its own figure when watched, else the last watched step's, and says which.
            assert r["measured_at"] == max(s for s in watched if s <= r["step"]), r
            assert r["live"] == 0, "nothing saved for backward outlives a step"
        full, half = rows[0]["peak"], rows[5]["peak"]
        # The meter measured something on every watched step, the same at the same shape (a dense layout).
        assert full > 0 and [r["peak"] for r in rows[:5]] == [full] * 5
        # Half the positions save about half the bytes (attention's scores a quarter): measured, not carried over.
        assert 0.3 * full < half < 0.6 * full and [r["peak"] for r in rows[5:]] == [half] * 3


def test_a_mixture_of_experts_is_measured_every_step(pool):
    cfg = DENSE.replace(model=ModelConfig.preset("tiny-moe"))
    for rows in pool.run(fns.train_sampled, cfg, 3, 3):
        assert [(r["measured_at"], r["packs"] > 0) for r in rows] == [(0, True), (1, True), (2, True)]


def _sampled_steps(measured_at: int, last: int) -> list:
    """Two ranks' steps 0..last, whose activation figures were measured at step `measured_at` or later."""
    import dataclasses

    from tests.ui.fakes import step_metrics

    return [dataclasses.replace(step_metrics(r, s), activations_step=min(s, measured_at))
            for s in range(last + 1) for r in range(2)]


def test_the_comparison_says_when_an_older_activation_figure_was_measured():
    from workbench.estimate import estimate
    from workbench.compare import compare

    est = estimate(Config(dp=2), "cpu")
    rows = {r.quantity: r for r in compare(est, _sampled_steps(measured_at=1, last=4))}
    assert rows["memory: activations"].measured_step == 1
    assert rows["memory: parameters"].measured_step is None  # read at the step's end, every step
    fresh = {r.quantity: r for r in compare(est, _sampled_steps(measured_at=4, last=4))}
    assert fresh["memory: activations"].measured_step is None


def test_the_memory_plot_says_when_an_older_activation_figure_was_measured():
    import workbench as wb
    from workbench.telemetry.store import TelemetryStore
    from workbench.ui.live import LivePlots

    store = TelemetryStore()
    store.add_layout_change(0, wb.Config(dp=2))
    for m in _sampled_steps(measured_at=1, last=3):
        store.add(m.rank, m)
    title = LivePlots(store, 2).figures["memory"].layout.title.text
    assert "step 3" in title and "activations measured at step 1" in title
    store.add(0, _sampled_steps(measured_at=4, last=4)[-2])
    store.add(1, _sampled_steps(measured_at=4, last=4)[-1])
    assert "activations measured" not in LivePlots(store, 2).figures["memory"].layout.title.text
