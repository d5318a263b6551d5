"""What a rank keeps between notebook cells: the trainer, and the commands the Workbench sends.

Each command here (`capabilities`, `apply`, `train`, `save`, `load`,
`next_step`, `snapshot`, `restore`) runs on every rank at once through `Pool.run`. The session lives
in the rank's state, so a model keeps training across cells and across layout
changes until the pool restarts; `current()` is the one way to reach it.
"""

from __future__ import annotations

import ctypes
import gc
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.checkpoints import SaveSchedule
from workbench.config import Config
from workbench.emulation import rank as emulation
from workbench.engine import checkpoint
from workbench.engine.data import TokenData
from workbench.engine.mesh import build_mesh
from workbench.engine.reshard import export_full_state, import_full_state
from workbench.engine.reshard_direct import reshard_into
from workbench.engine.trainer import Flags, Trainer
from workbench.pool import rank
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.replicas import check_replicas


@dataclass
class Session:
    trainer: Trainer
    next_step: int
    """Index of the global batch the next step trains on; continues across layout changes."""
    corpus: str | Path | None = None
    """The corpus the trainer's data was mapped from: a new layout on the same corpus and batch reuses the mapping."""


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
    session = rank.state.pop(_KEY, None)
    if session is not None:
        _release(session)


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
    here leaves the previous model as it was. The result's "reshard" says how
    the state moved (`reshard_direct.reshard_into`), None for a new model.
    """
    old = current_or_none()
    # Routing settings (capacity, top_k, balancing weight) may change on a trained mixture of experts: same weights.
    carry = (old is not None and not fresh and old.trainer.cfg.model.same_weights(cfg.model)
             and old.trainer.cfg.seed == cfg.seed)
    with rank.unchecked():
        mesh = build_mesh(cfg, _device_type())  # the process's mesh of this shape, built at its first use
        trainer = Trainer(cfg, mesh, rank.info.device, _data(cfg, corpus, old, carry), telemetry)
        path = reshard_into(old.trainer, trainer) if carry else None
        dist.barrier()
    rank.state[_KEY] = Session(trainer, old.next_step if carry else 0, corpus)
    if old is not None:
        _release(old)
    return {"layout": cfg.layout, "resharded": carry, "reshard": path,
            "params_local": sum(p.numel() for m in trainer.modules for p in m.parameters())}


def _data(cfg: Config, corpus: str | Path | None, old: Session | None, carry: bool) -> TokenData:
    """The previous trainer's data when it is the same corpus, tokenizer, batch and seed (one mapping of the corpus
    file); else, on a reshard of the same run and tokens, a new view of the same shard (no second walk over its
    folder); else a new one."""
    data = old.trainer.data if old is not None else None
    same_tokens = isinstance(data, TokenData) and old.corpus == corpus and data.tokenizer == cfg.tokenizer
    if same_tokens and (data.batch_size, data.seq_len, data.seed) == (cfg.batch_size, cfg.seq_len, cfg.seed):
        return data
    shard = data.shard if carry and same_tokens else None
    return TokenData.for_config(cfg, corpus, shard=shard)


def _release(session: Session) -> None:
    """Free a replaced session's model, optimizer and data now, not at some later garbage collection.

    Closing the trainer takes its telemetry hooks off; then the last reference frees it, unless the layout made
    reference cycles (FSDP2's modules and hooks do), which only a collection frees: one is run then, since
    Python's own collections are counted in objects, not bytes, and may come many steps later. Last, the freed
    memory goes back to the system: glibc keeps freed tensor memory in its heaps (its threshold for unmapping
    large blocks rises as they are freed), and the rank's RSS would otherwise climb by a fraction of a model at
    every apply with nothing alive to show for it.
    """
    trainer = session.trainer
    trainer.close()
    # What holds the memory; the Trainer object itself may be freed while its modules live on in a cycle.
    replaced = [weakref.ref(x) for x in (*trainer.modules, *trainer.optimizers)]
    session.trainer = trainer = None  # the caller's reference to the session must not keep the trainer
    if any(ref() is not None for ref in replaced):
        gc.collect()
    _return_freed_memory()


def _return_freed_memory() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim, or no way to
        pass


def train(steps: int, run_id: str, saves: SaveSchedule | None = None) -> list[StepMetrics]:
    """Train `steps` steps, emitting each step's metrics; stop early, on every rank together, when asked."""
    session = current()
    done: list[StepMetrics] = []
    with rank.unchecked():
        for _ in range(steps):
            # The request may reach ranks at different moments; the step's all-reduce makes them agree.
            metrics = session.trainer.step(session.next_step, Flags(stop=rank.flag("stop") == run_id))
            metrics = emulation.after_step(metrics, session.trainer.cfg)  # an emulated cluster's dilation
            session.next_step += 1
            rank.emit(metrics)
            done.append(metrics)
            every = session.trainer.cfg.replica_check_every
            if every and session.next_step % every == 0:
                check_replicas(session.trainer)  # raises on every rank alike, naming the odd rank and parameter
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


def snapshot() -> dict[str, Any]:
    """The session's training state for the notebook to hold (a run that recovers by itself): rank 0 sends the
    model, optimizer, loss scale and counters as full CPU tensors (the same on every rank), every rank its data
    position and random generators."""
    session = current()
    with rank.unchecked():
        state = export_full_state(session.trainer)
    return {"next_step": session.next_step, "rng": checkpoint.rng_state(session.trainer.device),
            "state": state if rank.get_rank() == 0 else None}


def restore(snapshots: list[dict[str, Any]]) -> int:
    """Load what `snapshot` gave on every rank (in rank order) into the current trainer; returns the next step."""
    session = current()
    mine = snapshots[rank.get_rank()]
    with rank.unchecked():
        import_full_state(session.trainer, snapshots[0]["state"])
    checkpoint.set_rng_state(mine["rng"], session.trainer.device)
    session.next_step = mine["next_step"]
    return session.next_step
