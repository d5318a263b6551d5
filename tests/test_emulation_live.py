"""Real collectives at an emulated cluster's cost, on the shared 2-rank pool: every kind takes what the link model
says (times the dilation), training gives bit-identical losses with and without it, and the dilation measured
from the steps is this rank's compute over the target's. Bounds are loose (this machine is shared) but fail if
the emulation is absent (loopback is 10-100× faster than the times chosen here) or off by 2×."""

from __future__ import annotations

import pytest

import workbench as wb
from tests.telemetry import overlap_reference as reference
from tests.emulation_rank_fns import KINDS, emulation_status, time_kinds
from workbench import links
from workbench.emulation import rank as emulation

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
    measured = emulated.run(time_kinds, KINDS, (NBYTES,))
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


def test_the_measured_dilation_is_this_ranks_compute_over_the_targets(pool):
    # An A100's fp32 peak keeps the dilation (and the paced steps) shortest.
    cluster = wb.Cluster("a100-ib", nodes=2)
    steps, line = _train(pool, cluster, 3)
    gpu_time = steps[-1].flops / (wb.hardware.A100.peak("fp32") * cluster.efficiency)
    ratios = []
    for m in steps:
        compute = [(iv.start_ns, iv.end_ns) for iv in m.intervals if iv.kind == "compute"]
        waits = [(iv.start_ns, iv.end_ns) for iv in m.intervals if iv.kind == "wait"]
        busy = reference.union_length(compute) - reference.union_length(reference.intersection(compute, waits))
        ratios.append(busy * 1e-9 / gpu_time)
    shown = float(line.split("time dilated ×")[1].split()[0])
    assert shown == pytest.approx(min(ratios), rel=0.02)  # the lowest of the three
    # Steps 0 and 1 ran unpaced (the dilation was being measured); step 2 was paced at what they measured.
    sync0, sync2 = ([iv for iv in m.intervals if iv.kind == "comm" and iv.group_size == 2] for m in (steps[0], steps[2]))
    assert sum(iv.duration_s for iv in sync2) > 5 * sum(iv.duration_s for iv in sync0)
