"""Real collectives at an emulated cluster's cost, on the shared 2-rank pool: every kind takes what the link model
says (times the dilation), training gives bit-identical losses with and without it, and the dilation measured
from the steps is this rank's compute over the target's. Bounds are loose (this machine is shared) but fail if
the emulation is absent (loopback is 10-100× faster than the times chosen here) or off by 2×."""

from __future__ import annotations

import statistics

import pytest

import workbench as wb
from tests.telemetry import overlap_reference as reference
from tests.emulation_rank_fns import KINDS, emulation_status, time_kinds
from workbench import links
from workbench.emulation import rank as emulation
from workbench.emulation.predict import target_compute_s

pytestmark = pytest.mark.mostly_waits  # make test runs it beside the tests that compute (tests/run_suite.py)

# 2 emulated nodes of one H100 over 25 GbE: a 1 MiB all-reduce takes 0.4 ms there; ×300 it takes 0.12 s here,
# ~50× what loopback takes for it.
CLUSTER = wb.Cluster("h100-25gbe", nodes=2, dilation=300.0)
NBYTES = 2**20


@pytest.fixture(params=["shared", "estimated"])
def emulated(pool, tmp_path, request):
    """The pool emulating CLUSTER, its peers' arrivals read from shared memory (one host) or estimated from this
    machine's measured transport (what ranks on several hosts do)."""
    if request.param == "shared":
        pool.run(emulation.install, CLUSTER, str(tmp_path))
    else:
        pool.run(emulation.install, CLUSTER)
        pool.run(emulation.calibrate)
    assert pool.run(emulation_status)[0]["arrivals"] == request.param
    yield pool
    pool.run(emulation.uninstall)


def test_every_kind_takes_the_link_models_time(emulated):
    topology = CLUSTER.for_world(2).topology
    # The best of three: the pacer holds no collective below the model (the lower bound cannot fail for load); a
    # busy machine can only add to a time, so the quickest of a few is the model's, plus what loopback takes.
    measured = emulated.run(time_kinds, KINDS, (NBYTES,), 3)
    for kind in KINDS:
        expected = CLUSTER.dilation * links.collective_time(kind, NBYTES, (0, 1), topology)
        for r, times in enumerate(measured):
            ratio = times[kind, NBYTES] / expected
            assert 0.7 < ratio < 1.6, f"{kind} on rank {r}: {times[kind, NBYTES]:.4f} s, model {expected:.4f} s"
    status = emulated.run(emulation_status)[0]
    assert status["dilation"] == CLUSTER.dilation and status["paced"] >= len(KINDS)
    assert status["line"].startswith("EMULATED cluster h100-25gbe: 2 nodes × 1 h100")


def test_off_again_collectives_run_at_loopback_speed(pool, tmp_path):
    pool.run(emulation.install, CLUSTER, str(tmp_path))
    pool.run(emulation.uninstall)
    times = pool.run(time_kinds, ("all_reduce",), (NBYTES,))[0]
    assert times["all_reduce", NBYTES] < 0.3 * CLUSTER.dilation * links.collective_time(
        "all_reduce", NBYTES, (0, 1), CLUSTER.for_world(2).topology)
    assert pool.run(emulation_status)[0]["line"].startswith("links: this machine's own")


SMALL = wb.Config(batch_size=4, seq_len=32, dp=2, model=wb.ModelConfig(dim=32, n_layers=2, n_heads=2))
# The layout the dilation is measured on: on the a100 in fp32 it comes out near 100 on this machine (a CPU core
# computes this step ~100× slower than the estimator's kernel model of the GPU).
NB = wb.Config(batch_size=8, seq_len=64, dp=2, model=wb.ModelConfig(dim=64, n_layers=2, n_heads=2))


def _train(pool, cluster, steps):
    bench = wb.Workbench(pool=pool, cluster=cluster)
    try:
        bench.apply(SMALL, fresh=True)
        return bench.train(steps).wait(), bench.links
    finally:
        bench.close()


def test_training_under_emulation_is_bit_identical_and_its_gradient_sync_is_paced(pool):
    fixed = wb.Cluster("h100-ib", nodes=2, dilation=1000.0)
    plain, plain_links = _train(pool, None, 3)
    paced, paced_links = _train(pool, fixed, 3)
    assert [m.loss for m in paced] == [m.loss for m in plain]  # the data moved for real, in the same order
    assert plain_links.startswith("links: this machine's own") and paced_links.startswith("EMULATED")
    topology = fixed.for_world(2).topology
    # Each all-reduce (gradient buckets, the step's vote) takes no less than the model; a span also holds the wait
    # for a late peer, so only the quickest of them is held to the model from above.
    ratios = [iv.duration_s / (fixed.dilation * links.collective_time("all_reduce", iv.bytes, (0, 1), topology))
              for m in paced for iv in m.intervals if iv.kind == "comm" and iv.name == "all_reduce"]
    assert len(ratios) >= 6 and min(ratios) > 0.8 and min(ratios) < 1.6, ratios


