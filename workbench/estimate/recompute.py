"""Recomputation (Config.activation_checkpointing) as engine/parallel/recompute.py runs it: which blocks keep
what, on any kernels.

"selective" and "full" checkpoint whole blocks: such a block keeps its input only. "op" (torchtitan's selective
op policy, torch's selective checkpoint API) checkpoints every block but keeps, from its forward, the outputs of
every other matmul (wq, wv, w1, w2 of wq, wk, wv, wo, w1, w3, w2), of attention (output and log-sum-exp), and
under tensor parallel of the two sequence-parallel reduce-scatters; backward recomputes the rest.
"""

from __future__ import annotations

from workbench.estimate.options import Dtypes
from workbench.estimate.stage import Stage


def policy(st: Stage, layer: int) -> str:
    """How block `layer` keeps its activations: "none", "op" (per-op selective) or "block" (checkpointed)."""
    mode = st.cfg.activation_checkpointing
    if mode == "op":
        return "op"
    return "block" if st.is_checkpointed(layer) else "none"


def op_block(st: Stage, dt: Dtypes) -> int:
    """Bytes a dense block keeps for one micro-batch under the per-op selective policy."""
    m, tp, a, r = st.cfg.model, st.cfg.tp, dt.compute, dt.residual
    kv = m.kv_heads * m.head_dim
    sharded = r * m.dim + a * (m.dim + kv + m.hidden_dim) + a * m.dim + 4 * m.n_heads
    if tp > 1:
        sharded += 2 * a * m.dim  # the saved reduce-scatter outputs of wo and w2
    return round(st.tokens * (sharded / tp + a * m.dim))


def input_only(st: Stage, dt: Dtypes) -> int:
    """A checkpointed block's input: the residual stream, sequence-sharded under tp."""
    return -(-dt.residual * st.tokens * st.cfg.model.dim // st.cfg.tp)


