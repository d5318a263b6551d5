"""Recomputation (Config.activation_checkpointing) as engine/parallel/recompute.py runs it: which blocks keep
what, on any kernels.

"selective" and "full" checkpoint whole blocks: such a block keeps its input only. "op" (torchtitan's selective
op policy, torch's selective checkpoint API) checkpoints every block but keeps, from its forward, the outputs of
every other matmul (wq, wv, w1, w2 of wq, wk, wv, wo, w1, w3, w2), of attention (output and log-sum-exp; not where
the policy does not name the attention kernel the run calls, `Features.op_keeps_attention`), and under tensor
parallel of the two sequence-parallel reduce-scatters; backward recomputes the rest.
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


def op_block(st: Stage, dt: Dtypes, layer: int | None = None, keeps_attention: bool = True,
             fused_qkv: bool = False) -> int:
    """Bytes a dense block (block `layer` of a traced model) keeps for one micro-batch under the per-op selective
    policy; `keeps_attention` False: the policy recomputes attention instead (`Features.op_keeps_attention`);
    `fused_qkv`: q, k and v in one linear, whose whole output is kept (`Features.fused_qkv`)."""
    if st.profile is not None:
        return _traced_op_block(st, dt, st.layers[0] if layer is None else layer)
    m, tp, a, r = st.shape, st.cfg.tp, dt.compute, dt.residual
    kv = m.kv_heads * m.head_dim
    attention = a * m.dim + 4 * m.n_heads if keeps_attention else 0  # its output and log-sum-exp
    projections = m.dim + 2 * kv if fused_qkv else m.dim + kv  # wqkv's output, or wq's and wv's
    sharded = r * m.dim + a * (projections + m.hidden_dim) + attention
    if tp > 1:
        sharded += 2 * a * m.dim  # the saved reduce-scatter outputs of wo and w2
    return round(st.tokens * (sharded / tp + a * m.dim))


def op_block_unsaved_matmuls(st: Stage, dt: Dtypes, layer: int | None = None, keeps_attention: bool = True) -> int:
    """Bytes a block whose matmuls the per-op policy saves none of keeps (an NVFP4 block: `Features.nvfp4`): its
    input, attention's output and log-sum-exp (unless `keeps_attention` is False), and under tensor parallel the
    reduce-scatters' outputs, per micro-batch."""
    tp, a = st.cfg.tp, dt.compute
    if st.profile is not None:
        b = st.profile.block(st.layers[0] if layer is None else layer)
        heads, width, dim = b.heads, b.heads * b.head_dim, st.dim
    else:
        heads, width, dim = st.shape.n_heads, st.shape.n_heads * st.shape.head_dim, st.shape.dim
    attention = a * width + 4 * heads if keeps_attention else 0
    scattered = 2 * a * dim if tp > 1 else 0
    return input_only(st, dt) + round(st.tokens * (attention + scattered) / tp)


def _traced_op_block(st: Stage, dt: Dtypes, layer: int) -> int:
    """What the trace saw the policy keep of block `layer` (`BlockProfile.op_kept_bytes`: matmul outputs sharded
    by column-parallel linears and attention's ÷tp, the rest whole), its input, and under tensor parallel the
    reduce-scatters' outputs of its row-parallel linears, per micro-batch."""
    b, tp, a = st.profile.block(layer), st.cfg.tp, dt.compute
    kept = (b.op_kept_bytes - b.op_whole_bytes) / tp + b.op_whole_bytes
    scattered = sum(a * g.n * g.count for g in b.gemms if g.split == "row") if tp > 1 else 0
    return round(st.profile.per_token(st.tokens) * kept + st.tokens * (dt.residual * st.dim + scattered) / tp)


def input_only(st: Stage, dt: Dtypes) -> int:
    """A checkpointed block's input: the residual stream, sequence-sharded under tp."""
    return -(-dt.residual * st.tokens * st.dim // st.cfg.tp)