def _ratio(m: wb.StepMetrics, gpu_time: float) -> float:
    """This step's compute (spans less waits, by the reference sweep) over the GPU's time for its FLOPs."""
    compute = [(iv.start_ns, iv.end_ns) for iv in m.intervals if iv.kind == "compute"]
    waits = [(iv.start_ns, iv.end_ns) for iv in m.intervals if iv.kind == "wait"]
    busy = reference.covered_ns(compute) - reference.covered_ns(reference.intersection(compute, waits))
    return busy * 1e-9 / gpu_time


def _histories(pool, cluster: wb.Cluster, steps: int) -> tuple[list, str]:
    bench = wb.Workbench(pool=pool, cluster=cluster)
    try:
        bench.apply(NB, fresh=True)
        bench.train(steps).wait()
        return [bench.store.steps(r) for r in range(2)], bench.links
    finally:
        bench.close()


def test_the_measured_dilation_is_the_ranks_compute_over_the_targets(pool):
    """dp=2 on two emulated A100 nodes (fp32: the dilation, and the paced steps, stay shortest): the ranks pace
    with one dilation, the largest of their own (each its lowest compute ratio of the latest three steps), from
    step 2 on."""
    cluster = wb.Cluster("a100-ib", nodes=2)
    histories, line = _histories(pool, cluster, 3)
    gpu_time = target_compute_s(NB, cluster, 0)  # dp=2: both ranks hold the one stage
    shown = float(line.split("time dilated ×")[1].split()[0])
    # Steps 0 and 1 measured it (unpaced); each rank's lowest ratio of the two, the larger of the ranks, paced step 2.
    agreed = max(min(_ratio(m, gpu_time) for m in h[:2]) for h in histories)
    assert [h[2].dilation for h in histories] == [pytest.approx(agreed, rel=0.02)] * 2
    assert [m.dilation for h in histories for m in h[:2]] == [None] * 4
    assert shown == pytest.approx(histories[0][-1].dilation, rel=5e-3)  # the line shows 3 figures
    # Steps 0 and 1 ran unpaced (the dilation was being measured); step 2 was paced at it: no collective of it
    # ended before the link model's time × the dilation the ranks agreed on.
    topology = cluster.for_world(2).topology
    for m in (h[2] for h in histories):
        for iv in (iv for iv in m.intervals if iv.kind == "comm"):
            assert iv.duration_s > 0.9 * shown * links.collective_time(iv.name, iv.bytes, (0, 1), topology), iv


@pytest.mark.smoke
def test_the_undilated_exposed_communication_is_what_the_estimate_priced_by_the_link_model_says(pool):
    """The paced steps' exposed communication, undilated, against the estimator's accounting (which collectives,
    what hides them) priced by the link model; a fixed dilation, so that the comparison does not ride on how
    steady this shared machine's compute is from one step to the next (benches/emulation_estimate.py prints it
    for every layout). The prediction's ranks arrive together: its figure is the transfer after each collective's
    last arrival (workbench.emulation.arrivals), the wait for a late peer apart."""
    from workbench.emulation.arrivals import match, split_exposed
    from workbench.emulation.predict import predicted, undilated

    cluster = wb.Cluster("a100-ib", nodes=2, dilation=2000.0)
    histories, _ = _histories(pool, cluster, 3)
    paced = undilated(histories)
    measured = statistics.median(max(r[k].exposed_s for r in paced) for k in range(len(paced[0])))
    transfers = []
    for k in range(len(histories[0])):
        steps = [h[k] for h in histories]
        arrivals = match([m.intervals for m in steps])
        assert len(arrivals) == sum(iv.kind == "comm" for iv in steps[0].intervals)  # every collective matched
        split = [split_exposed(m.intervals, arrivals, r) for r, m in enumerate(steps)]
        for s, m in zip(split, steps):  # the two parts are the whole, as the native sweep measured it
            assert s.waiting_s + s.transfer_s == pytest.approx(m.exposed_comm_s, abs=1e-6)
        transfers.append(max(s.transfer_s for s in split) / cluster.dilation)
    expected = predicted(NB, cluster.for_world(2).topology).exposed_s
    assert 0.5 < statistics.median(transfers) / expected < 2.0, (transfers, expected)
    assert measured >= 0.5 * expected, (measured, expected)
