"""Degrees → mesh: the layout arithmetic (pure), the built DeviceMesh agreeing with it, and the layout refusals."""

from __future__ import annotations

from typing import Any

import pytest

from workbench.config import Config, ConfigError, Degrees, MeshLayout, ModelConfig, checkpointed_blocks
from workbench.engine.mesh import mesh_layout



def test_dims_are_pp_dp_tp_with_tp_innermost():
    layout = mesh_layout(Config(dp=2, tp=2, pp=2, micro_batches=2))
    assert layout.dims == layout.axes == ("pp", "dp", "tp")
    assert layout.shape == (2, 2, 2) and layout.world_size == 8
    assert mesh_layout(Config()).shape == (1, 1, 1)  # size-1 axes kept: mesh["tp"] always exists


def test_tp_groups_are_neighbouring_ranks():
    layout = MeshLayout(dims=("pp", "dp", "tp"), shape=(2, 2, 2))
    assert layout.group(0, "tp") == [0, 1]
    assert layout.group(5, "tp") == [4, 5]
    assert layout.group(1, "dp") == [1, 3]
    assert layout.group(6, "pp") == [2, 6]


def test_coordinates_are_row_major_and_invertible():
    layout = MeshLayout(dims=("pp", "dp", "tp"), shape=(2, 3, 2))
    assert layout.coordinate(0) == {"pp": 0, "dp": 0, "tp": 0}
    assert layout.coordinate(1) == {"pp": 0, "dp": 0, "tp": 1}
    assert layout.coordinate(2) == {"pp": 0, "dp": 1, "tp": 0}
    assert layout.coordinate(6) == {"pp": 1, "dp": 0, "tp": 0}
    assert [layout.rank_of(layout.coordinate(r)) for r in range(12)] == list(range(12))
    with pytest.raises(ValueError):
        layout.coordinate(12)


def test_expert_parallel_splits_the_innermost_dp_ranks():
    layout = Degrees(dp_shard=4, ep=2, tp=2).mesh_layout()
    assert layout.dims == ("pp", "edp", "ep", "tp") and layout.shape == (1, 2, 2, 2)
    assert layout.axes == ("pp", "edp", "ep", "tp", "dp")
    # rank = edp·4 + ep·2 + tp; the dp rank is edp·ep + ep rank, as without experts
    assert layout.group(0, "ep") == [0, 2] and layout.group(0, "edp") == [0, 4]
    assert layout.group(2, "dp") == [0, 2, 4, 6] and layout.coordinate(6)["dp"] == 3
    assert Degrees(dp_replicate=4, ep=4).mesh_layout().shape == (1, 1, 4, 1)  # ZeRO 0/1: ep over replicas


def test_hsdp_names_both_data_parallel_axes_and_dp_as_their_product():
    d = Degrees(dp_replicate=2, dp_shard=4)
    assert (d.dp, d.hsdp, d.world_size) == (8, True, 8)
    layout = d.mesh_layout()
    assert layout.dims == ("pp", "dp_replicate", "dp_shard", "tp") and layout.flattened == (
        ("dp", ("dp_replicate", "dp_shard")),)
    assert layout.group(5, "dp_shard") == [4, 5, 6, 7] and layout.group(5, "dp_replicate") == [1, 5]
    assert layout.size("dp") == 8 and layout.coordinate(5)["dp"] == 5
    # HSDP with experts: ep splits each shard group; "edp" are the replicas of one expert slice.
    ep = Degrees(dp_replicate=2, dp_shard=4, ep=2).mesh_layout()
    assert ep.dims == ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp") and ep.shape == (1, 2, 2, 2, 1)
    assert ep.group(5, "dp_shard") == [4, 5, 6, 7] and ep.group(5, "ep") == [4, 5] and ep.group(5, "edp") == [1, 3, 5, 7]


