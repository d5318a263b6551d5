"""Rank side of checkpoints: a trainer's state as torch.distributed.checkpoint (DCP) shards, in any layout.

What a checkpoint holds, as flat DCP keys:
    model.<fqn>                      each parameter as this layout holds it: DTensor shards under FSDP2 and
                                     TP, plain tensors under DDP; pipeline ranks hold different layers under
                                     the full model's names, so the union over ranks is the whole model
    optim.state.<fqn>.<key>          the optimizer's state (AdamW's moments and step, Lion's moment, SGD's
                                     momentum buffer), sharded like its parameter
                                     (expert-parallel slices, parameters and moments alike, are saved as shards
                                     of the whole (n_experts, ...) tensor: engine/expert_state.py)
    rng.<rank>.<generator>           every rank's random generators, as tensors
Tensors only: the data position, counters, loss scale and Config go to the
manifest as JSON (`workbench.checkpoints`, which also says how the directory is
committed). Hyperparameters are not optimizer state here: they come from the
Config, after a load as after a reshard, so a load may come with a new lr.

DCP records which slice of each tensor every shard holds and plans each
rank's reads by key, so a checkpoint saved in one layout loads into any other:
each rank reads the chunks that cover what it holds now.

ZeroRedundancyOptimizer has no DCP support: torch's state-dict API refuses it
and its consolidate_state_dict() sends everything to one rank. Its state lives
per partition in `opt.optim`, so each rank saves its partition as plain tensors
under the same flat keys (nothing is gathered: the union is the whole state),
and a load reads the keys of the partition the rank holds now.

Storage: each rank's shards go into the checkpoint root's content-addressed
chunk store, written only where the store lacks them (`checkpoint_storage`
says why that is a DCP StorageWriter of our own); rank 0 commits once all
are down. Asynchronous saves (torchtitan's async_mode="async") go through DCP's
`async_save`: the state is copied to host memory on the training thread, then
written and committed in a background thread over a gloo group of their own,
so the training's collectives and the save's never interleave on one group.
One save at a time: the next save, a load or the end of `train` waits for a
background one and raises its error, if any. Each save is reported as a
`CheckpointSave` event (started, staged, durable; bytes written and reused).

Safety: torch 2.13's DCP reads `.metadata` with plain `pickle.load` and
non-tensor values with `torch.load(weights_only=False)`, so a crafted file
would run code. `ChunkReader` unpickles the index through an allow-list of
DCP's own record classes and checks every entry; `SafePlanner` reads any
non-tensor value with `weights_only=True`, though our checkpoints hold none.
"""

from __future__ import annotations

import pickle
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from workbench import checkpoints
from workbench.checkpoints import CheckpointError
from workbench.engine.checkpoint_storage import ChunkReader, ChunkWriter
from workbench.engine.expert_state import as_global, as_held, expert_names, global_target
from workbench.engine.generators import rng_state, set_rng_state
from workbench.engine.mesh import mesh_axis
from workbench.engine.parallel.expert import is_expert_slice, param_of_key
from workbench.engine.parallel.zero_redundancy import is_zero_redundancy, local_optimizer
from workbench.engine.reshard import flat_optimizer_state, param_names
from workbench.pool import rank
from workbench.telemetry.events import CheckpointSave

