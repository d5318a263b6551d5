"""Activations as this engine's model saves them on CPU kernels: the tensors autograd keeps for backward, term by
term, each storage once however many ops save it. Exact for the CPU runs (tests/test_estimate_vs_measured.py)."""

from __future__ import annotations

from workbench.estimate.expert import moe_activations
from workbench.estimate.options import dtypes
from workbench.estimate.recompute import op_block, policy
from workbench.estimate.stage import Stage


def block_activations(st: Stage, layer: int | None = None) -> int:
    """Bytes one block saves for backward for one micro-batch, measured term by term on this model.

    Per token, with a = 2 under autocast else 4, sequence-parallel parts ÷ tp:
      two RMSNorms: input, 1/rms and x/rms in fp32          (16·dim + 8) ÷ tp
      inputs of wq,wk,wv and w1,w3 (gathered, full length)  8·dim fp32; 10·dim under autocast (one cast each);
                                                            4·dim under FSDP2 mixed precision (bf16 outputs)
      attention: rotated q and k, v, output; logsumexp      (a·(2·dim + 2·kv_dim) + 4·heads) ÷ tp
      SwiGLU: w1 out, silu out, w3 out, product             4·a·hidden ÷ tp
    plus, under autocast, the 2-byte copy of the block's weights. Every norm saves its input twice (for the
    square and for the product with 1/rms), one storage; in the first block under tp that input is the
    embedding's reduce-scatter output, a wrapper around the collective's result, one sharded residual all the
    same.
    """
    if st.profile is not None:
        return traced_block(st, st.layers[0] if layer is None else layer)
    m, tp, a = st.shape, st.cfg.tp, st.act_bytes
    kv_dim = m.kv_heads * m.head_dim
    sharded = 16 * m.dim + 8 + a * (2 * m.dim + 2 * kv_dim) + 4 * m.n_heads + 4 * a * m.hidden_dim
    # CPU's RMSNorm upcasts a bf16 input, so the norms save fp32 whatever the residual's dtype.
    gathered = 10 * m.dim if st.autocast else 4 * m.dim if st.residual_bytes == 2 else 8 * m.dim
    casts = 2 * st.block_matmul if st.autocast else 0
    return round(st.tokens * (sharded / tp + gathered)) + casts


def layer_activations(st: Stage, layer: int) -> int:
    """Bytes block `layer` saves for one micro-batch (a MoE block differs from a dense one in its FFN); under the
    per-op policy what it keeps (`recompute.op_block`: the same tensors on CPU kernels as on GPU ones)."""
    if st.profile is not None:  # a traced block's figure holds its mixture of experts
        return op_block(st, dtypes(st.cfg), layer) if policy(st, layer) == "op" else block_activations(st, layer)
    moe = moe_activations(st) if st.shape.is_moe_layer(layer) else 0
    if policy(st, layer) == "op":
        return op_block(st, dtypes(st.cfg)) + moe
    return block_activations(st) + moe


def edge_activations(st: Stage, first: bool, last: bool) -> int:
    """Bytes saved outside the blocks: token ids (first stage); final norm, head input, log-probs (last)."""
    if st.profile is not None:
        return traced_edges(st, first, last)
    m, tp = st.shape, st.cfg.tp
    saved = 8 * st.tokens if first else 0
    if last:
        head_input = st.act_bytes * m.dim
        # log_softmax keeps its fp32 output over the whole (gathered) vocabulary, plus the int64 targets.
        per_token = (8 * m.dim + 4) / tp + head_input + 4 * m.vocab_size + 8
        saved += round(st.tokens * per_token) + (2 * st.head if st.autocast else 0)
    return saved


def stage_activations(st: Stage) -> dict[int, int]:
    """Bytes one micro-batch leaves saved in each pipeline stage this rank holds, by global stage index.

    A stage after the first saves its input where it arrived: torch's receive buffer for that micro-batch, which
    is held between steps whatever is in flight and counted under buffers, so the first block's figure is
    taken without it.
    """
    def kept(layers: tuple[int, ...]) -> int:
        return (sum(layer_activations(st, i) for i in layers if not st.is_checkpointed(i))
                + st.count_checkpointed(layers) * st.residual() + traced_shared(st, layers))

    return st.saved_by_stage(kept, lambda first, last: edge_activations(st, first, last), st.residual())


def rebuilt_block(st: Stage) -> int:
    """The largest block backward rebuilds at a time under recomputation (0 without): a transient of backward."""
    if st.profile is not None:
        rebuilt = [block_activations(st, i) for i in st.layers
                   if st.cfg.activation_checkpointing == "op" or st.is_checkpointed(i)]
        return max(rebuilt, default=0)
    moe = moe_activations(st) if st.moe_layers else 0
    if st.cfg.activation_checkpointing == "op":
        return block_activations(st) + moe
    rebuilt = [block_activations(st) + (moe_activations(st) if st.shape.is_moe_layer(i) else 0)
               for i in st.layers if st.is_checkpointed(i)]
    return max(rebuilt) if rebuilt else 0


def traced_block(st: Stage, layer: int) -> int:
    """Bytes block `layer` of a traced model saves for one micro-batch: what the trace saw for one sequence, per
    token; the inputs of column-parallel matmuls and what a mixture of experts saves (it runs whole on every tp
    rank) whole, the rest ÷tp under sequence parallel; its weights' low-precision copies once per micro-batch, ÷tp
    (a mixture of experts' ÷ep instead: its experts split over the ep ranks)."""
    b, tp, ep = st.profile.block(layer), st.cfg.tp, st.cfg.ep
    whole = b.gathered_bytes + b.replicated_bytes
    sharded = b.saved_bytes - whole - b.weight_copies
    copies = (b.weight_copies - b.whole_copies) // tp + b.whole_copies // ep
    return round(st.profile.per_token(st.tokens) * (sharded / tp + whole)) + copies


def traced_shared(st: Stage, layers: tuple[int, ...]) -> int:
    """What a traced model's blocks save of the tensors it makes once per forward (rotary cos/sin, masks), for
    the tokens of one micro-batch on this rank (÷cp): all of it where one of `layers` saves its own activations;
    where they all recompute, only what they are handed positionally (checkpointing keeps a block's positional
    inputs; the per-op policy's cache, which no hook counts, keeps none of them)."""
    if st.profile is None or not layers:
        return 0
    saved = st.profile.shared_saved if any(policy(st, i) == "none" for i in layers) else st.profile.shared_handed
    return -(-saved // st.cfg.cp)


def traced_edges(st: Stage, first: bool, last: bool) -> int:
    """Bytes a traced model saves outside its blocks: the embedding's (first stage); the final norm's (÷tp under
    sequence parallel), the head's and the loss's (last stage)."""
    p, tp = st.profile, st.cfg.tp
    saved = round(p.per_token(st.tokens) * p.first_saved) if first else 0
    if last:
        whole = p.last_saved - p.last_sharded - p.last_copies
        saved += round(p.per_token(st.tokens) * (whole + p.last_sharded / tp))
        saved += p.last_copies // (tp if p.head_split else 1)
    return saved
