"""The replica check on a rank: which ranks of the layout must hold the same bytes, and their digests compared.

The measures (a digest per parameter, the comparison, the error naming the odd rank) are
`workbench.telemetry.replicas`; which ranks are replicas depends on the layout, which is the engine's:
the data-parallel ranks (times cp) under DDP and ZeRO-1, including tensor parallel's (dp, tp) parameters (each
dp rank holds the same tp shard); under HSDP the dp_replicate groups; under plain ZeRO-2/3 none (FSDP2 shards
every parameter over dp, so no two ranks hold the same bytes). Expert-parallel slices differ across the ep
ranks and are left out.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.engine.parallel.expert import expert_parameters
from workbench.telemetry.replicas import ReplicaDivergence, first_divergence, parameter_digests


def replica_group(trainer: Any) -> tuple[Any | None, list[torch.Tensor]]:
    """The process group of this rank's replicas (None when it has none) and the parameters to leave out."""
    cfg, mesh = trainer.cfg, trainer.dp_mesh
    if cfg.hsdp:
        group = mesh.get_group(0)  # dp_replicate: FSDP2 shards within, replicates across
    elif cfg.zero >= 2:
        return None, []
    else:
        group = mesh.get_group()
    if torch.distributed.get_world_size(group) < 2:
        return None, []
    return group, [p for module in trainer.modules for p in expert_parameters(module)]


def check_replicas(trainer: Any) -> None:
    """Compare this rank's parameters with its replicas'; raises `ReplicaDivergence` on every replica alike.

    A collective over the replica group (one all_gather of 16 bytes a parameter): every rank of the layout must
    call it at the same step. Does nothing when the layout has no replicas."""
    import torch.distributed as dist

    group, skip = replica_group(trainer)
    if group is None:
        return
    mine = parameter_digests(trainer.modules, skip)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    found = first_divergence(dict(zip(dist.get_process_group_ranks(group), gathered)))
    if found is not None:
        raise ReplicaDivergence(found)
