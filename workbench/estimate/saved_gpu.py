"""Activations as CUDA kernels save them: what one micro-batch leaves for backward on a GPU, block by block.

Per token of a micro-batch, with D = dim, K = kv_heads·head_dim, F = hidden_dim, A = heads, r the residual
stream's bytes, a the compute dtype's, c what a linear saves of its input (`options.Dtypes`); "÷tp" where
sequence parallel or the head split shards it, whole where tensor parallel gathers the sequence:

  no recomputation        two fused RMSNorms: input + 1/rms (fp32 per row)      2·(r·D + 4) ÷tp
                          projection inputs (the gathered norm outputs)          2·c·D
                          flash attention: rotated q, k, v, output, logsumexp    (a·(2D + 2K) + 4A) ÷tp
                          SwiGLU: w1 out, silu out, w3 out, product              4·a·F ÷tp
                          (+ under autocast, the 2-byte copy of every weight)
  per-op ("op", torchtitan's selective op policy: every other mm output and the attention output kept, the rest
  recomputed): block input r·D ÷tp; wq, wv, w1 outputs a·(D + K + F) ÷tp; w2's mm output a·D whole (before its
  reduce-scatter) ; attention output + logsumexp (a·D + 4A) ÷tp (none where the policy does not name the attention
  kernel: `Features.op_keeps_attention`); under tp the two reduce-scatter outputs 2·a·D ÷tp
  checkpointed block       its input, r·D ÷tp

Flash attention (torch's SDPA on CUDA) keeps no seq² scores: only its output and the log-sum-exp. A norm is
one fused kernel (torch's CUDA rms_norm) that saves its input and 1/rms. Under tensor parallel DTensor
all-gathers a norm's output before the projections and the matmul saves the gathered tensor: sequence parallel
keeps the norms' inputs sharded, not the projections' inputs (Megatron's own implementation re-gathers those in
backward instead; torch's does not). A mixture-of-experts FFN adds what `expert.moe_activations` counts.
"""

from __future__ import annotations

from collections import Counter

from workbench.estimate.expert import moe_activations
from workbench.estimate.options import Dtypes, Features
from workbench.estimate.recompute import input_only, op_block, op_block_unsaved_matmuls, policy
from workbench.estimate.stage import Stage


def whole_block(st: Stage, dt: Dtypes, features: Features) -> int:
    """Bytes a dense block saves for one micro-batch without recomputation. A block of 8-bit linears saves the
    same (torchao's Float8 and MX linears keep their high-precision input and weight for backward and cast them
    again there: `save_for_backward(input_hp, weight_hp...)` in torchao/float8/float8_linear.py and
    prototype/mx_formats/mx_linear.py), except on torchao's tensorwise path of 2024
    (`Features.float8_saves_fp8_inputs`), which kept fp8 copies of its inputs."""
    m, tp, a, r = st.shape, st.cfg.tp, dt.compute, dt.residual
    kv = m.kv_heads * m.head_dim
    copies_fp8 = features.float8_saves_fp8_inputs and dt.recipe == "tensorwise"
    c = 1 if copies_fp8 else a  # what a linear keeps of its input (attention's and the FFN's, gathered under tp)
    mlp = (3 * a + 1 if copies_fp8 else 4 * a) * m.hidden_dim  # w2's input an fp8 copy on the 2024 path
    wo = m.dim if copies_fp8 else 0  # and wo's, beside the attention output attention keeps
    sharded = 2 * (r * m.dim + 4) + a * (2 * m.dim + 2 * kv) + 4 * m.n_heads + mlp + wo
    copies = 2 * st.block_matmul if dt.weight_copies else 0
    return round(st.tokens * (sharded / tp + 2 * c * m.dim)) + copies


def _kind(st: Stage, features: Features, layer: int) -> tuple[str, bool, bool]:
    """What decides what block `layer` saves: its policy, whether its FFN is a mixture of experts, whether its
    linears run NVFP4."""
    return policy(st, layer), st.shape.is_moe_layer(layer), features.runs_nvfp4(layer, st.shape.n_layers)


def _example(st: Stage, features: Features, layers: tuple[int, ...], kind: tuple[str, bool, bool]) -> int:
    """A block of `layers` of the given kind (`_kind`)."""
    return next(i for i in layers if _kind(st, features, i) == kind)


def largest_rebuilt(st: Stage, dt: Dtypes, features: Features) -> int:
    """The most `rebuilt` holds over this rank's blocks (0 without blocks)."""
    kinds = {_kind(st, features, i) for i in st.layers}
    return max((rebuilt(st, dt, features, _example(st, features, st.layers, k)) for k in kinds), default=0)


def layer_saved(st: Stage, dt: Dtypes, features: Features, layer: int) -> int:
    """Bytes block `layer` keeps from its forward to its backward, for one micro-batch."""
    how, is_moe, fp4 = _kind(st, features, layer)
    moe = moe_activations(st) if is_moe else 0
    if how == "block":
        return input_only(st, dt)
    if how == "op" and fp4:
        return op_block_unsaved_matmuls(st, dt, layer, features.op_keeps_attention) + moe
    if how == "op":
        return op_block(st, dt, layer, features.op_keeps_attention, features.fused_qkv) + moe
    return whole_block(st, dt, features) + moe


