"""Which recorded collectives count as the gradient sync, and their bytes on the wire (pure, no processes)."""

from workbench.telemetry.events import Interval
from workbench.telemetry.grad_sync import grad_sync_bytes, grad_sync_payload_bytes


def comm(name, nbytes, start, group="mesh_dp", size=2):
    return Interval("comm", name, start, start + 10, bytes=nbytes, group_size=size, group=group)


def test_ddp_sync_is_every_dp_collective_before_the_vote_but_broadcasts():
    ivs = [Interval("compute", "backward", 0, 50), comm("all_to_all", 1000, 5), comm("all_gather", 1000, 20),
           comm("all_reduce", 4000, 30), comm("all_reduce", 800, 40, group="mesh_tp"),
           comm("all_reduce", 24, 60), comm("broadcast", 5000, 70)]
    # all_to_all and all_gather: (n-1)/n = 1/2 of their size; all_reduce 2(n-1)/n = 1.
    assert grad_sync_bytes(ivs, "mesh_dp", zero=0, before_ns=55) == 500 + 500 + 4000
    assert grad_sync_payload_bytes(ivs, "mesh_dp", zero=1, before_ns=55) == 6000
    assert grad_sync_bytes(ivs, "mesh_dp", zero=0) == 5000 + 24  # without the vote's time the vote counts too


def test_fsdp_sync_is_its_reduce_scatters_only():
    ivs = [comm("all_gather", 8000, 0), comm("reduce_scatter", 8000, 10, size=4), comm("all_reduce", 24, 60)]
    assert grad_sync_bytes(ivs, "mesh_dp", zero=3, before_ns=55) == 6000
