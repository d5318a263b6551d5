"""A GPU rank's compute per micro-batch, kernel by kernel (`kernels`), split into what forward and backward run.

Per block: its seven linears' GEMMs by shape (forward, and backward's two; the per-op policy recomputes wk, wo
and w3, a checkpointed block all seven and attention), flash attention, and the memory-bound kernels between
them, whose bytes follow from the tensors this engine's model makes (models/transformer.py), listed in
`elementwise_bytes`. The last stage adds the head and the loss; FSDP2 adds its copies into and out of the
collectives' buffers; the optimizer steps once per step. Backward's memory-bound kernels are taken as twice
their forward's bytes (each reads its output's gradient and what it saved and writes its inputs' gradients).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from workbench.config import FP8, converts
from workbench.estimate.expert import assignments
from workbench.estimate.kernels import attention_forward_flops, attention_time, linear_parts, linear_time, memory_time
from workbench.estimate.low_precision import block_converts, cast_bytes, converted_linears, nvfp4_cast_time
from workbench.estimate.low_precision import gemm_precision as gemm_precision_of
from workbench.estimate.options import Dtypes, Features
from workbench.estimate.saved_gpu import logits_width, policy
from workbench.estimate.stage import Stage
from workbench.hardware import Hardware
from workbench.model_profile import BlockProfile

ADAMW_BYTES_PER_PARAM = 40
"""What torch's foreach AdamW reads and writes per fp32 parameter (torch/optim/adamw.py `_multi_tensor_adamw`):
the parameter, its gradient and two moments read (16 B), the parameter and moments written (12 B), the square
root of the second moment written and read (8 B), the decay's pass over the parameter (4 B)."""

STEP_BYTES_PER_PARAM = {"adamw": ADAMW_BYTES_PER_PARAM, "lion": 60, "sgd": 32}
"""Bytes each Config.optimizer's step reads and writes per fp32 parameter, without weight decay. Lion
(engine/optimizers.py, one op at a time): β1·m into a new tensor (8), + (1-β1)·g (12), sign (8), the parameter's
update (12), β2·m (8), + (1-β2)·g (12). SGD with momentum (torch/optim/sgd.py `_multi_tensor_sgd`): the buffer
scaled (8) and the gradient added (12), the parameter's update from the buffer (12)."""
DECAY_BYTES_PER_PARAM = {"adamw": 0, "lion": 8, "sgd": 12}
"""What weight decay adds: Lion's in-place scaling of the parameter (8); SGD's gradient + wd·parameter into a new
tensor (12); AdamW's decay pass is counted in its 40 B already."""


@dataclass(frozen=True)
class MicroBatchCompute:
    """Seconds of one micro-batch on one rank, by kind of kernel, and how forward and backward split them."""

    gemm: float
    attention: float
    memory_bound: float
    forward: float
    backward: float
    tp_gather_gemm: float = 0.0
    """GEMMs that read what a sequence-parallel all-gather brings (the column-parallel linears' forwards, the
    row-parallel ones' backward) and that async TP runs beside it."""
    tp_scatter_gemm: float = 0.0
    """GEMMs whose output a sequence-parallel reduce-scatter sums (the row-parallel linears' forwards, the
    column-parallel ones' input gradients)."""

    @property
    def total(self) -> float:
        return self.forward + self.backward


def elementwise_bytes(st: Stage, dt: Dtypes, features: Features) -> float:
    """Bytes one dense block's memory-bound kernels read and write in forward, per token (÷tp where sharded).

    Eager (this engine's model, models/transformer.py): each fused RMSNorm reads and writes the residual (2·r·D); a
    residual add reads both operands and writes the sum ((2r + a)·D); rotary on q and k upcasts, rotates halves in
    fp32 and casts back (44 + 2a bytes per element: `apply_rotary`'s nine kernels); SwiGLU's silu and product
    (5·a·F). Under autocast each linear input is cast (read 4, write 2, per gathered element); under tensor
    parallel DTensor's gathers and reduce-scatters along the sequence dim copy the gathered tensor once (2·D each).
    Compiled (torch.compile per block, Features.compile): each fused region reads its inputs and writes its
    outputs once: norm (r + a)·D, rotary 2a per element, add + norm 2(r + a)·D, silu·product 3a·F, the last add.
    The casts of 8-bit and 4-bit linears are `low_precision.cast_bytes` and `nvfp4_cast_time`, counted apart."""
    m, tp, a, r = st.shape, st.cfg.tp, dt.compute, dt.residual
    d, kv, f = m.dim, m.kv_heads * m.head_dim, m.hidden_dim
    if dt.fused:
        sharded = (r + a) * d + 2 * (r + a) * d + (2 * r + a) * d
        heads = 2 * a * (d + kv) + 3 * a * f
        gathered = 0.0
    else:
        sharded = 2 * 2 * r * d + 2 * (2 * r + a) * d
        heads = (44 + 2 * a) * (d + kv) + 5 * a * f
        gathered = (2 * 6 * d if dt.weight_copies else 0) + (2 * 2 * r * d if tp > 1 else 0)
    if tp > 1:
        gathered += 2 * 2 * a * d  # the reduce-scatters' input copies
    return sharded / tp + heads / tp + gathered