def rebuilt(st: Stage, dt: Dtypes, features: Features, layer: int) -> int:
    """What backward holds beyond the block's kept bytes while it backpropagates block `layer`: the recomputed
    activations (none without recomputation) and the gradients of its activations, for one micro-batch.

    The gradient working set is taken as one gradient per SwiGLU tensor in flight (3·a·F ÷tp), two gathered
    D-wide ones and the residual's, a stated approximation of autograd's buffers."""
    m, tp, a, r = st.shape, st.cfg.tp, dt.compute, dt.residual
    grads = round(st.tokens * (3 * a * m.hidden_dim / tp + 2 * a * m.dim + 2 * r * m.dim / tp))
    whole = whole_block(st, dt, features) + (moe_activations(st) if m.is_moe_layer(layer) else 0)
    return max(0, whole - layer_saved(st, dt, features, layer)) + grads


def logits_width(st: Stage, features: Features) -> int:
    """Vocabulary entries per token of the loss's tensors on this rank: gathered, or 1/tp with loss parallel."""
    v = st.shape.vocab_size
    return -(-v // st.cfg.tp) if features.loss_parallel else v


def loss_kept(st: Stage, features: Features, a: int) -> int:
    """Bytes per token the loss keeps from its forward to its backward: the fp32 log-probabilities, or a compiled
    loss's logits and log-sum-exp."""
    v = logits_width(st, features)
    return a * v + 4 if features.compile_loss else 4 * v


def edge_saved(st: Stage, dt: Dtypes, features: Features, first: bool, last: bool) -> int:
    """Bytes saved outside the blocks for one micro-batch: token ids (first stage); the final norm's input and
    1/rms, the head's input, what the loss keeps and the targets (last stage), and under autocast the head's
    weight copy. A chunked loss (`Features.loss_chunks`) has run its backward before the blocks': it leaves the
    fp32 gradient of the hidden states instead of the head's input and the loss's tensors."""
    m, tp, a, r = st.shape, st.cfg.tp, dt.compute, dt.residual
    saved = 8 * st.tokens if first else 0
    if last:
        head = 4 * m.dim if features.loss_chunks else a * m.dim + loss_kept(st, features, a)
        per_token = (r * m.dim + 4) / tp + head + 8
        saved += round(st.tokens * per_token) + (2 * st.head if dt.weight_copies else 0)
    return saved


def stage_saved(st: Stage, dt: Dtypes, features: Features) -> dict[int, int]:
    """Bytes one micro-batch leaves saved in each pipeline stage this rank holds, by global stage index (the
    received input is a receive buffer, as on CPU: `activations.stage_activations`)."""
    def kept(layers: tuple[int, ...]) -> int:
        # Blocks alike (same recomputation, dense or MoE) keep alike: one of each kind, times how many.
        kinds = Counter(_kind(st, features, i) for i in layers)
        return sum(n * layer_saved(st, dt, features, _example(st, features, layers, kind))
                   for kind, n in kinds.items())

    return st.saved_by_stage(kept, lambda first, last: edge_saved(st, dt, features, first, last), input_only(st, dt))


def loss_transients(st: Stage, dt: Dtypes, features: Features) -> tuple[int, int]:
    """The loss's working sets on the last stage beyond what it saves, for one micro-batch: (forward, backward).

    With the logits gathered, torch's fused log_softmax kernel: forward holds the logits in the compute dtype
    (and, gathered under tp, the local slice beside them) and their fp32 copy (the loss upcasts; none when they
    are fp32); backward holds nll_loss's gradient and log_softmax's, each fp32 and as wide as the log-probs.
    With loss parallel, torch's decomposition (torch/distributed/tensor/parallel/loss.py `_log_softmax`,
    `_nll_loss_and_log_softmax_backward`) also holds the shifted logits and their exp in forward, and in
    backward a zero gradient, the exp and their sum: two and three fp32 tensors. A compiled loss fuses it all:
    only its bf16 gradient in backward. A chunked loss (`Features.loss_chunks`) holds one chunk's share of these
    and of what the loss keeps, beside the hidden states and their copy in chunks."""
    if not st.last:
        return 0, 0
    if features.loss_chunks:
        # One chunk at a time: its head input and what its loss keeps, beside its loss's working set; all the
        # while the hidden states and their chunked copies (the compute dtype).
        chunk = -(-st.tokens // features.loss_chunks)
        held = 2 * st.tokens * dt.compute * st.shape.dim
        kept = chunk * (dt.compute * st.shape.dim + loss_kept(st, features, dt.compute))
        fwd, bwd = _loss_working(st, dt, features, chunk)
        return held + kept + fwd, held + kept + bwd
    return _loss_working(st, dt, features, st.tokens)


def _loss_working(st: Stage, dt: Dtypes, features: Features, tokens: int) -> tuple[int, int]:
    v, a, tp = logits_width(st, features), dt.compute, st.cfg.tp
    if features.compile_loss:
        return 0, tokens * a * v
    local = a * -(-st.shape.vocab_size // tp) if tp > 1 and not features.loss_parallel else 0
    upcast = 4 * v if a < 4 else 0
    if features.loss_parallel and tp > 1:
        return tokens * (a * v + upcast + 4 * v), tokens * 12 * v
    return tokens * (a * v + local + upcast), tokens * 8 * v