if TYPE_CHECKING:
    from workbench.engine.trainer import Trainer

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Sharded (each rank its own part) and flat ("state.<fqn>.exp_avg"): per-parameter keys merge across
pipeline stages and ZeRO-1 partitions and split into any other."""
_PENDING, _GROUP = "checkpoint.pending", "checkpoint.group"
"""Where a rank keeps its background save in flight and the gloo group background saves use (`rank.state`)."""


# -- save -----------------------------------------------------------------------------------------------
def save(trainer: Trainer, next_step: int, directory: str, keep: int | None, nonce: str,
         asynchronous: bool = False) -> Path:
    """Write the trainer's state as `directory`/step-N, N = `next_step` (collective); rank 0 commits it once every
    rank's chunks are down. `nonce` names the temporary directory: every rank must pass the same.

    asynchronous: return once the state is copied to host memory; the bytes are written, and the checkpoint
    committed, in the background while training goes on (`finish_pending` waits for it).
    """
    finish_pending()  # one save at a time
    started = time.monotonic_ns()
    root = Path(directory)
    tmp = checkpoints.temp_dir(root, next_step, nonce)
    final = checkpoints.final_dir(root, next_step)
    tmp.mkdir(parents=True, exist_ok=True)
    commit = None
    if dist.get_rank() == 0:
        manifest = _manifest(trainer, next_step)  # the counters as they are now, not when the bytes are down

        def commit(files: dict[str, str], chunks: dict[str, int]) -> None:
            checkpoints.commit(tmp, final, {**manifest, "files": files, "chunks": chunks}, keep)

    writer = ChunkWriter(root, tmp, commit)
    report = _Report(final, next_step, asynchronous, started, writer)
    if not asynchronous:
        try:
            dcp.save(state_dict(trainer), storage_writer=writer)
        except CheckpointException as e:  # DCP gathers every rank's failure: all ranks raise this together
            report.done(f"{e}")
            raise CheckpointError(f"saving {final} failed: {_causes(e)}") from None
        finally:
            writer.close()
        report.done()
        return final
    try:
        # Copies this rank's state to host memory now (DCP's default stager); the rest runs in a thread of DCP's.
        future = dcp.async_save(state_dict(trainer), storage_writer=writer, process_group=_checkpoint_group())
    except BaseException:
        writer.close()
        raise
    report.staged = time.monotonic_ns()
    rank.progress()
    rank.state[_PENDING] = _Pending(final, future)
    future.add_done_callback(report.from_future)
    return final


def finish_pending() -> None:
    """Wait for this rank's background save, if one is in flight; raise its failure as a CheckpointError."""
    pending = rank.state.pop(_PENDING, None)
    if pending is None:
        return
    try:
        pending.future.result()
    except CheckpointException as e:
        raise CheckpointError(f"the background save of {pending.final} failed: {_causes(e)}") from None
    except Exception as e:  # noqa: BLE001 - whatever it was, the checkpoint is not there
        raise CheckpointError(f"the background save of {pending.final} failed: {type(e).__name__}: {e}") from None


@dataclass
class _Pending:
    final: Path
    future: Future


class _Report:
    """Times one save and emits its `CheckpointSave` event when it is durable (or failed)."""

    def __init__(self, final: Path, step: int, asynchronous: bool, started: int, writer: ChunkWriter) -> None:
        self.final, self.step, self.asynchronous, self.started, self.writer = final, step, asynchronous, started, writer
        self.staged: int | None = None

    def from_future(self, future: Future) -> None:
        """DCP's thread calls this when the background save ends: the lock goes, the event is sent."""
        self.writer.close()
        error = future.exception()
        self.done("" if error is None else f"{type(error).__name__}: {error}")

    def done(self, error: str = "") -> None:
        now = time.monotonic_ns()
        rank.emit(CheckpointSave(
            rank=dist.get_rank(), step=self.step, path=str(self.final), asynchronous=self.asynchronous,
            start_ns=self.started, staged_ns=self.staged or now, durable_ns=now, bytes_written=self.writer.written,
            bytes_reused=self.writer.reused, error=error[:500]))


def _checkpoint_group() -> dist.ProcessGroup:
    """The world's ranks in a gloo group for background saves only, made at the first one (a collective: every
    rank makes its first background save at the same step) and kept for the pool's life, as meshes are."""
    group = rank.state.get(_GROUP)
    if group is None:
        group = rank.state[_GROUP] = dist.new_group(backend="gloo")
    return group


def state_dict(trainer: Trainer) -> dict[str, Any]:
    """This rank's share of the trainer's state, under the flat keys in the module docstring."""
    flat: dict[str, Any] = {}
    for module, opt in zip(trainer.modules, trainer.optimizers):
        experts, ep_mesh = expert_names(module), _ep_mesh(trainer)
        model = as_global(get_model_state_dict(module, options=OPTIONS), experts, ep_mesh)
        optim = as_global(_optimizer_state(module, opt), experts, ep_mesh)
        flat.update({f"model.{k}": v for k, v in model.items()})
        flat.update({f"optim.{k}": v for k, v in optim.items() if k.startswith("state.")})
    flat.update({f"rng.{dist.get_rank()}.{k}": v for k, v in rng_state(trainer.device).items()})
    return flat


def _ep_mesh(trainer: Trainer) -> Any:
    """The "ep" axis of the trainer's mesh; None at ep=1 (the mesh has no such axis)."""
    return mesh_axis(trainer.mesh, trainer.cfg, "ep")


