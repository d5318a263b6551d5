"""A collective's span is stored before anyone can learn that it is done, however late its completion callback runs.

The cause of a failure a busy machine showed (issue 31: `emulation.arrivals.match` found none of a step's 4
collectives, the two ranks' records of one step disagreeing): gloo's Work, and the emulation's paced Work, wake a
thread waiting on them before their future runs its callbacks, the one that stores the span among them. A step's
last collective (the vote) waited on that way could end the step, be drained, and only then be stored: the next
step's start discarded it on one rank, not on the other. The recorded Work now waits for the future that completes
after the span is stored. The completion callbacks here are made late on purpose (`delay_cpu_stamps`, 40 ms: far
longer than a step's end takes), so the test fails every time without that wait, on a quiet machine as on a busy one.
"""

from __future__ import annotations

import pytest

import workbench as wb
from tests.telemetry import completion_rank_fns as fns
from workbench.emulation import rank as emulation
from workbench.emulation.arrivals import match

pytestmark = pytest.mark.mostly_waits  # make test runs it beside the tests that compute (tests/run_suite.py)

LATE_MS = 40.0


@pytest.fixture(params=["gloo", "emulated"])
def links(pool, tmp_path, request):
    """gloo's own Works (their future runs its callbacks before waking a waiter), or the emulation's paced Works
    (whose future, completed on the pacer's thread, wakes the waiter first)."""
    if request.param == "emulated":
        pool.run(emulation.install, wb.Cluster("h100-25gbe", nodes=2, dilation=1000.0), str(tmp_path))
    yield request.param
    if request.param == "emulated":
        pool.run(emulation.uninstall)


def test_every_way_of_learning_a_collective_is_done_finds_its_span_stored(pool, links):
    before = pool.run(fns.paced_past_completion)
    for found in pool.run(fns.collectives_found_done, LATE_MS):
        assert found == {"wait inside the call": 1, "wait": 1, "is_completed": 1, "future": 1}
    paced = [after - b for after, b in zip(pool.run(fns.paced_past_completion), before)]
    # The barrier and the four, each completed by the pacer's thread past its real end.
    assert paced == ([0, 0] if links == "gloo" else [5, 5])


SMALL = wb.Config(batch_size=4, seq_len=32, dp=2, model=wb.ModelConfig(dim=32, n_layers=2, n_heads=2))


def _steps(pool, cluster, late_ms: float, steps: int) -> list[list[wb.StepMetrics]]:
    bench = wb.Workbench(pool=pool, cluster=cluster)
    try:
        bench.apply(SMALL, fresh=True)
        pool.run(fns.delay_stamps, late_ms)
        try:
            bench.train(steps).wait()
        finally:
            pool.run(fns.delay_stamps, 0.0)
        return [bench.store.steps(r) for r in range(2)]
    finally:
        bench.close()


def _comm(m: wb.StepMetrics) -> list[str]:
    return [iv.name for iv in m.intervals if iv.kind == "comm"]


def test_a_step_holds_every_collective_on_every_rank_when_completions_run_late_under_emulation(pool):
    cluster = wb.Cluster("a100-ib", nodes=2, dilation=200.0)  # paced: the pacer's thread completes the futures
    on_time = _steps(pool, cluster, 0.0, 1)
    late = _steps(pool, cluster, LATE_MS, 3)
    # DDP's gradient bucket and the step's vote; the second step also broadcasts DDP's rebuilt bucket order.
    assert [_comm(m) for h in on_time for m in h] == [["all_reduce", "all_reduce"]] * 2
    for k in range(3):
        steps = [h[k] for h in late]
        expected = ["broadcast", "broadcast"] * (k == 1) + ["all_reduce", "all_reduce"]
        assert [_comm(m) for m in steps] == [expected, expected], f"step {k}"
        assert len(match([m.intervals for m in steps])) == len(expected), f"step {k}"
