"""Tensor parallel (Megatron splits with sequence parallel, as engine/parallel/tensor.py plans them): its
collectives per step. They block the computation that needs them: all exposed, unless async TP (Config.async_tp)
runs each beside the matmuls it feeds or is fed by: torch's micro-pipeline TP multiplies the tp shards of the
sequence in turn as they arrive over symmetric memory (copy engines, no SMs taken), the local one first, so a
gather is exposed only by what its transfer takes beyond (tp - 1)/tp of its matmuls; a reduce-scatter likewise
sends each chunk's partial sums as the next chunk is multiplied. The matmuls themselves, in tp chunks, are priced
so in `step_gpu` (`MicroBatchCompute.tp_gather_gemm`, `tp_scatter_gemm`). Inductor's pass fuses a collective
with a matmul that reads its output or writes its input directly (torch/_inductor/fx_passes/micro_pipeline_tp.py:
`fuse_all_gather_matmul`, `fuse_matmul_reduce_scatter`): backward's reduce-scatters of the input gradients
sum two or three matmuls first (wq, wk, wv; w1, w3), so they run unfused, exposed as without async TP."""

from __future__ import annotations

from workbench.estimate.collectives import Network, collective
from workbench.estimate.records import Collective, Role
from workbench.estimate.options import NO_FEATURES, Dtypes, Features
from workbench.estimate.stage import Stage


def tp_comm(st: Stage, net: Network, dt: Dtypes, features: Features = NO_FEATURES,
            windows: tuple[float, float] = (0.0, 0.0)) -> list[Collective]:
    """The tp collectives of a step; `windows`: the matmuls (seconds per micro-batch) beside the gathers and the
    reduce-scatters, which async TP overlaps with them."""
    cfg = st.cfg
    if cfg.tp == 1:
        return []
    mb, a, r, tp = cfg.micro_batches, dt.compute, dt.residual, cfg.tp
    # torchao's Float8 tensor-parallel styles (tensorwise) cast to fp8 before they gather: the norm outputs in
    # forward and the output gradients in backward move one byte an element; the reduce-scatters stay in a.
    g_in, g_out = (1, 1) if dt.recipe == "tensorwise" else (r, a)
    act = st.tokens * st.dim
    blocks, moe = len(st.layers), len(st.moe_layers)
    # Per block and micro-batch, sequence parallel gathers the norm outputs (the residual's dtype) before
    # attention and MLP and reduce-scatters their a-byte outputs; backward mirrors that; recomputation repeats
    # the forward half, but the per-op policy keeps the reduce-scatters' outputs and gathers again only.
    forwards = blocks + st.checkpointed
    regathers = blocks if cfg.activation_checkpointing == "op" else st.checkpointed
    gather_bytes = mb * 2 * ((blocks + regathers) * g_in + blocks * g_out) * act
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
    gather_calls += mb * edges
    scatter_calls += mb * edges
    # Async TP: each fused call beside its share of the matmuls, all but the local shard's (the embedding's and
    # the head's calls, outside the compiled blocks, are not fused and count as windowless); backward's
    # reduce-scatters of the input gradients (two a block, of r bytes) stay unfused.
    unfused_calls = mb * 2 * (blocks - moe) if cfg.async_tp else 0
    unfused_bytes = unfused_calls * r * act
    fused = (tp - 1) / tp if cfg.async_tp else 0.0
    gather_window = fused * mb * windows[0] / max(1, gather_calls)
    scatter_window = fused * mb * windows[1] / max(1, scatter_calls - unfused_calls)
    out = [
        collective(net, st.rank, "tp", "all_gather", Role.SEQUENCE_PARALLEL, "sequence-parallel activations",
                   gather_calls, gather_bytes / gather_calls, tp, hidden_by=gather_window, pipelined=cfg.async_tp),
        collective(net, st.rank, "tp", "reduce_scatter", Role.SEQUENCE_PARALLEL, "sequence-parallel activations",
                   scatter_calls - unfused_calls, (scatter_bytes - unfused_bytes) / (scatter_calls - unfused_calls),
                   tp, hidden_by=scatter_window, pipelined=cfg.async_tp),
        # Once per step, every norm of the stage in one call, after the last micro-batch's backward
        # (engine/parallel/tensor.py's reduce_partial_gradients, as Megatron-LM reduces its layernorm gradients).
        collective(net, st.rank, "tp", "all_reduce", Role.NORM_GRADIENTS, "norm weight gradients", 1,
                   4 * st.dim * (2 * blocks + st.last), tp),
    ]
    if unfused_calls:
        out.append(collective(net, st.rank, "tp", "reduce_scatter", Role.SEQUENCE_PARALLEL,
                              "input gradients (unfused by async TP)", unfused_calls, r * act, tp))
    if st.last and not features.loss_parallel:
        out.append(collective(net, st.rank, "tp", "all_gather", Role.LOGITS, "logits for the loss", mb,
                              st.tokens * st.vocab_size * a, tp))
    return out
