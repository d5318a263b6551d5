"""Data parallel and the ZeRO stages: what DDP and FSDP2 hold for communication and what they send.

ZeRO 0 = DDP (with tp > 1, FSDP2's `replicate`, one all-reduce per block), 1 = + ZeroRedundancyOptimizer,
2 = FSDP2 without resharding after forward, 3 = FSDP2; FSDP2's units are the blocks, the rest of a stage is the
root (engine/parallel/data_parallel.py). The cp ranks hold the same weights as the dp ranks and average their
gradients with them, so every group here spans dp·cp (`Stage.sync`); under HSDP FSDP2 shards within a shard
group (`Stage.shard_ranks`) and all-reduces each reduce-scattered shard across the dp_replicate groups.
"""

from __future__ import annotations

import math

from workbench.estimate.collectives import Network, collective
from workbench.estimate.compression import compressed_sync
from workbench.estimate.options import Dtypes
from workbench.estimate.records import Collective, Role
from workbench.estimate.stage import Stage

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default gradient bucket (bucket_cap_mb=25): one all-reduce per bucket."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket is small (1 MiB) so that communication starts early in backward."""


def sync_axis(st: Stage) -> str:
    """The mesh axis whose groups average gradients: dp, or dp and cp flattened."""
    return "dp_cp" if st.cfg.cp > 1 else "dp"


def shard_axis(st: Stage) -> str:
    """The mesh axis FSDP2 shards over: the sync group, or under HSDP one shard group (with cp, flattened)."""
    if not st.cfg.hsdp:
        return sync_axis(st)
    return "dp_shard_cp" if st.cfg.cp > 1 else "dp_shard"


def fsdp_edges(st: Stage, edge_units: bool = False) -> tuple[int, int]:
    """The parameters outside the blocks as (kept, resharded): `kept`, the elements gathered once a micro-batch
    and held from forward to backward (the root: embedding, final norm and head; with `Features.fsdp_edge_units`
    under FSDP2, ZeRO 2/3, the norm and head's unit), `resharded`, the embedding's own unit with `edge_units`,
    gathered for forward and again for backward as a block is. DDP and replicate (ZeRO 0/1) have no such units,
    and a head tied to the embedding (none of its own) keeps the three in one unit, as torchtitan does."""
    if not edge_units or not st.head or st.cfg.zero < 2:
        return st.root, 0
    embedding = st.embedding if st.first else 0
    return st.root - embedding, embedding


def fsdp_unit_count(st: Stage, edge_units: bool = False) -> int:
    """FSDP2's units on this rank: the blocks and the non-empty units around them."""
    kept, resharded = fsdp_edges(st, edge_units)
    return len(st.layers) + (kept > 0) + (resharded > 0)


def dp_buffers(st: Stage) -> int:
    """Bytes of communication copies: DDP's flat gradient buckets (zero 0/1, tp = 1), or FSDP2's gathered
    parameters and the full gradients it holds before their reduce-scatter (zero 2/3)."""
    cfg = st.cfg
    params = 4 * st.params
    experts = 4 * st.expert_params
    if cfg.zero <= 1:
        # DDP copies every gradient into its flat buckets (FSDP2's replicate, used under tp, does not); with ep > 1
        # it ignores the expert slices, which are all-reduced over edp on their own.
        return params - (experts if cfg.ep > 1 else 0) if st.sync > 1 and cfg.tp == 1 else 0
    largest_unit = max(st.root, st.block_params if st.layers else 0)
    # Within a pipeline, FSDP2 accumulates full gradients until the last micro-batch; alone, it reduce-scatters
    # each unit's gradient as backward finishes it.
    grads_before_sync = params if cfg.pp > 1 else 4 * largest_unit
    if cfg.zero == 2:
        gathered = params
    else:
        # The root stays gathered from forward to backward; blocks are gathered one ahead of use.
        gathered = 4 * (st.root + min(2, len(st.layers)) * st.block_params)
    return gathered + grads_before_sync


