"""What a run holds tensors in and which kernels it runs, and the features of published runs this engine lacks.

`Features` are estimate-only options: a published setting the estimator models on request before the engine has
it (`wb.estimate(cfg, hw, features=Features(loss_parallel=True))`). What the engine runs itself is read from the
Config: torch.compile (`Config.compile`), 8-bit linears (`Config.precision` "fp8_tensorwise", "fp8_rowwise",
"mxfp8"; with tensor parallel too), async TP (`Config.async_tp`).
`Dtypes` is the byte size of each kind of tensor a layout makes, and the kernels that decide them.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import FP8, Config, converts, low_precision_recipe
from workbench.config.params import block_linears


@dataclass(frozen=True)
class Features:
    """Published-run settings beyond this engine, modelled by the estimator only (the engine refuses nothing
    here because it never sees them)."""

    compile_loss: bool = False
    """torch.compile of the loss too (torchtitan compiles it with the model since 2025; Config.compile compiles
    the blocks only): the cross-entropy fused into kernels that keep the logits and a log-sum-exp per token instead
    of fp32 log-probabilities."""
    loss_parallel: bool = False
    """tensor parallel keeps the logits split over the vocabulary for the loss (torchtitan's default with tp):
    no all-gather of the logits, each rank's loss tensors 1/tp of the vocabulary."""
    op_keeps_attention: bool = True
    """The per-op selective policy (Config.activation_checkpointing "op") keeps attention's output and log-sum-exp,
    as this engine's does and torchtitan's `_save_list` does for SDPA's flash and memory-efficient kernels. False
    where the run's attention kernel is not in that list, so backward runs attention's forward again and keeps
    nothing of it: torchtitan from 6fc499f (August 2025) calls SDPA's cuDNN kernel first on Blackwell (compute
    capability 10.0; `models/attention.py`), which its save list (`models/llama3/infra/parallelize.py`) does not
    name. The built-in blocks' kept bytes drop by it; a traced model's are what its trace saw."""
    float8_saves_fp8_inputs: bool = False
    """torchao before January 2025 (pytorch/ao PR 1461): its tensorwise Float8 linear saved fp8 copies of its inputs
    for backward (`manual_float8_matmul_with_args_in_float8`: `save_for_backward(input_fp8, weight_fp8_t)`), so a
    block kept 1-byte linear inputs, w2's input as an fp8 copy beside SwiGLU's bf16 outputs, and wo's. From then on
    (torchao 0.13+, which this engine runs) every recipe saves the bf16 input and casts again in backward: a
    block of 8-bit linears saves what its bf16 self does. True for runs of the older stack (torchtitan's December
    2024 tables)."""
    nvfp4: float = 0.0
    """Share of the blocks, the first ones, whose linears run NVFP4 (torchao's NVFP4 training prototype on
    Blackwell: e2m1 elements with an fp8 scale per 16 and one fp32 scale per tensor; torchtitan's recipe
    llama3_8b_first_85_pct_layers_nvfp4 is 0.85, the last blocks and the head kept in bf16): their GEMMs at the
    device's FP4 rate, their operands cast per 16-element block along each GEMM's reduction dim; the weights and
    every collective stay bf16. 0: none.

    Under the per-op policy such a block keeps its input and attention's output only: torchao's NVFP4 linear
    (`nvfp4_mm_triton`, prototype/moe_training/nvfp4_training/nvfp4_linear.py) multiplies with F.scaled_mm
    (aten._scaled_mm_v2) after Triton quantize kernels, none of which the policy's save list names (torch's
    compute-intensive ops name aten.mm and aten._scaled_mm, torchtitan's policy counts aten.mm and aten.linear),
    and under torch.compile what the policy does not save is recomputed (`must_recompute` in
    torch/_functorch/partitioners.py takes PREFER_RECOMPUTE as a must). Backward runs its forward GEMMs and casts
    again, all but the last GEMM (w2, whose output reaches only the residual sum)."""

    loss_chunks: int = 0
    """The head and the loss run over the tokens in this many chunks, each chunk's backward at once
    (torchtitan's chunked loss, components/loss.py: ChunkedCELoss from April 2026, ChunkedLossWrapper from June,
    8 chunks, the loss of its llama3 and qwen3 configs): the logits and the loss's tensors exist for one chunk at
    a time; the hidden states are copied into the chunks and the chunks' gradients gathered into one fp32 buffer
    (`GradAccumulator`), which backward then takes into the blocks. 0: one loss over every token."""
    fused_qkv: bool = False
    """Attention's q, k and v projections run as one linear (torchtitan's `wqkv`, its llama3 and qwen3 models'
    default from 3396a4b37, June 2026): one GEMM of fan-out q + 2·kv, and the per-op policy, which keeps every
    other matmul's output, counts five matmuls where the built-in block runs seven: wqkv, w1 and w2 kept, wo and
    w3 run again (instead of wq, wv, w1, w2 kept). The built-in model only: a traced model runs its own linears."""
    low_precision_head: bool = False
    """The head (the output projection) runs in the Config's 8-bit format too: torchtitan's MXFP8 converter, given
    no module names, converts every `Linear.Config`, `lm_head` included (`llama3_8b_mxfp8`, bcc09297a, the August
    2026 GB200 table), where its Float8 recipes and this engine keep the head in bf16. Its three GEMMs run at the
    format's rate and its input and the logits' gradient are cast as a block linear's are. Needs an 8-bit
    Config.precision (NVFP4's recipe keeps the head in bf16)."""
    fsdp_edge_units: bool = False
    """Under ZeRO 3, FSDP2 shards the embedding and the final norm with the head as units of their own, the root left
    holding none (torchtitan from 83e694105, pytorch/torchtitan PR 1094, July 2025: `apply_fsdp` wraps
    `tok_embeddings`, resharded after forward like a block, and `[norm, output]`, kept gathered from forward to its
    backward). This engine, like torchtitan before it, keeps all three in the root, gathered from the first forward
    to the end of backward (FSDP2's root rule: its lazy init keeps the root gathered after forward). With the units
    apart the embedding is gathered again for its backward, at backward's end, and the head's gradient is
    reduce-scattered as soon as the head's backward ends, its fp32 reduce-scatter input held until the next
    unit's (torch's `reduce_scatter_max_input_buffers`, 1), not the whole backward."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.nvfp4 <= 1.0:
            raise ValueError(f"Features.nvfp4 is a share of the blocks in [0, 1], got {self.nvfp4}")
        if self.loss_chunks < 0:
            raise ValueError(f"Features.loss_chunks is a number of chunks (0 for none), got {self.loss_chunks}")

    def describe(self) -> str:
        on = [name for name in ("compile_loss", "loss_parallel", "float8_saves_fp8_inputs") if getattr(self, name)]
        if not self.op_keeps_attention:
            on.append("op_recomputes_attention")
        if self.nvfp4:
            on.append(f"nvfp4 {self.nvfp4:.0%} of blocks")
        if self.loss_chunks:
            on.append(f"loss in {self.loss_chunks} chunks")
        if self.fused_qkv:
            on.append("fused qkv")
        if self.low_precision_head:
            on.append("8-bit head")
        if self.fsdp_edge_units:
            on.append("FSDP edge units")
        return "+".join(on) if on else "none"

    def runs_nvfp4(self, layer: int, n_layers: int) -> bool:
        """Whether block `layer` of a model of `n_layers` runs NVFP4: the first `nvfp4` share of them (torchtitan's
        recipe keeps the last blocks bf16)."""
        return layer < round(self.nvfp4 * n_layers)


NO_FEATURES = Features()


def fsdp_mixed_precision(cfg: Config) -> bool:
    """Whether FSDP2's MixedPrecisionPolicy casts the parameters for compute (bf16/fp16 under ZeRO 2/3 with
    Config.mixed_precision "fsdp"), instead of autocast casting them per use."""
    return cfg.mixed_precision == "fsdp"  # Config allows it only with bf16 (or fp8) under ZeRO 2/3


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each kind of tensor a layout makes on the device, and the kernels behind them."""

    compute: int
    """Matmul outputs and what attention and the MLP save: 2 under bf16/fp16 (and fp8's bf16), else 4."""
    residual: int
    """The residual stream between blocks (and what norms save of it): fp32 under autocast, whose embedding
    output is fp32 and whose residual adds promote; the parameters' dtype under FSDP mixed precision."""
    gathered: int
    """Bytes per block parameter FSDP2 all-gathers and holds unsharded: fp32 under autocast, the compute dtype under
    mixed precision, 1 with the float8 all-gather (tensorwise scaling, Config.fp8_all_gather)."""
    gathered_root: int
    """The same for the parameters outside the blocks (embedding, final norm, head): never Float8 weights (the
    engine, like torchtitan's `filter_fqns=["output"]`, converts the blocks' linears only), so gathered in the
    parameters' dtype under mixed precision even with the float8 all-gather."""
    weight_copies: bool
    """Autocast keeps a 2-byte copy of every weight it casts, saved for backward, per micro-batch in flight."""
    mixed_precision: bool
    float8: bool = False
    """The blocks' linears are torchao 8-bit linears (Float8 or MX): their GEMMs run at the fp8 rate on fp8
    operands."""
    fused: bool = False
    """torch.compile (inductor) fuses each block's elementwise ops into few kernels (Config.compile)."""
    recipe: str = ""
    """How the 8-bit linears scale: "tensorwise", "rowwise", "mx" (a scale per 32 along the reduction dim);
    "" without them."""

    def gathered_bytes(self, elements: int, root: int) -> int:
        """Bytes FSDP2 gathers and holds for `elements` parameters, `root` of them outside the blocks."""
        return self.gathered * (elements - root) + self.gathered_root * root


