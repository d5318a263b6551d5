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
    model's FLOPs count them): its tokens' queries against the whole sequence."""
    cfg, m = st.cfg, st.cfg.model
    per_token = 3 * 4 * cfg.seq_len * m.n_heads * m.head_dim / cfg.tp
    return per_token * st.tokens * len(st.layers) * cfg.micro_batches


def cp_comm(st: Stage, net: Network, hidden_s: float) -> list[Collective]:
    """The ring's sends per step, per block and micro-batch: forward passes this rank's keys and values on cp-1
    times, backward passes them again and their fp32 gradients cp times (the last hop brings them home); a
    recomputed block's forward passes them once more. Each pass is one send (and one recv) of (2, micro-batch,
    kv_heads/tp, seq/cp, head_dim), overlapped with the attention of the block held (`hidden_s`: the step's
    attention compute)."""
    cfg, m = st.cfg, st.cfg.model
    if cfg.cp == 1:
        return []
    mb, layers, cp = cfg.micro_batches, len(st.layers), cfg.cp
    kv_elements = 2 * st.tokens * (m.kv_heads // cfg.tp) * m.head_dim
    kv_calls = mb * (2 * layers + st.checkpointed) * (cp - 1)
    return [collective(net, st.rank, "cp", "send_recv", Role.CONTEXT_RING, "keys and values (ring)", kv_calls,
                       st.act_bytes * kv_elements, cp, hidden_by=hidden_s),
            collective(net, st.rank, "cp", "send_recv", Role.CONTEXT_RING, "key and value gradients (ring)",
                       mb * layers * cp, 4 * kv_elements, cp, hidden_by=hidden_s)]