def dp_comm(st: Stage, net: Network, dt: Dtypes, step_compute_s: float, backward_mb_s: float,
            per_unit: tuple[float, float] | None = None, edge_units: bool = False) -> list[Collective]:
    """The dp axis's collectives per step: the gradient sync, and ZeRO's parameter traffic.

    The gradient all-reduce hides behind the last micro-batch's backward (`backward_mb_s`). FSDP2's gathers hide
    behind the compute outside the sync window and its reduce-scatters behind that window, or, given
    `per_unit` (forward, backward seconds of one unit's compute per micro-batch: the GPU model), each call
    behind its own unit's compute, the first gather and the last reduce-scatter exposed. `edge_units`:
    `Features.fsdp_edge_units`.
    """
    cfg = st.cfg
    n, shard, over = st.sync, st.shard_ranks, sync_axis(st)
    if n == 1:
        return []
    # With ep > 1 the expert slices are synchronised over edp (`expert.ep_comm`), the rest over dp.
    local = st.params - (st.expert_params if cfg.ep > 1 else 0)
    grads = 4 * local
    m, units = cfg.micro_batches, fsdp_unit_count(st, edge_units)
    if cfg.zero <= 1:
        if cfg.tp > 1:
            calls, what = units, "gradients (replicate, per block)"
        else:
            calls, what = 1 + math.ceil(max(0, grads - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES), "gradients"
        if cfg.compression != "none":
            out = compressed_sync(st, net, ddp_buckets(grads), backward_mb_s)
        else:
            out = [collective(net, st.rank, "dp", "all_reduce", Role.GRADIENT_SYNC, what, calls, grads / calls,
                              n, hidden_by=backward_mb_s, over=over)]
        if cfg.zero == 1:
            # ZeroRedundancyOptimizer broadcasts each updated parameter tensor from the rank that owns it.
            out.append(collective(net, st.rank, "dp", "broadcast", Role.PARAMETER_BROADCAST,
                                  "updated parameters (ZeRO-1)", st.tensors, grads / st.tensors, n, over=over))
        return out
    sync_each_mb = cfg.pp == 1
    syncs = m if sync_each_mb else 1
    sync_window = backward_mb_s * syncs
    rest = max(0.0, step_compute_s - sync_window)
    half = cfg.compression in ("fp16", "bf16")  # FSDP2's reduce_dtype
    # What one gather of every unit brings: fp32, or the compute dtype under MP; the blocks' Float8 weights in fp8.
    gathered = dt.gathered_bytes(local, st.root)
    if cfg.zero == 2:
        gathers = m if sync_each_mb else 1
        gather_bytes, gather_calls = gathered * gathers, units * gathers
    else:
        # Each micro-batch gathers every unit for forward and all but the one kept gathered again for backward.
        kept, _ = fsdp_edges(st, edge_units)
        gather_bytes = m * (2 * gathered - dt.gathered_root * kept)
        gather_calls = m * (2 * units - (kept > 0))
    gather_window, scatter_window = per_unit if per_unit else (rest, sync_window)
    per_call, over = per_unit is not None, shard_axis(st)
    out = [
        collective(net, st.rank, "dp", "all_gather", Role.PARAMETER_GATHER, f"parameters (ZeRO-{cfg.zero})",
                   gather_calls, gather_bytes / gather_calls, shard, hidden_by=gather_window, per_call=per_call,
                   over=over),
        collective(net, st.rank, "dp", "reduce_scatter", Role.GRADIENT_SYNC,
                   "gradients" + (f" ({cfg.compression})" if half else ""), units * syncs,
                   grads / units / (2 if half else 1), shard, hidden_by=scatter_window, per_call=per_call, over=over),
    ]
    if cfg.hsdp:
        # HSDP: each reduce-scattered shard is then all-reduced across the dp_replicate groups.
        out.append(collective(net, st.rank, "dp", "all_reduce", Role.GRADIENT_SYNC,
                              "gradients (HSDP, across replica groups)", units * syncs,
                              grads / units / shard / (2 if half else 1), cfg.dp_replicate,
                              hidden_by=scatter_window, per_call=per_call, over="dp_replicate"))
    return out


def ddp_buckets(grad_bytes: int) -> list[int]:
    """DDP's bucket sizes in bytes: a first bucket of 1 MiB, then 25 MiB ones (parameter boundaries ignored)."""
    first = min(grad_bytes, DDP_FIRST_BUCKET_BYTES)
    rest = grad_bytes - first
    return [first] + [min(DDP_BUCKET_BYTES, rest - i) for i in range(0, rest, DDP_BUCKET_BYTES)]
