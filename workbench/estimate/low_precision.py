"""8-bit and 4-bit linears (Config.precision "fp8_tensorwise", "fp8_rowwise", "mxfp8"; Features.nvfp4): the rate
their GEMMs run at, and the bytes their casts read and write.

Each GEMM of such a linear multiplies two low-precision operands, each scaled along the GEMM's reduction dim, so
every operand of the three GEMMs (forward x·wᵀ, input gradient dy·w, weight gradient dyᵀ·x) is cast from bf16
first. What a cast costs, per element, depends on where its scale comes from (torchao's recipes,
torchao/float8/float8_linear.py and torchao/prototype/mx_formats; inductor fuses each cast into one kernel or two):

- a scale per tensor (tensorwise): the tensor's absolute maximum first (a reduction over all of it: one read),
  then the cast (a read and a one-byte write): 2a + 1 bytes. torch._scaled_mm wants its first operand row-major and
  its second column-major, so the weight gradient's operands are transposed copies of the forward's and the
  backward's casts (a one-byte read and write each);
- a scale per row (rowwise): a row's maximum and its cast in one pass (a + 1) for the operands scaled along their
  rows; the weight gradient's are scaled along the tokens (columns), a reduction over every row first: 2a + 1, written
  transposed. Backward's two GEMMs (which torchao runs without fast accumulation) do not take their row scales in
  the GEMM: torch's rowwise kernel (CUTLASS) is "so slow without fast-accum" that torchao calls the tensorwise
  cuBLAS kernel with unit scales and multiplies its output by the scales afterwards (`addmm_float8_unwrapped`,
  torchao/float8/float8_ops.py, in every release from PR 1325, Nov 2024, to 0.13), which under compile is "at least
  one extra triton kernel per GEMM" (pytorch/ao issue 2184): each input gradient and weight gradient read and
  written once more (2a bytes an element);
- a scale per block of 32 (MX, OCP microscaling) along the reduction dim: each block's maximum and cast in one
  pass, along rows or, for the weight gradient, columns (torchao's dim-1 cast kernel writes the transposed layout
  itself): a + 1 plus a scale byte per block.

NVFP4's casts (a scale per block of 16, and one per tensor) are torchao's Triton kernels (`nvfp4_mm_triton`, its
default KernelPreference.TRITON), whose measured times `nvfp4_cast_time` takes instead of bytes at the memory's
rate: a randomized Hadamard transform before quantizing, and stochastic rounding in backward, run them at a fifth
to a third of the HBM rate.

Which operands are cast once: a block's projections share their input (wq, wk, wv; w1, w3), which compiled code
casts once (the three identical casts are one expression to inductor) and torchao's Float8 tensor-parallel styles
cast once before gathering it; eager code casts it per linear. Recomputation (op or block policy) casts the forward's
inputs again: the casts are not in the per-op policy's save list, so backward rebuilds them.
"""

from __future__ import annotations

from workbench.config import converts
from workbench.estimate.options import Dtypes
from workbench.estimate.stage import Stage

MX_SCALE_BLOCK = 32
"""Elements per scale along the reduction dim of the OCP MX formats (an e8m0 scale each)."""


def _per_element(small: tuple[int, float], large: tuple[int, float]) -> tuple[float, float]:
    """(seconds per call, seconds per element) of a kernel timed at two sizes (elements, µs): the line through
    them, its fixed part a call's launch and tail."""
    (n1, t1), (n2, t2) = small, large
    slope = (t2 - t1) / (n2 - n1) * 1e-6
    return t1 * 1e-6 - slope * n1, slope


