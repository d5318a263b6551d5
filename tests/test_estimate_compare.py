"""Predicted beside measured (`workbench.compare`) against real runs: 2 CPU ranks, tiny model, 2 steps."""

from __future__ import annotations

import pytest

import workbench as wb
from workbench.estimate import estimate
from workbench.compare import Comparison, compare, predicted_memory


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


def test_a_pipelines_bubble_is_compared_as_waiting_not_as_compute():
    """Pipeline ranks measure the bubble as time waiting on a receive: the compute row is the busiest stage's own
    compute, and the waiting row (exposed communication and bubble) the rest of the predicted step."""
    from tests.ui.fakes import step_metrics

    cfg = wb.Config(pp=2, micro_batches=4)
    est = estimate(cfg, "cpu")
    rows = {r.quantity: r for r in compare(est, [step_metrics(r, 3, layout=cfg.layout) for r in range(2)])}
    compute, waiting = rows["step time: compute"], rows["step time: exposed communication and bubble"]
    assert compute.predicted == max(stage.compute_s for stage in est.stages) < est.compute_s
    assert compute.predicted + waiting.predicted == pytest.approx(rows["step time"].predicted)
    assert waiting.predicted > est.exposed_comm_s  # the bubble is in it


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


def test_each_rank_is_predicted_its_pipeline_stages_memory():
    """Ranks map to stages as the engine's mesh places them (pp outermost): with dp=2 × pp=2, ranks 0 and 1 hold
    stage 0 and ranks 2 and 3 stage 1, whose activations differ (1F1B keeps fewer micro-batches in flight late)."""
    from workbench.engine.mesh import mesh_layout
    from workbench.hardware import cpu_with_peak

    cfg = wb.Config(dp=2, pp=2, micro_batches=4)
    est = estimate(cfg, cpu_with_peak(cfg.precision, 1.0))
    by_rank = predicted_memory(est, cfg)
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert [mesh_layout(cfg).coordinate(r)["pp"] for r in range(4)] == [0, 0, 1, 1]
    for rank, stage in ((0, 0), (1, 0), (2, 1), (3, 1)):
        memory = est.stages[stage].memory
        assert by_rank[rank] == {c: getattr(memory, c) for c in ("parameters", "optimizer", "gradients",
                                                                 "activations")}
    assert by_rank[0]["activations"] > by_rank[2]["activations"]
