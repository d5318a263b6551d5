"""Predicted beside measured (`workbench.estimate.compare`) against real runs: 2 CPU ranks, tiny model, 2 steps."""

from __future__ import annotations

import pytest

import workbench as wb
from workbench.estimate import estimate
from workbench.estimate.compare import Comparison, compare


def measured_steps(cfg: wb.Config, steps: int = 2) -> list[wb.StepMetrics]:
    """On a rank: the StepMetrics of `steps` steps with telemetry on, as the Workbench records them."""
    from workbench.engine.data import TokenData
    from workbench.engine.mesh import build_mesh
    from workbench.engine.trainer import Trainer
    from workbench.pool import rank

    with rank.unchecked():
        trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", TokenData.for_config(cfg), telemetry=True)
        return [trainer.step(i) for i in range(steps)]


def test_comparison_of_a_real_run(pool):
    cfg = wb.Config(dp=2, zero=3, batch_size=8, seq_len=64)
    metrics = [m for per_rank in pool.run(measured_steps, cfg) for m in per_rank]
    rows = {r.quantity: r for r in compare(estimate(cfg, "cpu"), metrics)}
    # Every row a quantity both sides have; model states exact, activations within the estimator's 1%.
    for category in ("parameters", "optimizer"):
        assert rows[f"memory: {category}"].error == 0, category
    assert abs(rows["memory: activations"].error) < 0.01
    # Bytes per collective kind: exact where the estimate predicts them (each rank's payload, nccl-tests' size).
    predicted = {kind for kind, row in rows.items() if kind.startswith("bytes: ") and row.predicted}
    assert predicted and all(rows[k].error == 0 for k in predicted if k != "bytes: all_reduce")
    # The trainer's one world all-reduce per step is measured, not estimated: a row with no prediction.
    assert rows["bytes: all_reduce"].measured > 0
    step = rows["step time"]
    assert step.measured > 0 and step.predicted > 0 and step.error is not None
    assert rows["step time: compute"].measured <= step.measured


def test_comparison_rows_say_their_error():
    row = Comparison("memory: activations", "B", 110.0, 100.0)
    assert row.error == pytest.approx(0.1) and row.error_pct == pytest.approx(10.0)
    assert Comparison("bytes: send", "B", 0, 5).error is None
    with pytest.raises(ValueError, match="at least one step"):
        compare(estimate(wb.Config(), "cpu"), [])


def test_the_report_carries_the_comparison(tmp_path):
    from tests.ui.fakes import fake_workbench

    bench = fake_workbench(step_s=0.0)
    bench.apply(wb.Config(dp=2, zero=1))
    bench.train(3).wait()
    text = bench.report(tmp_path / "run.html").read_text()
    for needle in ("Predicted beside measured (dp2·zero1, cpu)", "memory: activations", "step time: compute",
                   "bytes: all_reduce"):
        assert needle in text, needle
