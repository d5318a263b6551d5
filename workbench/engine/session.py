"""What a rank keeps between notebook cells: the trainer, and the commands the Workbench sends.

Each command here (`capabilities`, `apply`, `train`, `save`, `load`,
`next_step`) runs on every rank at once through `Pool.run`. The session lives
in the rank's state, so a model keeps training across cells and across layout
changes until the pool restarts; `current()` is the one way to reach it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.checkpoints import SaveSchedule
from workbench.config import Config
from workbench.engine import checkpoint
from workbench.engine.data import TokenData
from workbench.engine.mesh import build_mesh, mesh_key
from workbench.engine.reshard import export_full_state, import_full_state
from workbench.engine.trainer import Flags, Trainer
from workbench.pool import rank
from workbench.telemetry.events import StepMetrics


@dataclass
class Session:
    trainer: Trainer
    next_step: int
    """Index of the global batch the next step trains on; continues across layout changes."""
    meshes: dict[tuple[int, ...], Any] = field(default_factory=dict)


_KEY = "session"
"""Where the session lives in `workbench.pool.rank.state`; read only through the functions below."""


def current() -> Session:
    """This rank's session; raises if no Config was applied yet."""
    session = current_or_none()
    if session is None:
        raise RuntimeError("no model on the ranks yet: call bench.apply(cfg) first")
    return session


def current_or_none() -> Session | None:
    """This rank's session, or None before the first apply."""
    return rank.state.get(_KEY)


def drop() -> None:
    """Forget this rank's model (the next apply builds a fresh one)."""
    rank.state.pop(_KEY, None)


def _device_type() -> str:
    return rank.info.device.split(":")[0]


def capabilities() -> dict[str, Any]:
    """What this rank's device can do, for validating a Config before it is sent."""
    device = rank.info.device
    if device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(device)
        return {"device": device, "name": torch.cuda.get_device_name(device), "bf16": major >= 8, "fp16": True,
                "fp8": (major, minor) >= (8, 9)}  # fp8 matmuls (torch._scaled_mm): Ada, Hopper and newer
    return {"device": "cpu", "name": "cpu", "bf16": True, "fp16": True, "fp8": False}


def apply(cfg: Config, corpus: str | Path | None, telemetry: bool = True, fresh: bool = False) -> dict[str, Any]:
    """Build the layout `cfg` describes; if a model exists, carry its trained state over (reshard in place).

    A new model starts instead (from the seed, at step 0) when `fresh` is set
    or the model's shape or seed changed: there is no state to carry then
    (a mixture of experts' routing settings are not its shape: they carry).
    The new trainer is complete before the old one is dropped, so a failure
    here leaves the previous model as it was.
    """
    old = current_or_none()
    # Routing settings (capacity, top_k, balancing weight) may change on a trained mixture of experts: same weights.
    carry = (old is not None and not fresh and old.trainer.cfg.model.same_weights(cfg.model)
             and old.trainer.cfg.seed == cfg.seed)
    with rank.unchecked():
        state = export_full_state(old.trainer) if carry else None
        meshes = old.meshes if old is not None else {}
        layout = mesh_key(cfg)
        # One mesh per shape, reused: process groups are never destroyed (that can hang), so don't pile them up.
        if layout not in meshes:
            meshes[layout] = build_mesh(cfg, _device_type())
        trainer = Trainer(cfg, meshes[layout], rank.info.device, TokenData.for_config(cfg, corpus), telemetry)
        if state is not None:
            import_full_state(trainer, state)
        dist.barrier()
    rank.state[_KEY] = Session(trainer, old.next_step if carry else 0, meshes)
    del old, state
    return {"layout": cfg.layout, "resharded": carry,
            "params_local": sum(p.numel() for m in trainer.modules for p in m.parameters())}


def train(steps: int, run_id: str, saves: SaveSchedule | None = None) -> list[StepMetrics]:
    """Train `steps` steps, emitting each step's metrics; stop early, on every rank together, when asked."""
    session = current()
    done: list[StepMetrics] = []
    with rank.unchecked():
        for _ in range(steps):
            # The request may reach ranks at different moments; the step's all-reduce makes them agree.
            metrics = session.trainer.step(session.next_step, Flags(stop=rank.flag("stop") == run_id))
            session.next_step += 1
            rank.emit(metrics)
            done.append(metrics)
            if saves is not None and session.next_step % saves.every == 0:
                checkpoint.save(session.trainer, session.next_step, saves.directory, saves.keep, saves.nonce,
                                saves.asynchronous)
            if session.trainer.agreed.stop:
                break
        checkpoint.finish_pending()  # a run's checkpoints are all durable when it returns
    return done


def save(directory: str, keep: int | None, nonce: str) -> str:
    """Save the session as `directory`/step-N (N: the data position), committed once every rank's shards are down."""
    session = current()
    with rank.unchecked():
        return str(checkpoint.save(session.trainer, session.next_step, directory, keep, nonce))


def load(path: str, saved: dict[str, Any]) -> dict[str, Any]:
    """Load the verified checkpoint at `path` into the current layout; `saved`: its manifest's resume state."""
    session = current()
    with rank.unchecked():
        info = checkpoint.load(session.trainer, Path(path), saved)
    session.next_step = saved["next_step"]
    return info


def next_step() -> int:
    return current().next_step
