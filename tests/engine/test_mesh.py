"""Degrees → mesh arithmetic (pure), the built DeviceMesh agreeing with it, and the layout refusals."""

from __future__ import annotations

import pytest

from workbench.config import Config, ConfigError, checkpointed_blocks
from workbench.engine.mesh import AXES, MeshLayout, mesh_layout

from tests.engine import rank_fns as fns


def test_axes_are_pp_dp_tp_with_tp_innermost():
    layout = mesh_layout(Config(dp=2, tp=2, pp=2, micro_batches=2))
    assert layout.axes == AXES == ("pp", "dp", "tp")
    assert layout.shape == (2, 2, 2) and layout.world_size == 8
    assert mesh_layout(Config()).shape == (1, 1, 1)


def test_tp_groups_are_neighbouring_ranks():
    layout = MeshLayout(shape=(2, 2, 2))
    assert layout.group(0, "tp") == [0, 1]
    assert layout.group(5, "tp") == [4, 5]
    assert layout.group(1, "dp") == [1, 3]
    assert layout.group(6, "pp") == [2, 6]


def test_coordinates_are_row_major_and_invertible():
    layout = MeshLayout(shape=(2, 3, 2))
    assert layout.coordinate(0) == {"pp": 0, "dp": 0, "tp": 0}
    assert layout.coordinate(1) == {"pp": 0, "dp": 0, "tp": 1}
    assert layout.coordinate(2) == {"pp": 0, "dp": 1, "tp": 0}
    assert layout.coordinate(6) == {"pp": 1, "dp": 0, "tp": 0}
    assert [layout.rank_of(layout.coordinate(r)) for r in range(12)] == list(range(12))
    with pytest.raises(ValueError):
        layout.coordinate(12)


@pytest.mark.parametrize("degrees", [dict(dp=2), dict(tp=2)])
def test_built_mesh_matches_the_arithmetic(pool, degrees):
    cfg = Config(batch_size=4, seq_len=16, **degrees)
    layout = mesh_layout(cfg)
    results = pool.run(fns.train, cfg, 1)
    for rank, result in enumerate(results):
        for axis, (local_rank, group) in result["mesh"].items():
            assert local_rank == layout.coordinate(rank)[axis]
            assert sorted(_flatten(group)) == layout.group(rank, axis)


def test_selective_recompute_takes_every_other_block_by_global_index():
    assert checkpointed_blocks([0, 1, 2, 3], "none") == []
    assert checkpointed_blocks([0, 1, 2, 3], "full") == [0, 1, 2, 3]
    assert checkpointed_blocks([0, 1, 2, 3], "selective") == [0, 2]
    assert checkpointed_blocks([2, 3], "selective") == [2]  # a pipeline stage's blocks keep their pattern


# --- refusals this engine adds to Config ---------------------------------------------------

def test_zero1_with_tensor_parallel_is_refused_naming_field_and_fix():
    with pytest.raises(ConfigError) as info:
        Config(dp=2, tp=2, zero=1)
    message = str(info.value)
    assert message.startswith("zero:") and "ZeroRedundancyOptimizer" in message and "Fix: use zero=2" in message


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_other_zero_stages_compose_with_tensor_parallel(zero):
    # The refusal above is narrow: every other stage is accepted with tp, and laid out on a (dp, tp) mesh.
    cfg = Config(dp=2, tp=2, zero=zero)
    assert (cfg.zero, cfg.world_size, mesh_layout(cfg).shape) == (zero, 4, (1, 2, 2))
    assert mesh_layout(Config(tp=2, dp=1)).shape == (1, 1, 2)


def _flatten(group):
    return [r for item in group for r in (_flatten(item) if isinstance(item, list) else [item])]
