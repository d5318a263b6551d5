"""Process groups cost a rank nothing while idle, and a mesh is built once per shape.

torch gives each gloo group a transport device of its own, with a thread that wakes every 10 ms: the shared
pool of this suite had made 360 groups after twenty minutes, and their loops burned more of the ranks' CPU
than the tests did. The recording backend shares one device per process (`workbench.telemetry.comm`), and
`build_mesh` reuses a shape's mesh (`workbench.engine.mesh`). Counted by thread name in /proc.
"""

from __future__ import annotations

from tests.telemetry import group_rank_fns as fns


def test_new_groups_share_the_ranks_one_transport_loop(pool):
    for result in pool.run(fns.make_groups, 8):
        assert result["after"]["gloo_tcp_loop"] == result["before"]["gloo_tcp_loop"], result
        # What a group still costs: gloo's two worker threads, which sleep until the group has work.
        assert result["after"]["pt_gloo_runloop"] == result["before"]["pt_gloo_runloop"] + 2 * 8, result


def test_a_mesh_of_one_shape_is_built_once(pool):
    for result in pool.run(fns.meshes_built_twice):
        assert result["same"] and result["other"], result
        assert result["after"]["pt_gloo_runloop"] - result["before"]["pt_gloo_runloop"] <= 2 * 2, result