def test_context_parallel_sits_between_data_and_tensor_parallel():
    d = Degrees(dp_shard=2, cp=2, tp=2)
    layout = d.mesh_layout()
    assert d.world_size == 8 and layout.dims == ("pp", "dp", "cp", "tp")
    assert layout.group(0, "cp") == [0, 2] and layout.group(0, "dp_cp") == [0, 2, 4, 6]
    hsdp = Degrees(dp_replicate=2, dp_shard=2, cp=2).mesh_layout()
    assert dict(hsdp.flattened)["dp_shard_cp"] == ("dp_shard", "cp") and hsdp.group(0, "dp_shard_cp") == [0, 1, 2, 3]


@pytest.mark.parametrize("degrees, field, fix", [
    (dict(tp=0), "tp", "tp > 0"), (dict(cp=2.0), "cp", "int"), (dict(pp=True), "pp", "int"),
    (dict(dp_shard=3, ep=2), "ep", "ep among [1, 3]"),
    (dict(dp_replicate=2, dp_shard=2, ep=4), "ep", "under HSDP"),
])
def test_degrees_refuse_naming_the_field(degrees, field, fix):
    with pytest.raises(ConfigError) as info:
        Degrees(**degrees)
    assert str(info.value).startswith(f"{field}:") and fix in str(info.value)


def test_degrees_check_the_world_the_model_and_the_sequence():
    d = Degrees(dp_shard=2, cp=2)
    with pytest.raises(ConfigError, match=r"^dp·cp·tp·pp: dp·cp·tp·pp = 2·2·1·1 = 4, but the pool has 2 ranks"):
        d.check_world(2)
    d.check_world(4)
    with pytest.raises(ConfigError, match=r"^seq_len: context parallel .* multiple of 4"):
        d.check_sequence(130)
    d.check_sequence(128)
    with pytest.raises(ConfigError, match="^ep: ep=2 splits experts, but the model is dense"):
        Degrees(dp_shard=2, ep=2).check_model(ModelConfig())
    with pytest.raises(ConfigError, match=r"^pp: pp·stages_per_rank=8"):
        Degrees(pp=2).check_model(ModelConfig(), stages_per_rank=4)


def test_zero_stage_decides_replicate_or_shard_but_not_the_mesh():
    assert Config(dp=2, zero=0).degrees == Degrees(dp_replicate=2)
    assert Config(dp=2, zero=3).degrees == Degrees(dp_shard=2)
    assert mesh_layout(Config(dp=2, zero=0)) == mesh_layout(Config(dp=2, zero=3))  # one mesh, reused


def built_mesh(degrees: list[Degrees]) -> list[dict[str, Any]]:
    """On a rank: build each mesh; this rank's local rank and group along every axis, flattened ones included."""
    from workbench.engine.mesh import build_mesh

    out = []
    for d in degrees:
        mesh = build_mesh(d, "cpu")
        out.append({axis: (mesh[axis].get_local_rank(), sorted(mesh[axis].mesh.flatten().tolist()))
                    for axis in d.mesh_layout().axes})
    return out


def _check_built(results: list[list[dict]], degrees: list[Degrees]) -> None:
    for rank, per_layout in enumerate(results):
        for d, built in zip(degrees, per_layout):
            layout = d.mesh_layout()
            assert set(built) == set(layout.axes)
            for axis, (local, group) in built.items():
                assert local == layout.coordinate(rank)[axis], (d, axis)
                assert group == sorted(layout.group(rank, axis)), (d, axis)


def test_built_meshes_match_the_arithmetic(pool):
    degrees = [Degrees(dp_replicate=2), Degrees(tp=2), Degrees(dp_shard=2, ep=2), Degrees(cp=2)]
    _check_built(pool.run(built_mesh, degrees), degrees)


def test_built_hsdp_and_expert_meshes_match_the_arithmetic(pool4):
    degrees = [Degrees(dp_replicate=2, dp_shard=2), Degrees(dp_replicate=2, dp_shard=2, ep=2),
               Degrees(dp_shard=2, ep=2, tp=2)]
    _check_built(pool4.run(built_mesh, degrees), degrees)


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