def float8(cfg: Config) -> bool:
    """Whether the blocks' linears run in 8 bits: an fp8 or MX precision, on a model at least one of whose block
    linears the engine converts (a built-in model whose every dim misses config's `CONVERTED_MULTIPLE` runs in bf16; a
    traced model's linears are taken as converted)."""
    if cfg.precision not in FP8:
        return False
    try:
        linears = block_linears(cfg.model)
    except AttributeError:
        return True
    recipe = low_precision_recipe(cfg.precision)
    return any(converts(fan_in, fan_out, recipe) for fan_in, fan_out in linears)


def dtypes(cfg: Config, features: Features = NO_FEATURES) -> Dtypes:
    low = cfg.precision in ("bf16", "fp16", *FP8)
    mp = fsdp_mixed_precision(cfg)
    a = 2 if low else 4
    f8 = float8(cfg)
    recipe = low_precision_recipe(cfg.precision) if f8 else ""
    # torchao's float8 FSDP all-gather is the tensorwise recipe's, when asked for (engine/parallel/float8.py).
    f8_gather = recipe == "tensorwise" and cfg.zero >= 2 and cfg.fp8_all_gather
    return Dtypes(compute=a, residual=a if mp else 4,
                  gathered=1 if f8_gather else a if mp else 4, gathered_root=a if mp else 4,
                  weight_copies=low and not mp and not f8, mixed_precision=mp, float8=f8,
                  fused=cfg.compile and cfg.compile_backend == "inductor", recipe=recipe)
