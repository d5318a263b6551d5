"""Mixture of experts and expert parallel: routed assignments, what a MoE FFN saves, and the all-to-alls.

The router is taken to balance perfectly (each expert and each ep rank gets its even share of the assignments,
capped by capacity), so every figure that depends on routing is its mean over ranks.
"""

from __future__ import annotations

from workbench.estimate.collectives import Network, collective
from workbench.estimate.records import Collective, Role
from workbench.estimate.stage import Stage


def assignments(st: Stage) -> int:
    """(token, expert) assignments one micro-batch keeps in one MoE layer: top_k per token, at most the capacity
    of every expert in every sequence (the routing group; a traced model's routers keep every assignment)."""
    m, cfg = st.shape, st.cfg
    return min(st.tokens * m.top_k, cfg.micro_batch_size * m.n_experts * m.expert_capacity(cfg.seq_len))


def moe_activations(st: Stage) -> int:
    """Bytes a MoE FFN saves for one micro-batch beyond the SwiGLU it replaces (its input is counted as the
    block's), term by term as measured, with A kept assignments, R of them arriving here (R = A, balanced):
      routed tokens (fp32 input) R·D·4; their outputs and weighted outputs 2·A·D·a; SwiGLU per assignment
      4·A·H·a; router: fp32 probabilities T·E·4, top-k indices T·k·8, top-k weights and their sum T·(4k+4),
      the keep mask T·k bytes, per-sequence shares B·E·4; kept weights, token ids and sort order A·(4+8+8);
      with ep > 1 the regrouping order and its inverse 2·R·8. Under autocast, the 2-byte copies of each
      expert's tokens (twice) and of this rank's expert weights."""
    cfg, m, a = st.cfg, st.shape, st.act_bytes
    t, k, n_e, d, h = st.tokens, m.top_k, m.n_experts, m.dim, m.hidden_dim
    kept = arrived = assignments(st)
    saved = (4 * arrived * d + 2 * a * kept * d + 4 * a * kept * h + t * (4 * n_e + 12 * k + 4 + k)
             + cfg.micro_batch_size * n_e * 4 + 20 * kept + (16 * arrived if cfg.ep > 1 else 0))
    if m.shared_expert:
        saved += 4 * a * t * h
    if st.autocast:
        saved += 2 * 2 * arrived * d + 2 * 3 * d * h * n_e // cfg.ep
    return saved - round(4 * a * t * h / cfg.tp)  # the dense SwiGLU term, already in the block's


def ep_comm(st: Stage, net: Network) -> list[Collective]:
    """Expert parallel: per MoE layer and micro-batch, the router counts go out by all-to-all, then the tokens
    and their outputs (forward), their gradients (backward), and the forward's again when recomputed; the
    expert slices' gradient sync over edp."""
    cfg = st.cfg
    if cfg.ep == 1 or not st.moe_layers:
        return []
    mb, a, kept = cfg.micro_batches, st.act_bytes, assignments(st)
    moe = len(st.moe_layers)
    forwards = moe + sum(st.is_checkpointed(i) for i in st.moe_layers)
    # Tokens go out in fp32 (the normed residual), outputs come back in the compute precision; backward sends
    # the gradients of both the same way.
    calls = mb * (2 * forwards + 2 * moe)
    payload = mb * (forwards * kept * st.dim * (4 + a) + moe * kept * st.dim * (4 + a))
    out = [collective(net, st.rank, "ep", "all_to_all", Role.TOKEN_DISPATCH, "routed tokens and their gradients", calls,
                      payload / calls, cfg.ep),
           collective(net, st.rank, "ep", "all_to_all", Role.ROUTER_COUNTS, "router counts per expert", mb * forwards,
                      8 * st.shape.n_experts, cfg.ep)]
    edp = cfg.dp // cfg.ep
    if edp > 1:
        per_layer = 4 * st.expert_params // moe
        if cfg.zero == 0:
            out.append(collective(net, st.rank, "edp", "all_reduce", Role.EXPERT_GRADIENT_SYNC,
                                  "expert gradients (per micro-batch)", 3 * moe * mb, per_layer / 3, edp))
        else:
            out.append(collective(net, st.rank, "edp", "reduce_scatter", Role.EXPERT_GRADIENT_SYNC, "expert gradients",
                                  moe * mb, per_layer, edp))
    return out
