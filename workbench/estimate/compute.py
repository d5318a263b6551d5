"""FLOPs a rank executes per step (recomputation included), and the compute time they take."""

from __future__ import annotations

from workbench.estimate.options import NO_FEATURES, Features
from workbench.estimate.stage import Stage
from workbench.config.params import block_matmul_params, head_params, mlp_params, moe_active_ffn_params


def op_recomputed_params(m) -> int:
    """Weight elements of the matmuls the per-op policy recomputes in a block (torchtitan's "op": the 2nd, 4th
    and 6th mm of wq, wk, wv, wo, w1, w3, w2: wk, wo, w3)."""
    return m.dim * m.kv_heads * m.head_dim + m.n_heads * m.head_dim * m.dim + m.dim * m.hidden_dim


def executed_flops(st: Stage, features: Features = NO_FEATURES) -> float:
    """FLOPs one rank of this stage executes per step: forward and backward of its blocks (and the head on the
    last stage), plus the forward again of every checkpointed block; a MoE FFN runs replicated over tp. Under
    the per-op policy, what `features` make it recompute: attention's forward where it keeps none of it
    (`op_keeps_attention`), wo and w3 only with q, k, v fused (`fused_qkv`), all but w2 in a dense NVFP4 block."""
    if st.profile is not None:
        return _traced_flops(st)
    cfg, m = st.cfg, st.shape
    block_full, head_full = block_matmul_params(m), head_params(m)
    attn_fwd = 4 * cfg.seq_len * m.n_heads * m.head_dim
    block_train = 3 * (2 * block_full + attn_fwd)
    recompute = 2 * block_full + attn_fwd
    per_token = len(st.layers) * block_train + st.checkpointed * recompute + st.last * 3 * 2 * head_full
    if cfg.activation_checkpointing == "op":
        # The per-op policy recomputes every other matmul of each block: wk, wo and w3 (wo and w3 of wqkv, wo,
        # w1, w3, w2), and attention where it does not keep it.
        kv = m.dim * m.kv_heads * m.head_dim
        again = op_recomputed_params(m) - (kv if features.fused_qkv else 0)
        fp4 = 0 if m.n_experts else sum(features.runs_nvfp4(i, m.n_layers) for i in st.layers)
        per_token += (len(st.layers) - fp4) * 2 * again + fp4 * 2 * (block_full - m.hidden_dim * m.dim)
        per_token += 0 if features.op_keeps_attention else len(st.layers) * attn_fwd
    replicated = 0  # per token, computed whole on every tp rank
    if m.n_experts:
        # A MoE FFN runs the router, top_k experts and the shared expert, replicated over tp, instead of the dense
        # SwiGLU's 1/tp; its forward runs again where the block is checkpointed.
        runs = 3 * len(st.moe_layers) + sum(st.is_checkpointed(i) for i in st.moe_layers)
        per_token -= runs * 2 * mlp_params(m)
        replicated = runs * 2 * moe_active_ffn_params(m)
    return (per_token / cfg.tp + replicated) * st.tokens * cfg.micro_batches


def _traced_flops(st: Stage) -> float:
    """`executed_flops` from a traced model: each block's forward and backward as counted (its mixture-of-experts
    FFN whole on every tp rank, the rest ÷tp), forward again where it recomputes, the head on the last stage."""
    cfg, p = st.cfg, st.profile
    split = replicated = 0.0
    for i in st.layers:
        b = p.block(i)
        runs = b.forward_flops + b.backward_flops + st.is_checkpointed(i) * b.forward_flops
        again = b.replicated_forward_flops * st.is_checkpointed(i)
        split += runs - b.replicated_flops - again
        replicated += b.replicated_flops + again
    if cfg.activation_checkpointing == "op":
        # The per-op policy recomputes every other matmul of each block (the built-in's wk, wo and w3), as traced.
        for i in st.layers:
            b = p.block(i)
            split += b.op_recomputed_flops - b.op_recomputed_whole_flops
            replicated += b.op_recomputed_whole_flops
    if st.last:
        head = p.head_forward_flops + p.head_backward_flops
        split, replicated = (split + head, replicated) if p.head_split else (split, replicated + head)
    return (split / cfg.tp + replicated) * p.per_token(st.tokens) * cfg.micro_batches