# torchao's NVFP4 training kernels on a GB200 (pytorch/ao PR 4369, 2026, "Run environment: NVIDIA GB200, PyTorch
# 2.13.0a0, Triton 3.7.0"; the same tables in benchmarks/prototype/nvfp4_training/README.md), each timed on a
# Llama 3 8B hidden-state input (2048 × 4096) and mlp.down input (2048 × 14336): µs. The 70B shapes of the same
# tables (2048 × 8192 and 2048 × 28672) lie on the lines within 6%. Taken for every Blackwell part.
NVFP4_AMAX = _per_element((2048 * 4096, 19.488), (2048 * 14336, 31.744))
"""`triton_rht_amax`: the Hadamard-transformed input's row and column maxima (the two per-tensor scales)."""
NVFP4_QUANTIZE = _per_element((2048 * 4096, 31.072), (2048 * 14336, 65.856))
"""`triton_rht_quantize_row_col`, round to nearest (forward): the input's rowwise and columnwise NVFP4 codes with
their fp8 block scales, the columnwise ones Hadamard-transformed."""
NVFP4_QUANTIZE_SR = _per_element((2048 * 4096, 40.672), (2048 * 14336, 91.168))
"""The same kernel with stochastic rounding: backward's output gradient."""
NVFP4_WEIGHT = _per_element((2048 * 4096, 49.600), (2048 * 14336, 123.616))
"""`triton_weight_quantize_2d`: the weight in 16 × 16 blocks, rowwise and transposed codes (every forward)."""


def nvfp4_cast_time(linears: list[tuple[int, int, int]], tokens: int) -> tuple[float, float]:
    """Seconds of one NVFP4 block's casts per micro-batch of `tokens`, (forward, backward), from torchao's measured
    kernels: forward, each linear's input (the amax, then both codes) and its weight; backward, each output
    gradient (the amax, then both codes with stochastic rounding). Backward reuses the forward's columnwise input
    codes, saved or recomputed (a recomputation costs the forward again). `linears`: (count, fan-in, fan-out)."""
    forward = backward = 0.0
    for count, fan_in, fan_out in linears:
        x, w, dy = tokens * fan_in, fan_in * fan_out, tokens * fan_out
        forward += count * (sum(fixed + each * x for fixed, each in (NVFP4_AMAX, NVFP4_QUANTIZE))
                            + NVFP4_WEIGHT[0] + NVFP4_WEIGHT[1] * w)
        backward += count * sum(fixed + each * dy for fixed, each in (NVFP4_AMAX, NVFP4_QUANTIZE_SR))
    return forward, backward


def gemm_precision(dt: Dtypes, base: str, nvfp4: bool = False) -> tuple[str, float]:
    """The peak key and the operand bytes of a block's linear GEMMs: NVFP4, the 8-bit recipe's, or `base`."""
    if nvfp4:
        return "nvfp4", 0.5
    if dt.float8:
        return ("mxfp8" if dt.recipe == "mx" else "fp8"), 1
    return base, dt.compute


def _pass_bytes(recipe: str, a: int, along_tokens: bool) -> float:
    """Bytes one cast of one bf16 element reads and writes under `recipe`, scaled along its rows (False) or along
    the tokens, for the weight gradient (True)."""
    if recipe == "tensorwise":
        return 2 * a + 1
    if recipe == "rowwise":
        return 2 * a + 1 if along_tokens else a + 1
    if recipe == "mx":
        return a + 1 + 1 / MX_SCALE_BLOCK
    raise ValueError(f"no cast model for recipe {recipe!r}")


def block_converts(st: Stage, recipe: str, fused_qkv: bool = False) -> list[bool]:
    """Of the built-in block's seven linears (`Stage.block_linears`' order; five with `fused_qkv`), which run in
    low precision. A mixture of experts' shared expert has the dense FFN's shapes, so w1's entry answers for it."""
    return [converts(fan_in, fan_out, recipe) for fan_in, fan_out in st.block_linears(True, fused_qkv)]