def _optimizer_state(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    if is_zero_redundancy(opt):
        return flat_optimizer_state(module, opt.optim)
    if not opt.state:
        # Before the first step: torch would create the state with a zero-gradient step, and its step
        # counter of 1 would change AdamW's bias correction after a load. Saving none is exact.
        return {}
    return get_optimizer_state_dict(module, opt, options=OPTIONS)


def _manifest(trainer: Trainer, next_step: int) -> dict[str, Any]:
    """The manifest's fields but the files and chunks, which the commit adds once they are down."""
    scaler = trainer.precision.scaler
    return {
        "next_step": next_step, "steps_done": trainer.steps_done,
        "skipped_steps": trainer.skipped_steps, "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "config": checkpoints.config_to_json(trainer.cfg), "layout": trainer.cfg.layout,
        "world_size": dist.get_world_size(), "torch": torch.__version__,
    }


# -- load -----------------------------------------------------------------------------------------------
def load(trainer: Trainer, path: Path, saved: dict[str, Any]) -> dict[str, Any]:
    """Load a verified checkpoint into the trainer's current layout (collective); the caller sets the data
    position to `saved["next_step"]`.

    Everything is read into fresh tensors first and copied into the trainer
    only once all of it has arrived, so a failure leaves training as it was.
    Problems found in the metadata are agreed over all ranks before DCP starts,
    so every rank raises the same CheckpointError and none is left waiting.
    """
    finish_pending()
    # Another optimizer's state means nothing to this one: the weights load, the optimizer starts afresh.
    same_optimizer = saved.get("optimizer", "adamw") == trainer.cfg.optimizer
    reader, models, optims = _check_fit(trainer, path, same_optimizer)
    entries = reader.metadata.state_dict_metadata
    rng = {k: _empty(md) for k, md in entries.items() if k.startswith(f"rng.{dist.get_rank()}.")}
    request = {f"model.{k}": v for m in models for k, v in m.items()}
    request.update({f"optim.{k}": v for o in optims for k, v in o.items() if k.startswith("state.")})
    request.update(rng)
    rank.progress()
    try:
        dcp.load(request, storage_reader=reader, planner=SafePlanner())
    except CheckpointException as e:
        raise CheckpointError(f"{path}: reading the shards failed: {_causes(e)}") from None

    for module, opt, model_sd, optim_sd in zip(trainer.modules, trainer.optimizers, models, optims):
        experts = expert_names(module)
        held = get_model_state_dict(module, options=OPTIONS) if experts else {}
        set_model_state_dict(module, {k: as_held(request[f"model.{k}"], held[k]) if k in experts else
                                      request[f"model.{k}"] for k in model_sd}, options=OPTIONS)
        _set_optimizer(module, opt, optim_sd)  # its state tensors were filled in place
    if saved["scaler"] and trainer.precision.scaler.is_enabled():
        trainer.precision.scaler.load_state_dict(saved["scaler"])
    trainer.steps_done, trainer.skipped_steps = saved["steps_done"], saved["skipped_steps"]
    if rng:
        set_rng_state({k.split(".", 2)[2]: v for k, v in rng.items()}, trainer.device)  # filled in place
    return {"rng_restored": bool(rng), "optimizer_restored": any(optims),
            "saved_optimizer": saved.get("optimizer", "adamw")}


def _check_fit(trainer: Trainer, path: Path, with_optimizer: bool) -> tuple[ChunkReader, list[dict], list[dict]]:
    """The reader and this rank's empty targets, once every rank agrees the checkpoint fits this model."""
    entries, models, optims, problems, refused = {}, [], [], [], None
    try:
        reader = ChunkReader(path)
        entries = reader.metadata.state_dict_metadata
        models, optims, problems = _targets(trainer, entries, with_optimizer)
    except CheckpointError as e:
        refused = str(e)
    # Pipeline ranks hold different parameters: only together do they know what the checkpoint has extra.
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(k for m in models for k in m), problems, refused))
    refused = next((r for _, _, r in everyone if r is not None), None)
    if refused is not None:
        raise CheckpointError(refused)
    held = {k for keys, _, _ in everyone for k in keys}
    problems = sorted({p for _, ps, _ in everyone for p in ps})
    problems += [f"parameter {k[6:]}: in the checkpoint, not in this model"
                 for k in sorted(entries) if k.startswith("model.") and k[6:] not in held]
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise CheckpointError(f"{path} does not fit this model ({trainer.cfg.layout}):\n  "
                              + "\n  ".join(problems[:8]) + more)
    return reader, models, optims


