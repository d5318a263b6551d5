"""Rank side of checkpoints: a trainer's state as torch.distributed.checkpoint (DCP) shards, in any layout.

What a checkpoint holds, as flat DCP keys:
    model.<fqn>                      each parameter as this layout holds it: DTensor shards under FSDP2 and
                                     TP, plain tensors under DDP; pipeline ranks hold different layers under
                                     the full model's names, so the union over ranks is the whole model
    optim.state.<fqn>.<key>          AdamW's state, sharded like its parameter
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

Safety: torch 2.13's DCP reads `.metadata` with plain `pickle.load` and
non-tensor values with `torch.load(weights_only=False)`, so a crafted file
would run code. `SafeReader` unpickles the metadata through an allow-list of
DCP's own record classes and checks every shard name; `SafePlanner` reads any
non-tensor value with `weights_only=True` (tensors DCP already reads so), though
our checkpoints hold none.
"""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from workbench import checkpoints
from workbench.checkpoints import CheckpointError
from workbench.engine.expert_state import as_global, as_held, expert_names, global_target
from workbench.engine.mesh import mesh_axis
from workbench.engine.parallel.expert import is_expert_slice, param_of_key
from workbench.engine.reshard import flat_optimizer_state, param_names
from workbench.pool import rank

if TYPE_CHECKING:
    from workbench.engine.trainer import Trainer

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Sharded (each rank its own part) and flat ("state.<fqn>.exp_avg"): per-parameter keys merge across
pipeline stages and ZeRO-1 partitions and split into any other."""
_SHARD = re.compile(r"^__\d+_\d+\.distcp$")


# -- save -----------------------------------------------------------------------------------------------
def save(trainer: Trainer, next_step: int, directory: str, keep: int | None, nonce: str) -> Path:
    """Write the trainer's state as `directory`/step-N, N = `next_step` (collective); rank 0 commits it once every
    shard is down. `nonce` names the temporary directory: every rank must pass the same."""
    me = dist.get_rank()
    tmp = checkpoints.temp_dir(directory, next_step, nonce)
    final = checkpoints.final_dir(directory, next_step)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save(state_dict(trainer), storage_writer=FileSystemWriter(tmp, sync_files=True))
    except CheckpointException as e:  # DCP gathers every rank's failure: all ranks raise this together
        raise CheckpointError(f"saving {final} failed: {_causes(e)}") from None
    rank.progress()  # a long save is not a hang
    # Each rank hashes the shard files it wrote itself, so the digests cost one pass spread over all ranks.
    try:
        mine: dict[str, str] | str = checkpoints.digests(tmp, sorted(p.name for p in tmp.glob(f"__{me}_*.distcp")))
    except OSError as e:
        mine = f"rank {me}: {e}"
    parts: list[Any] | None = [None] * dist.get_world_size() if me == 0 else None
    dist.gather_object(mine, parts, dst=0)
    error = None
    if me == 0:
        try:
            if failed := [p for p in parts if isinstance(p, str)]:
                raise CheckpointError("; ".join(failed))
            files = {k: v for part in parts for k, v in part.items()}
            files.update(checkpoints.digests(tmp, checkpoints.digests_missing(tmp, files)))  # .metadata
            checkpoints.commit(tmp, final, _manifest(trainer, next_step, files), keep)
        except Exception as e:  # noqa: BLE001 - sent to every rank below
            error = f"{type(e).__name__}: {e}"
    # Every rank leaves together, and fails alike when rank 0 could not commit: none waits for it in the next step.
    verdict = [error]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(f"saving {final} failed: {verdict[0]}")
    return final


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
    if isinstance(opt, ZeroRedundancyOptimizer):
        return flat_optimizer_state(module, opt.optim)
    if not opt.state:
        # Before the first step: torch would create the state with a zero-gradient step, and its step
        # counter of 1 would change AdamW's bias correction after a load. Saving none is exact.
        return {}
    return get_optimizer_state_dict(module, opt, options=OPTIONS)


def _manifest(trainer: Trainer, next_step: int, files: dict[str, str]) -> dict[str, Any]:
    scaler = trainer.precision.scaler
    return {
        "files": files, "next_step": next_step, "steps_done": trainer.steps_done,
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
    reader, models, optims = _check_fit(trainer, path)
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
    return {"rng_restored": bool(rng), "optimizer_restored": any(optims)}


def _check_fit(trainer: Trainer, path: Path) -> tuple[SafeReader, list[dict], list[dict]]:
    """The reader and this rank's empty targets, once every rank agrees the checkpoint fits this model."""
    entries, models, optims, problems, refused = {}, [], [], [], None
    try:
        reader = SafeReader(path)
        entries = reader.metadata.state_dict_metadata
        models, optims, problems = _targets(trainer, entries)
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


def _targets(trainer: Trainer, entries: dict[str, Any]) -> tuple[list[dict], list[dict], list[str]]:
    """Empty tensors shaped like what this rank holds, per module part, and what does not fit the checkpoint."""
    models, optims, problems = [], [], []
    has_optim = any(k.startswith("optim.state.") for k in entries)
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
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
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
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
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


# -- random generators ----------------------------------------------------------------------------------
def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's (CPU and this rank's CUDA device), Python's and NumPy's global generators, as tensors."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "numpy": torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64),
        "gauss": torch.tensor([float("nan") if gauss is None else gauss, cached], dtype=torch.float64),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    python, numpy, (gauss, cached) = state["python"].tolist(), state["numpy"].tolist(), state["gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), None if gauss != gauss else gauss))
    np.random.set_state(("MT19937", np.array(numpy[:-2], dtype=np.uint32), numpy[-2], numpy[-1], cached))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# -- reading without running code from the file ---------------------------------------------------------
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else: any other global in the file is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader with its metadata read once, through the allow-list, and every shard name checked."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        file = Path(path) / ".metadata"
        try:
            with open(file, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: refused ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise CheckpointError(f"{file}: not torch.distributed.checkpoint metadata")
        for info in metadata.storage_data.values():
            if not _SHARD.match(str(getattr(info, "relative_path", ""))) or getattr(info, "transform_descriptors",
                                                                                   None):
                raise CheckpointError(f"{file}: refers to {getattr(info, 'relative_path', info)!r}, not a shard "
                                      "file of this checkpoint")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's planner for flat state dicts, reading non-tensor values with `weights_only=True`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{read_item.dest_index.fqn}: refused ({e})") from None
