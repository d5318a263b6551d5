"""Rank functions for the context-parallel and HSDP tests (importable, so the pool's ranks can run them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from workbench.config import Config
from workbench.engine.data import TokenData
from workbench.engine.mesh import build_mesh
from workbench.engine.parallel.context import RingAttention, balanced_positions
from workbench.engine.trainer import Trainer
from workbench.pool import rank

from tests.engine.rank_fns import unchecked


@unchecked
def ring_against_whole_attention(cp: int, seq: int, dtype: str) -> dict[str, float]:
    """The ring over `cp` ranks (the whole world) against causal SDPA over the whole sequence, forward and backward:
    the largest difference of the output and of the q, k, v gradients over this rank's positions."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(7)
    b, heads, kv_heads, d = 2, 4, 2, 16  # grouped-query: two query heads per key head
    q, dout = (torch.randn(b, heads, seq, d, generator=g, dtype=dt) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, seq, d, generator=g, dtype=dt) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    out.backward(dout)

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    mine = balanced_positions(seq, cp, mesh.get_local_rank())
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    ring_out = RingAttention(mesh)(*local)
    ring_out.backward(dout[:, :, mine])

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    return {"out": err(ring_out, out[:, :, mine]),
            **{f"d{name}": err(t.grad, w.grad[:, :, mine]) for name, t, w in zip("qkv", local, whole)},
            "dtype": str(ring_out.dtype), "positions": mine.tolist()}


def train_recording(cfg: Config, steps: int = 2) -> dict[str, Any]:
    """Train with telemetry on; the last step's collectives as (name, bytes, group label), and its activations."""
    with rank.unchecked():
        trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", TokenData.for_config(cfg), telemetry=True)
        metrics = [trainer.step(i) for i in range(steps)]
    m = metrics[-1]
    # AdamW's moments on this rank, straight from the optimizers' state (an independent measure of the shard).
    moments = sum((v.to_local() if hasattr(v, "to_local") else v).nbytes for opt in trainer.optimizers
                  for state in getattr(opt, "optim", opt).state.values() for v in state.values()
                  if torch.is_tensor(v) and v.dim() > 0)
    return {"comm": [(iv.name, iv.bytes, iv.group) for iv in m.intervals if iv.kind == "comm"],
            "peak": m.peak_memory, "grad_sync_bytes": m.grad_sync_bytes, "losses": [x.loss for x in metrics],
            "optimizer": moments}


@unchecked
def fsdp_placements(cfg: Config) -> dict[str, Any]:
    """How FSDP2 holds the first block's query weight under `cfg`: the mesh dims and placements of the DTensor."""
    from tests.engine.rank_fns import _trainer

    trainer = _trainer(cfg)
    weight = next(p for n, p in trainer.modules[0].named_parameters() if n.endswith("attention.wq.weight"))
    return {"dims": weight.device_mesh.mesh_dim_names, "placements": [repr(p) for p in weight.placements],
            "groups": weight.device_mesh.mesh.tolist(), "local_rows": weight.to_local().shape[0]}