def _targets(trainer: Trainer, entries: dict[str, Any], with_optimizer: bool) -> tuple[list[dict], list[dict],
                                                                                     list[str]]:
    """Empty tensors shaped like what this rank holds, per module part, and what does not fit the checkpoint."""
    models, optims, problems = [], [], []
    has_optim = with_optimizer and any(k.startswith("optim.state.") for k in entries)
    for module, opt in zip(trainer.modules, trainer.optimizers):
        model: dict[str, torch.Tensor] = {}
        experts, ep_mesh = expert_names(module), _ep_mesh(trainer)
        for fqn, held in get_model_state_dict(module, options=OPTIONS).items():
            # An expert slice reads its chunk of the whole (n_experts, ...) tensor, whatever ep saved it.
            tensor = global_target(held, ep_mesh) if fqn in experts else torch.empty_like(held)
            md = entries.get(f"model.{fqn}")
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"parameter {fqn} {tuple(tensor.shape)}: not in the checkpoint")
            elif tuple(md.size) != tuple(tensor.shape):
                problems.append(f"parameter {fqn}: shape {tuple(md.size)} in the checkpoint, "
                                f"{tuple(tensor.shape)} in this model")
            else:
                model[fqn] = tensor
        models.append(model)
        optim, missing = _optimizer_targets(module, opt, entries, experts, ep_mesh) if has_optim else ({}, [])
        problems += [f"optimizer state for {fqn}: not in the checkpoint" for fqn in missing[:5]]
        optims.append(optim)
    return models, optims, problems


def _optimizer_targets(module: nn.Module, opt: torch.optim.Optimizer, entries: dict[str, Any],
                       experts: set[str], ep_mesh: Any) -> tuple[dict[str, Any], list[str]]:
    """Flat targets for the state of the parameters this rank's optimizer updates, with its current hyperparameters
    (torch's flat format wants them beside the state)."""
    inner = local_optimizer(opt)
    names = param_names(module)
    flat: dict[str, Any] = {}
    missing = []
    for group in inner.param_groups:
        for param in group["params"]:
            fqn = names[param]
            prefix = f"optim.state.{fqn}."
            keys = [k for k in entries if k.startswith(prefix)]
            if not keys:
                missing.append(fqn)
            for key in keys:
                md = entries[key]
                if fqn in experts and len(md.size) > 0:  # an expert slice's moment: its chunk of the whole
                    flat[key[6:]] = global_target(param, ep_mesh, md.properties.dtype)
                    continue
                # AdamW's moments are shaped (and sharded) like the parameter; its step counter is a scalar.
                same = tuple(md.size) == tuple(param.shape)
                flat[key[6:]] = torch.empty_like(param, dtype=md.properties.dtype) if same else _empty(md)
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    return flat, missing


def _set_optimizer(module: nn.Module, opt: torch.optim.Optimizer, flat: dict[str, Any]) -> None:
    inner = local_optimizer(opt)
    if not flat:  # saved before the first step: start the optimizer afresh, as the saved run would have
        inner.state.clear()
        return
    if experts := expert_names(module):  # expert moments back to the slice (or edp shard) this rank holds
        params = {name: param for param, name in param_names(module).items()}
        flat = {k: as_held(v, params[param_of_key(k)]) if is_expert_slice(k, v, experts) else v
                for k, v in flat.items()}
    if inner is opt:
        set_optimizer_state_dict(module, opt, flat, options=OPTIONS)
        return
    names = param_names(module)
    for group in inner.param_groups:  # ZeRO-1: this rank's partition
        for param in group["params"]:
            prefix = f"state.{names[param]}."
            inner.state[param] = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def _causes(e: CheckpointException) -> str:
    return "; ".join(f"rank {r}: {exc}" for r, (exc, _) in sorted(e.failures.items()))


def _empty(md: TensorStorageMetadata) -> torch.Tensor:
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


# -- reading non-tensor values without running code from the file -----------------------------------------
class SafePlanner(DefaultLoadPlanner):
    """DCP's planner for flat state dicts, reading non-tensor values with `weights_only=True`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{read_item.dest_index.fqn}: refused ({e})") from None
