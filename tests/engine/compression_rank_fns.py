"""Rank functions for the compression and offload tests (run on every rank of the pool)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from workbench.config import Config
from workbench.engine.data import TokenData
from workbench.engine.mesh import build_mesh
from workbench.engine.parallel.compression import QuantizedAllReduce
from workbench.engine.trainer import Trainer

from tests.engine.rank_fns import SyntheticData, unchecked


@unchecked
def train(cfg: Config, steps: int, telemetry: bool = False, text: bool = False) -> dict[str, Any]:
    """Train `steps` steps; the agreed losses and, with telemetry, each step's gradient-sync bytes.

    `text`: real text (the standard library's sources), so the loss falls and curves can be compared;
    else SyntheticData's random tokens.
    """
    data = TokenData(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed) if text else SyntheticData(cfg)
    trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", data, telemetry=telemetry)
    metrics = [trainer.step(i) for i in range(steps)]
    return {"losses": [m.loss for m in metrics],
            "sync_bytes": [m.grad_sync_bytes for m in metrics],
            "ops": sorted({(iv.name, iv.group) for m in metrics for iv in m.intervals if iv.kind == "comm"}),
            "optimizer_memory": metrics[-1].memory.get("optimizer", 0)}


@unchecked
def quantized_allreduce(scheme: str, gradients: list[list[torch.Tensor]], error_feedback: bool = True
                        ) -> dict[str, Any]:
    """Feed rank r the gradients[step][r]; return each step's result and the final residuals."""
    state = QuantizedAllReduce(None, scheme, error_feedback=error_feedback)
    rank = dist.get_rank()
    outs = [state.allreduce(step[rank].clone(), key=0) for step in gradients]
    return {"outs": outs, "worker_error": state.worker_error.get(0), "server_error": state.server_error.get(0)}


@unchecked
def offload_placement(cfg: Config, steps: int) -> dict[str, Any]:
    """Train with cfg (offload on) and report where the optimizer state lives and which optimizer ran."""
    trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", SyntheticData(cfg))
    losses = [trainer.step(i).loss for i in range(steps)]
    out: dict[str, Any] = {"losses": losses, "optimizers": [], "state_devices": set(), "host_state_tensors": 0,
                           "fsdp_offload": []}
    for module, opt in zip(trainer.modules, trainer.optimizers):
        inner = getattr(opt, "optim", opt)
        out["optimizers"].append(type(inner).__name__)
        host = getattr(inner, "host", None)
        if host is not None:
            # The wrapper's state is the host optimizer's, the same tensor objects.
            out["host_state_tensors"] += sum(
                1 for p, s in inner.state.items() for k, v in s.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0 and host.state[inner._master[p]][k] is v)
        for s in inner.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    v = getattr(v, "_local_tensor", v)
                    out["state_devices"].add(str(v.device))
        for sub in module.modules():
            get_state = getattr(sub, "_get_fsdp_state", None)
            group = getattr(get_state(), "_fsdp_param_group", None) if get_state else None
            if group is not None:
                out["fsdp_offload"].append(all(fp.offload_to_cpu for fp in group.fsdp_params))
    return out


def train_telemetry(cfg: Config, steps: int) -> dict[str, Any]:
    return train(cfg, steps, telemetry=True)


def train_text(cfg: Config, steps: int) -> dict[str, Any]:
    return train(cfg, steps, text=True)
