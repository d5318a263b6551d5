"""Tensor parallel (Megatron splits with sequence parallel, as engine/parallel/tensor.py plans them): its
collectives per step. They block the computation that needs them: all exposed."""

from __future__ import annotations

from workbench.estimate.collectives import Network, collective
from workbench.estimate.records import Collective, Role
from workbench.estimate.options import NO_FEATURES, Dtypes, Features
from workbench.estimate.stage import Stage


def tp_comm(st: Stage, net: Network, dt: Dtypes, features: Features = NO_FEATURES) -> list[Collective]:
    cfg, m = st.cfg, st.cfg.model
    if cfg.tp == 1:
        return []
    mb, a, r, tp = cfg.micro_batches, dt.compute, dt.residual, cfg.tp
    act = st.tokens * m.dim
    blocks, moe = len(st.layers), len(st.moe_layers)
    # Per block and micro-batch, sequence parallel gathers the norm outputs (the residual's dtype) before
    # attention and MLP and reduce-scatters their a-byte outputs; backward mirrors that; recomputation repeats
    # the forward half, but the per-op policy keeps the reduce-scatters' outputs and gathers again only.
    forwards = blocks + st.checkpointed
    regathers = blocks if cfg.activation_checkpointing == "op" else st.checkpointed
    gather_bytes = mb * 2 * ((blocks + regathers) * r + blocks * a) * act
    scatter_bytes = mb * 2 * (forwards * a + blocks * r) * act
    gather_calls = mb * 2 * (blocks + regathers + blocks)
    scatter_calls = mb * 2 * (forwards + blocks)
    # A MoE FFN, replicated over tp, slices its output back to the rank's shard (no reduce-scatter) and hands
    # back its input's gradient whole on every rank (a slice too): its gathers stay, its scatters go.
    moe_forwards = moe + sum(st.is_checkpointed(i) for i in st.moe_layers)
    scatter_bytes -= mb * (moe_forwards * a + moe * r) * act
    scatter_calls -= mb * (moe_forwards + moe)
    # The vocab-parallel embedding reduce-scatters its output; the head gathers its input (and backward
    # mirrors both).
    edges = st.first + st.last
    gather_bytes += mb * edges * r * act
    scatter_bytes += mb * edges * r * act
    out = [
        collective(net, st.rank, "tp", "all_gather", Role.SEQUENCE_PARALLEL, "sequence-parallel activations",
                   gather_calls + mb * edges, gather_bytes / (gather_calls + mb * edges), tp),
        collective(net, st.rank, "tp", "reduce_scatter", Role.SEQUENCE_PARALLEL, "sequence-parallel activations",
                   scatter_calls + mb * edges, scatter_bytes / (scatter_calls + mb * edges), tp),
        # Once per step, every norm of the stage in one call, after the last micro-batch's backward
        # (engine/parallel/tensor.py's reduce_partial_gradients, as Megatron-LM reduces its layernorm gradients).
        collective(net, st.rank, "tp", "all_reduce", Role.NORM_GRADIENTS, "norm weight gradients", 1,
                   4 * m.dim * (2 * blocks + st.last), tp),
    ]
    if st.last and not features.loss_parallel:
        out.append(collective(net, st.rank, "tp", "all_gather", Role.LOGITS, "logits for the loss", mb,
                              st.tokens * m.vocab_size * a, tp))
    return out