def micro_batch_compute(st: Stage, dt: Dtypes, features: Features, hw: Hardware) -> MicroBatchCompute:
    """One micro-batch's kernels on `hw`, for this stage."""
    cfg, m, tp, t = st.cfg, st.shape, st.cfg.tp, st.tokens
    a = dt.compute
    # 8-bit (and NVFP4) linears run at their format's rate; attention stays in the bf16 beside them, and the head
    # too unless the run converts it (Features.low_precision_head).
    base = "bf16" if cfg.precision in FP8 else cfg.precision
    d = st.profile.dim if st.profile else m.dim
    gemm_fwd = gemm_bwd = attn_fwd = attn_bwd = cast_fwd = cast_bwd = tp_gather = tp_scatter = 0.0
    fp4_fwd = fp4_bwd = 0.0  # NVFP4's casts, in seconds (`nvfp4_cast_time`)
    fwd_flops = attention_forward_flops(t, cfg.seq_len, m.n_heads // tp, m.head_dim)
    traced = st.profile
    # Async TP multiplies the sequence's tp shards as they arrive (and sends the output's as they are done).
    chunks = tp if cfg.async_tp else 1
    # Blocks alike (same recomputation, kind and linears' format) cost alike: one of each kind, times how many.
    kinds = Counter((policy(st, layer), traced.blocks[layer] if traced else m.is_moe_layer(layer),
                     features.runs_nvfp4(layer, m.n_layers)) for layer in st.layers)
    for (how, kind, fp4), count in kinds.items():
        precision, elem = gemm_precision_of(dt, base, fp4)
        recipe = "nvfp4" if fp4 else dt.recipe
        if traced is not None:
            block = traced.kinds[kind]
            fwd, bwd, gathered, scattered = _traced_gemms(st, block, how, hw, precision, elem, base, a, chunks, fp4)
            linears = [(g.count, *g.fans(tp)) for g in block.gemms]
        else:
            fwd, bwd, gathered, scattered = _block_gemms(st, kind, how, hw, precision, elem, base, a, chunks, recipe,
                                                         fp4, features.fused_qkv)
            linears = None
        if recipe == "nvfp4":
            converted = linears or converted_linears(st, kind, recipe, features.fused_qkv)
            n_fwd, n_bwd = nvfp4_cast_time(converted, t)
            fp4_fwd += count * n_fwd
            fp4_bwd += count * (n_bwd + (n_fwd if how != "none" else 0.0))  # recomputation casts again
        elif recipe:
            c_fwd, c_bwd = cast_bytes(st, dt, recipe, linears, moe=traced is None and kind,
                                      fused_qkv=features.fused_qkv)
            cast_fwd += count * t * c_fwd
            cast_bwd += count * t * (c_bwd + (c_fwd if how != "none" else 0.0))  # recomputation casts again
        gemm_fwd, gemm_bwd = gemm_fwd + count * fwd, gemm_bwd + count * bwd
        tp_gather, tp_scatter = tp_gather + count * gathered, tp_scatter + count * scattered
        attn_fwd += count * attention_time(hw, base, fwd_flops, backward=False)
        recomputed = how == "block" or (how == "op" and not features.op_keeps_attention)
        attn_bwd += count * attention_time(hw, base, fwd_flops, forwards=int(recomputed))
    if st.last:
        whole_vocab = traced.vocab_size if traced else m.vocab_size
        vocab = -(-whole_vocab // tp)
        head, elem = base, a
        if features.low_precision_head and converts(d, whole_vocab, dt.recipe):
            head, elem = gemm_precision_of(dt, base)
            c_fwd, c_bwd = cast_bytes(st, dt, dt.recipe, [(1, d, vocab)])
            cast_fwd, cast_bwd = cast_fwd + t * c_fwd, cast_bwd + t * c_bwd
        gemm_fwd += linear_time(hw, head, t, d, vocab, elem, backward=False)
        gemm_bwd += linear_time(hw, head, t, d, vocab, elem, forward=False)

    per_block = elementwise_bytes(st, dt, features) * t
    recomputing = sum(policy(st, i) != "none" for i in st.layers)
    mem_fwd = per_block * len(st.layers)
    mem_bwd = 2 * mem_fwd + per_block * recomputing
    mem_fwd, mem_bwd = mem_fwd + cast_fwd, mem_bwd + cast_bwd
    if st.last:
        # The loss, eager: the logits' fp32 copy, log_softmax's passes and nll_loss; backward's mirror of them.
        # Compiled: one pass over the logits forward (max and sum online), one reading them and writing the
        # gradient backward.
        v = logits_width(st, features)
        mem_fwd += t * (a if features.compile_loss else a + 16) * v
        mem_bwd += t * (2 * a if features.compile_loss else 24 + a) * v
    mem_fwd = memory_time(hw, mem_fwd) + fp4_fwd
    mem_bwd = memory_time(hw, mem_bwd) + _fsdp_copies(st, dt, hw) + fp4_bwd
    return MicroBatchCompute(gemm=gemm_fwd + gemm_bwd, attention=attn_fwd + attn_bwd,
                             memory_bound=mem_fwd + mem_bwd, forward=gemm_fwd + attn_fwd + mem_fwd,
                             backward=gemm_bwd + attn_bwd + mem_bwd, tp_gather_gemm=tp_gather,
                             tp_scatter_gemm=tp_scatter)


def _split_windows(split: str | None, how: str, again: bool, one: float, dgrad: float,
                   wgrad: float) -> tuple[float, float]:
    """What a linear's GEMMs add to the matmuls beside tensor parallel's gathers and reduce-scatters: a column-
    parallel linear's forward (and its recomputation) reads a gather, its input gradient feeds a reduce-scatter;
    a row-parallel one's forward feeds a reduce-scatter (recomputed with it only in a checkpointed block: the per-op
    policy keeps the reduce-scatter's output), its backward reads the gathered output gradient."""
    if split == "column":
        return one + (one if again else 0.0), dgrad
    if split == "row":
        return dgrad + wgrad, one + (one if how == "block" else 0.0)
    return 0.0, 0.0


def _block_gemms(st: Stage, moe: bool, how: str, hw: Hardware, precision: str, elem: float, base: str,
                 a: float, chunks: int = 1, recipe: str = "", saves_no_matmul: bool = False,
                 fused_qkv: bool = False) -> tuple[float, float, float, float]:
    """Forward and backward GEMM time of one built-in block: its seven linears (attention's four when its FFN is
    a mixture of experts, whose GEMMs follow; wq, wk and wv as one under `fused_qkv`), recomputed as `how` says,
    each at `precision` where `recipe` converts it and in `base` where its dims keep it out
    (`low_precision.converts`); and of them, the matmuls beside tensor parallel's gathers and reduce-scatters
    (`_split_windows`). `saves_no_matmul`: the per-op policy keeps none of its matmuls' outputs (an NVFP4 block),
    so backward runs every forward GEMM again but w2's, whose output only joins the residual sum."""
    t = st.tokens
    linears, low = st.block_linears(fused_qkv=fused_qkv), block_converts(st, recipe, fused_qkv)
    # The per-op policy runs every other matmul again: wk, wo, w3 of wq, wk, wv, wo, w1, w3, w2 (wo, w3 of wqkv, wo,
    # w1, w3, w2).
    recomputed_op = {1, 3} if fused_qkv else {1, 3, 5}
    if saves_no_matmul:
        recomputed_op = set(range(len(linears) - 1))
    row_parallel = {len(linears) - 4, len(linears) - 1}  # wo and w2: their outputs reduce-scattered
    fwd = bwd = gathered = scattered = 0.0
    for i, (fan_in, fan_out) in enumerate(linears[:len(linears) - 3] if moe else linears):
        fmt, size = (precision, elem) if low[i] else (base, a)
        one, dgrad, wgrad = linear_parts(hw, fmt, t, fan_in, fan_out, size, chunks)
        again = how == "block" or (how == "op" and i in recomputed_op)
        fwd += one
        bwd += dgrad + wgrad + (one if again else 0.0)
        g, s = _split_windows("row" if i in row_parallel else "column", how, again, one, dgrad, wgrad)
        gathered, scattered = gathered + g, scattered + s
    if moe:
        # Low precision converts neither the router nor the routed experts (engine/parallel/float8.py): their
        # GEMMs stay in bf16; the shared expert, an nn.Linear trio, runs as attention does.
        shared = (precision, elem) if low[-3] else (base, a)  # the dense FFN's shapes: w1's answer
        moe_fwd, moe_bwd = _moe_gemms(st, hw, base, a, how == "block", *shared)
        fwd, bwd = fwd + moe_fwd, bwd + moe_bwd
    return fwd, bwd, gathered, scattered


def _traced_gemms(st: Stage, block: BlockProfile, how: str, hw: Hardware, precision: str, elem: float, base: str,
                  a: float, chunks: int = 1, saves_no_matmul: bool = False) -> tuple[float, float, float, float]:
    """Forward and backward GEMM time of one traced block: each of its linears at its traced shape, split as the
    plan says; under the per-op policy every other one (in the order they ran) recomputed, or every one but the
    last where the policy keeps none of them (`saves_no_matmul`, an NVFP4 block). Its routed experts (no linears
    of their own) as one GEMM of their traced forward FLOPs, in bf16, whole on every tp rank."""
    t = st.tokens
    fwd = bwd = gathered = scattered = 0.0
    last = len(block.gemms) - 1
    for i, g in enumerate(block.gemms):
        fan_in, fan_out = g.fans(st.cfg.tp)
        one, dgrad, wgrad = (g.count * x for x in linear_parts(hw, precision, t, fan_in, fan_out, elem,
                                                                chunks if g.split else 1))
        # The op policy keeps every other matmul's output.
        again = how == "block" or (how == "op" and (i < last if saves_no_matmul else i % 2))
        fwd += one
        bwd += dgrad + wgrad + (one if again else 0.0)
        w_g, w_s = _split_windows(g.split, how, again, one, dgrad, wgrad)
        gathered, scattered = gathered + w_g, scattered + w_s
    if block.expert_params:
        linears = sum(2 * g.n * g.k * g.count for g in block.gemms if g.split is None) * st.profile.seq_len
        experts = max(block.replicated_forward_flops - linears, 0.0) * st.profile.per_token(t)
        width = max(1, round(experts / (2 * t * st.profile.dim)))
        one = linear_time(hw, base, t, st.profile.dim, width, a, backward=False)
        fwd += one
        bwd += linear_time(hw, base, t, st.profile.dim, width, a, forward=False) + one * (how == "block")
    return fwd, bwd, gathered, scattered


def _moe_gemms(st: Stage, hw: Hardware, precision: str, elem: float, recompute: bool, shared_precision: str,
               shared_elem: float) -> tuple[float, float]:
    """A MoE FFN's GEMMs (replicated over tp): the router (fp32) and each local expert's SwiGLU over its even
    share of the routed tokens at `precision`, and the shared expert over every token at `shared_precision` (an
    nn.Linear, which low-precision training converts as it does attention's)."""
    cfg, m, t = st.cfg, st.shape, st.tokens
    rows = max(1, assignments(st) * cfg.ep // m.n_experts)
    experts = m.n_experts // cfg.ep
    mlp = [(m.dim, m.hidden_dim), (m.dim, m.hidden_dim), (m.hidden_dim, m.dim)]
    fwd = linear_time(hw, "fp32", t, m.dim, m.n_experts, 4, backward=False)
    bwd = linear_time(hw, "fp32", t, m.dim, m.n_experts, 4, forward=False)
    for fan_in, fan_out in mlp:
        fwd += experts * linear_time(hw, precision, rows, fan_in, fan_out, elem, backward=False)
        bwd += experts * linear_time(hw, precision, rows, fan_in, fan_out, elem, forward=False)
        if m.shared_expert:
            fwd += linear_time(hw, shared_precision, t, fan_in, fan_out, shared_elem, backward=False)
            bwd += linear_time(hw, shared_precision, t, fan_in, fan_out, shared_elem, forward=False)
    return fwd, bwd + (fwd if recompute else 0.0)


def _fsdp_copies(st: Stage, dt: Dtypes, hw: Hardware) -> float:
    """FSDP2's copies per micro-batch: each gather copies the shard in and the gathered parameters out (2 ×
    their bytes), each reduce-scatter copies the unsharded gradient into its input in the reduce dtype."""
    cfg = st.cfg
    if cfg.zero < 2 or st.sync == 1:
        return 0.0
    gathers = 2 if cfg.zero == 3 else 1
    return memory_time(hw, gathers * 2 * dt.gathered_bytes(st.params, st.root) + st.params * (dt.compute + 4))


def optimizer_time(st: Stage, hw: Hardware) -> float:
    """The optimizer's step over this rank's share of the parameters (÷ the shard group from ZeRO 1): memory-bound,
    its bytes per parameter by Config.optimizer."""
    cfg = st.cfg
    share = st.params // (st.shard_ranks if cfg.zero >= 1 else 1)
    per_param = STEP_BYTES_PER_PARAM[cfg.optimizer] + (DECAY_BYTES_PER_PARAM[cfg.optimizer] if cfg.weight_decay else 0)
    return memory_time(hw, per_param * share)
