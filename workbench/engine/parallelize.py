"""The one place that orders the parallelisms applied to a model (or one pipeline chunk of it)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import Config
from workbench.engine.mesh import mesh_axis
from workbench.engine.parallel.compile import apply_compile
from workbench.engine.parallel.context import apply_cp
from workbench.engine.parallel.data_parallel import apply_dp, gradient_mesh
from workbench.engine.parallel.expert import apply_ep
from workbench.engine.parallel.float8 import apply_float8
from workbench.engine.parallel.recompute import apply_ac
from workbench.engine.parallel.tensor import apply_tp
from workbench.models.protocol import CausalLM


def parallelize(model: CausalLM, mesh: DeviceMesh, cfg: Config,
                materialize: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Apply `cfg`'s layout to `model` on this rank's slice of `mesh`: fp8 → TP → CP → EP → AC → compile → DP/ZeRO.

    A model built on the meta device is laid out there, and `materialize(model)` then gives it this rank's pieces
    of its parameters: before DDP (zero 0/1), which wraps real parameters and where every dp rank holds them
    whole anyway; after FSDP2 (zero 2/3), which shards meta parameters, so a rank allocates only its shard.

    The order is forced:
    - TP first: its plans address submodules by their paths in the bare model
      ("attention.wq"), and it replaces parameters with DTensors, which every
      later step must see as the parameters.
    - AC next: it wraps whole blocks, TP collectives included, so recomputation
      re-runs them. It must precede DP, because FSDP2 has to treat the wrapped
      block as one unit (one all-gather serves the forward and its recomputation
      in backward) and DDP must wrap the finished module tree.
    - DP/ZeRO last: DDP and FSDP2 hook the parameters as they finally are, and
      FSDP2 shards TP's DTensors over the dp axis, making them 2-D (dp, tp).
    - CP after TP: it swaps only attention's kernel (`attention.core`, no
      parameters) for the ring exchange and the rotary table for this rank's
      positions; under TP that kernel runs on the rank's local heads, so the
      ring is per tp rank. Before AC, so recomputation re-runs the exchange,
      and before DP, whose gradient average then spans dp·cp ("dp_cp"): every
      cp rank holds the same weights and computed gradients from other tokens.
    - EP between TP and AC (torchtitan's order): it swaps each MoE layer's
      experts for this rank's slice, which AC must then recompute (all-to-alls
      included) and DP must see as the parameters, to sync them over "edp" only.
    - fp8 first (torchtitan's model converters): it swaps nn.Linear for torchao's
      Float8Linear in the bare model, so everything after sees the fp8 layers.
    - compile after AC and before DP (torchtitan's order): compiling the block as
      AC wrapped it puts the recomputation inside the compiled code; TP's DTensors
      are traced as they are (their collectives become part of the graph); FSDP2's
      per-block gathers and reduce-scatters, and DDP's bucket all-reduces, hook the
      compiled block from outside and run eagerly between blocks, where they overlap.
    """
    model = apply_float8(model, cfg)
    model = apply_tp(model, mesh["tp"], cfg)
    model = apply_cp(model, mesh, cfg)
    model = apply_ep(model, mesh, cfg)
    model = apply_ac(model, mesh, cfg)
    model = apply_compile(model, cfg)
    shards = cfg.zero >= 2
    if materialize is not None and not shards:
        materialize(model)
    model = apply_dp(model, gradient_mesh(mesh, cfg), cfg, expert_mesh=mesh_axis(mesh, cfg, "edp"))
    if materialize is not None and shards:
        materialize(model)
    return model

