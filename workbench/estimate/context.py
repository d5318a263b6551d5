"""Context parallel (engine/parallel/context.py): the ring that passes keys and values round the cp ranks.

A cp rank holds seq_len/cp tokens of every sequence (`Stage.tokens`), so what it saves and computes outside
attention is that of its share; its attention reads the whole sequence, its K/V arriving hop by hop.
"""

from __future__ import annotations

from workbench.estimate.collectives import Network, collective
from workbench.estimate.records import Collective, Role
from workbench.estimate.stage import Stage


def attention_flops(st: Stage) -> float:
    """FLOPs of q·kᵀ and p·v one rank executes per step (forward and backward, over the full square as the
    model's FLOPs count them): its tokens' queries against the whole sequence. A traced model's are its blocks'
    own (`BlockProfile.attention_flops`), the built-in one's from its shape."""
    cfg, m = st.cfg, st.shape
    if st.profile is not None:
        forward = sum(st.profile.block(i).attention_flops for i in st.layers)
        return 3 * forward / cfg.tp * st.profile.per_token(st.tokens) * cfg.micro_batches
    per_token = 3 * 4 * cfg.seq_len * m.n_heads * m.head_dim / cfg.tp
    return per_token * st.tokens * len(st.layers) * cfg.micro_batches


def kv_elements(st: Stage) -> int:
    """Key and value elements of one micro-batch's tokens on this rank, per block, on one tp rank: what one pass of
    the ring sends. A traced model's are what its blocks hand their attention kernel (their mean over this rank's
    blocks, so that the calls times this size is what they all send)."""
    cfg, m = st.cfg, st.shape
    if st.profile is not None:
        widths = [st.profile.block(i).kv_width // cfg.tp for i in st.layers]
        return st.tokens * sum(widths) // max(1, len(widths))
    return 2 * st.tokens * (m.kv_heads // cfg.tp) * m.head_dim


def cp_comm(st: Stage, net: Network, hidden_s: float) -> list[Collective]:
    """The ring's sends per step, per block and micro-batch: forward passes this rank's keys and values on cp-1
    times, backward passes them again and their fp32 gradients cp times (the last hop brings them home); a
    recomputed block's forward passes them once more. Each pass is one send (and one recv) of (2, micro-batch,
    kv_heads/tp, seq/cp, head_dim), overlapped with the attention of the block held (`hidden_s`: the step's
    attention compute)."""
    cfg = st.cfg
    if cfg.cp == 1:
        return []
    mb, layers, cp = cfg.micro_batches, len(st.layers), cfg.cp
    kv = kv_elements(st)
    kv_calls = mb * (2 * layers + st.checkpointed) * (cp - 1)
    return [collective(net, st.rank, "cp", "send_recv", Role.CONTEXT_RING, "keys and values (ring)", kv_calls,
                       st.act_bytes * kv, cp, hidden_by=hidden_s),
            collective(net, st.rank, "cp", "send_recv", Role.CONTEXT_RING, "key and value gradients (ring)",
                       mb * layers * cp, 4 * kv, cp, hidden_by=hidden_s)]