def converted_linears(st: Stage, moe: bool = False, recipe: str = "",
                      fused_qkv: bool = False) -> list[tuple[int, int, int]]:
    """(count, fan-in, fan-out) on this rank of the built-in block's linears that run in low precision
    (engine/parallel/float8.py converts every nn.Linear but the head and a mixture of experts' router and experts,
    whose dims are multiples of config's `CONVERTED_MULTIPLE[recipe]`): all seven of a dense block; attention's four and the
    shared expert's three of a mixture of experts, whose FFN runs whole on every tp rank. `fused_qkv`: wq, wk and
    wv one linear (`Features.fused_qkv`)."""
    kept, linears, m = block_converts(st, recipe, fused_qkv), st.block_linears(fused_qkv=fused_qkv), st.shape
    attention = len(linears) - 3
    converted = [(1, fan_in, fan_out) for (fan_in, fan_out), k in zip(linears[:attention] if moe else linears, kept)
                 if k]
    if moe and m.shared_expert and kept[attention]:
        converted += [(2, m.dim, m.hidden_dim), (1, m.hidden_dim, m.dim)]
    return converted


def cast_bytes(st: Stage, dt: Dtypes, recipe: str, linears: list[tuple[int, int, int]] | None = None,
               moe: bool = False, fused_qkv: bool = False) -> tuple[float, float]:
    """Bytes per token one block's casts move, (forward, backward), on this rank; a recomputed block's
    recomputation costs its forward again. `recipe`: dt.recipe (NVFP4's are `nvfp4_cast_time`). `linears`: a
    traced block's (count, fan-in, fan-out) on this rank, each input cast on its own; None: the built-in block's
    (`converted_linears`; `moe`: its FFN a mixture of experts; `fused_qkv`: q, k and v one linear, its input cast
    once)."""
    tp, a = st.cfg.tp, dt.compute
    if linears is None and not all(block_converts(st, recipe)):
        # Some linears stay in bf16: each converted one casts its input on its own.
        linears = converted_linears(st, moe, recipe)
    if linears is not None:
        inputs = sum(n * fan_in for n, fan_in, _ in linears)
        outputs = sum(n * fan_out for n, _, fan_out in linears)
    else:
        m = st.shape
        d, q, kv, f = m.dim, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden_dim
        # Inputs (fan-in, per token on this rank) of the linears, the shared ones once or per linear; outputs
        # (fan-out) whose gradients are cast in backward.
        shared = dt.fused or (tp > 1 and recipe == "tensorwise")
        gathered = d / tp if tp > 1 and recipe == "tensorwise" else d  # cast before or after the sequence gather
        inputs = (1 if shared or fused_qkv else 3) * gathered + q / tp  # wq, wk, wv; wo
        outputs = (q + 2 * kv) / tp + gathered
        if not moe:  # w1, w3; w2
            inputs += (1 if shared else 2) * gathered + f / tp
            outputs += 2 * f / tp + gathered
        elif m.shared_expert:  # whole on every tp rank, its input gathered in bf16 as the routed experts' is
            inputs += (1 if dt.fused else 2) * d + f
            outputs += 2 * f + d
    forward = inputs * _pass_bytes(recipe, a, False)
    backward = outputs * _pass_bytes(recipe, a, False)
    if recipe == "tensorwise":
        backward += 2 * (inputs + outputs)  # the weight gradient's transposed copies of both casts
    else:
        backward += (inputs + outputs) * _pass_bytes(recipe, a, True)  # both operands cast again along the tokens
    if recipe == "rowwise":
        rescaled = linears if linears is not None else converted_linears(st, moe, recipe)
        backward += 2 * a * _rescaled_outputs(st, rescaled)
    return forward, backward


def _rescaled_outputs(st: Stage, linears: list[tuple[int, int, int]]) -> float:
    """Elements per token of one block's backward GEMM outputs on this rank: each linear's input gradient (its
    fan-in, on every token it reads) and its weight gradient (fan-in × fan-out, once a micro-batch)."""
    gradients = sum(n * fan_in for n, fan_in, _ in linears)
    weights = sum(n * fan_in * fan_out for n, fan_in, fan_out in linears)
    return gradients + weights / st.tokens
