"""The one place that orders the parallelisms applied to a model (or one pipeline chunk of it)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import Config
from workbench.engine.mesh import mesh_axis
from workbench.engine.model import Transformer
from workbench.engine.parallel.data_parallel import apply_dp
from workbench.engine.parallel.expert import apply_ep
from workbench.engine.parallel.recompute import apply_ac
from workbench.engine.parallel.tensor import apply_tp


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: Config) -> nn.Module:
    """Apply `cfg`'s layout to `model` on this rank's slice of `mesh`: TP → EP → AC → DP/ZeRO.

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
    - EP between TP and AC (torchtitan's order): it swaps each MoE layer's
      experts for this rank's slice, which AC must then recompute (all-to-alls
      included) and DP must see as the parameters, to sync them over "edp" only.
    """
    model = apply_tp(model, mesh["tp"], cfg)
    model = apply_ep(model, mesh, cfg)
    model = apply_ac(model, mesh, cfg)
    return apply_dp(model, mesh["dp"], cfg, expert_mesh=mesh_axis(mesh, cfg, "edp"))
