"""How a GEMM whose output tiles do not fill the SMs spreads over them: its K loop shared out (split-K / Stream-K).

A GEMM with fewer output tiles than SMs (a weight gradient, out × in with K = the tokens; a skinny tp shard) would
run each tile's whole K loop on one SM and leave the rest idle. CUTLASS's Hopper kernels and cuBLAS split such a
GEMM along K instead: Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix
Multiplication on the GPU" (PPoPP 2023, arXiv 2301.03598) give each of g work units an even share of all the
tiles' K iterations (MAC-loop steps of one k-tile); a tile covered by several units is finished by one of them,
which adds its peers' fp32 partial tiles (the "fixup"). The paper picks g with a model of the same form as the one
here: iterations per unit times an iteration's time, plus a cost per peer that the finishing unit waits for. With
many peers per tile a separate reduction is cheaper (CUTLASS's `should_perform_separate_reduction`; cuBLAS's
classic split-K): every partial written at once, then a second kernel reduces them with the whole device.

Constants, from CUTLASS (include/cutlass/gemm/kernel/tile_scheduler_params.h, the SM90 Stream-K scheduler, and
device/default_gemm_configuration.h):
- a k-tile is 128 bytes of K for tensor-core kernels (the SM90 kernels' tile shapes 128×256×64 for 16-bit inputs,
  ×32 for tf32, ×128 for fp8) and 8 elements for fp32 without tensor cores (the SIMT default, 128×128×8);
- partial tiles are fp32 accumulators (`get_reduction_workspace_size`: accumulator bits × tile area), written by
  each peer and read back by the finisher in order (CUTLASS's deterministic reduction serialises the peers).
The partials move at the SM's share of the memory's streaming rate (they usually stay in L2, which is faster: an
upper bound on the fixup). CUTLASS's own heuristic keeps units at ≥ 8 k-tiles (`min_iters_per_sk_unit_`) and
stays data-parallel when the tail wave is at least half full; choosing the fastest g under the fixup cost makes the
same trade without a threshold, and keeps a GEMM's time monotone in K.
"""

from __future__ import annotations

import functools

K_TILE = {"fp32": 8, "tf32": 32, "bf16": 64, "fp16": 64, "fp8": 128, "mxfp8": 128, "nvfp4": 256}
"""Elements of K one main-loop iteration consumes, by the precision a GEMM runs at (see the module docstring):
128 bytes of K, so 256 four-bit NVFP4 elements."""
ACCUMULATOR_BYTES = 4
"""fp32 accumulators: what a partial tile holds, whatever the inputs' precision."""


def k_tile(precision: str) -> int:
    """One k-tile of a GEMM at `precision` ("fp8_*" recipes run the fp8 kernels)."""
    return K_TILE["fp8" if precision.startswith("fp8") else precision]


@functools.lru_cache(maxsize=4096)
def split_k_time(tiles: int, k_tiles: int, iteration_s: float, partial_s: float, sms: int, launch_s: float) -> float:
    """Seconds of `tiles` output tiles (tiles < sms), each `k_tiles` iterations of `iteration_s` on one SM, spread
    over the fastest number g of work units (tiles ≤ g ≤ sms): the busiest unit's ceil(tiles·k_tiles / g)
    iterations, plus the fixup, the cheaper of the finisher adding its ceil(g / tiles) − 1 peers' partials in turn
    (`partial_s` each: one SM's share of the memory) and a separate reduction (the g − tiles partials at the whole
    device's rate, plus a second kernel's `launch_s`).

    g = tiles is the data-parallel kernel (one unit per tile, no fixup), so splitting is never slower than it; the
    cost of each g grows with K and the choice of g does not depend on K, so the time is monotone in K."""
    total = tiles * k_tiles
    best = k_tiles * iteration_s
    for units in range(tiles + 1, min(sms, total) + 1):
        serial = (-(-units // tiles) - 1) * partial_s
        separate = (units - tiles) * partial_s / sms + launch_s
        best = min(best, -(-total // units) * iteration_s + min(serial, separate))
    return best
