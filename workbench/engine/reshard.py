"""A trainer's whole state as full, unsharded CPU tensors: how a layout change reshards in place.

`export_full_state` turns whatever layout a trainer has (DDP, ZeRO-1/2/3, TP
DTensors, pipeline chunks) into one plain dict keyed by the bare model's
parameter names; `import_full_state` loads such a dict into a trainer of any
other layout. `Workbench.apply()` exports, builds the new layout on a new
DeviceMesh over the same world, imports, and training continues as if the
layout had never changed.

The format (identical on every rank and for every layout):
    "model":   {fqn: tensor}
    "optim":   torch.distributed.checkpoint's flattened optimizer state,
               {"state.<fqn>.exp_avg": tensor, ..., "param_groups.<fqn>.lr": 0.003, ...};
               flattened because a flat dict of per-parameter keys merges across
               pipeline stages and splits into any other set of stages. Empty
               before the first optimizer step.
    "scaler":  GradScaler.state_dict() (empty unless fp16)
    "trainer": {"steps_done": int, "skipped_steps": int}
    "optimizer": Config.optimizer of the exporting trainer ("adamw", "lion", "sgd")

Every rank gathers every tensor (dp/tp shards with torch.distributed.checkpoint's
full_state_dict, expert-parallel slices with an all-gather over the ep axis, pipeline
stages with an all-gather over the pp axis), so each
rank briefly holds the whole state on its device and then on CPU. That is fine
for the sizes a workbench explores; for models near the memory limit, save a
sharded checkpoint with torch.distributed.checkpoint instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from workbench.engine.parallel.expert import expert_shards, is_expert_slice, param_of_key
from workbench.engine.parallel.zero_redundancy import is_zero_redundancy

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

FULL = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
# Not cpu_offload: with full_state_dict it gathers to rank 0 only, and every rank needs the state.


def bare_name(name: str) -> str:
    """A parameter's name in the unwrapped model: without DDP's "module." and AC's wrapper segment."""
    name = name.removeprefix("module.")
    return name.replace("_checkpoint_wrapped_module.", "")


def param_names(module: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter of `module` by its bare name."""
    return {param: bare_name(name) for name, param in module.named_parameters()}


def flat_optimizer_state(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's flat optimizer format ({"state.<fqn>.<key>": tensor}) for the parameters `opt` holds, read
    straight from its state: for a ZeRO-1 rank's inner optimizer, its partition. The tensors are the live ones."""
    names = param_names(module)
    return {f"state.{names[param]}.{key}": value
            for group in opt.param_groups for param in group["params"]
            for key, value in opt.state.get(param, {}).items()}


def export_full_state(trainer: Any) -> dict[str, Any]:
    """The trainer's model, optimizer, loss-scaler and counters as full CPU tensors (collective: all ranks)."""
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, Any] = {}
    for module, opt in zip(trainer.modules, trainer.optimizers):
        shards = expert_shards(module, bare_name)
        model.update(_to_cpu(_gather_experts(get_model_state_dict(module, options=FULL), shards)))
        optim.update(_to_cpu(_gather_experts(_export_optimizer(module, opt, trainer.dp_mesh), shards)))
    state = {
        "model": model,
        "optim": optim,
        "scaler": trainer.precision.scaler.state_dict(),
        "trainer": {"steps_done": trainer.steps_done, "skipped_steps": trainer.skipped_steps},
        "optimizer": trainer.cfg.optimizer,
    }
    return _merge_over_axis(state, trainer.mesh, "pp")


def export_full_model(trainer: Any) -> dict[str, torch.Tensor]:
    """The trainer's model alone, as full CPU tensors under the bare model's names (collective: all ranks); what
    `export_full_state` gathers of it, without the optimizer (`bench.export_hf`)."""
    model: dict[str, torch.Tensor] = {}
    for module in trainer.modules:
        model.update(_to_cpu(_gather_experts(get_model_state_dict(module, options=FULL),
                                             expert_shards(module, bare_name))))
    return _merge_over_axis({"model": model, "optim": {}}, trainer.mesh, "pp")["model"]


def import_full_state(trainer: Any, state: dict[str, Any]) -> None:
    """Load a state from `export_full_state` (any layout) into `trainer` (collective: all ranks).

    Learning rate and weight decay stay those of the trainer's own Config: a
    layout change may come with new hyperparameters, and they should win. A change
    of optimizer (Config.optimizer) carries the weights and starts the new
    optimizer's state afresh: one's moments mean nothing to another.
    """
    same_optimizer = state.get("optimizer", "adamw") == trainer.cfg.optimizer
    per_param = _per_param(state["optim"]) if same_optimizer else {}
    for module, opt in zip(trainer.modules, trainer.optimizers):
        own = {bare_name(name) for name, _ in module.named_parameters()}
        missing = own - state["model"].keys()
        if missing:
            raise KeyError(f"the state lacks parameters this layout holds: {sorted(missing)[:5]}")
        shards = expert_shards(module, bare_name)
        set_model_state_dict(module, {k: shards[k].slice(v) if k in shards else v
                                      for k, v in state["model"].items() if k in own}, options=FULL)
        if per_param:
            _import_optimizer(module, opt, _slice_experts(per_param, shards))
        for group in opt.param_groups:
            group.update(lr=trainer.cfg.lr, weight_decay=trainer.cfg.weight_decay)
    if state["scaler"] and trainer.precision.scaler.is_enabled():
        trainer.precision.scaler.load_state_dict(state["scaler"])
    trainer.steps_done = state["trainer"]["steps_done"]
    trainer.skipped_steps = state["trainer"]["skipped_steps"]


def _slice_experts(per_param: dict[str, dict[str, Any]], shards: dict) -> dict[str, dict[str, Any]]:
    """Each expert parameter's optimizer state cut to this rank's ep slice; everything else as it is."""
    return {fqn: {k: shards[fqn].slice(v) if is_expert_slice(fqn, v, shards) else v for k, v in entry.items()}
            for fqn, entry in per_param.items()}


def _gather_experts(flat: dict[str, Any], shards: dict) -> dict[str, Any]:
    """Expert-parallel slices (model "<fqn>" or optimizer "state.<fqn>.<key>") → all experts, gathered over ep.

    Every rank holds the same keys in the same order, so the all-gathers line up.
    """
    if not shards:
        return flat
    out = dict(flat)
    for key, value in flat.items():
        if is_expert_slice(key, value, shards):
            out[key] = shards[param_of_key(key)].gather(value)
    return out


def _export_optimizer(module: nn.Module, opt: torch.optim.Optimizer, dp_mesh: DeviceMesh) -> dict[str, Any]:
    if is_zero_redundancy(opt):
        return _export_zero1(module, opt, dp_mesh)
    if not opt.state:
        # Nothing to export yet; torch would first run a zero-gradient step to create the state,
        # and its step counter of 1 would change AdamW's bias correction after an import.
        return {}
    return get_optimizer_state_dict(module, opt, options=FULL)


def _import_optimizer(module: nn.Module, opt: torch.optim.Optimizer, per_param: dict[str, dict[str, Any]]) -> None:
    names = param_names(module)
    if is_zero_redundancy(opt):
        _import_zero1(opt, names, per_param)
        return
    # Nested, not flat: in torch 2.13 set_optimizer_state_dict fails on a flattened *full* state
    # ("KeyError: 'param_groups.0.params.0'"), so this rebuilds torch's nested FQN-keyed form
    # for exactly this optimizer's parameters.
    # Copies: the optimizer updates its state in place, and the caller's state must stay as exported.
    nested = {
        "state": {names[p]: _copy(per_param[names[p]]) for group in opt.param_groups for p in group["params"]},
        "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                          "params": [names[p] for p in group["params"]]} for group in opt.param_groups],
    }
    set_optimizer_state_dict(module, opt, nested, options=StateDictOptions(full_state_dict=True))


def _per_param(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"state.<fqn>.<key>": v} → {fqn: {key: v}}; the optimizers' keys (step, exp_avg, exp_avg_sq,
    momentum_buffer) hold no dot."""
    per_param: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("state."):
            fqn, name = key.removeprefix("state.").rsplit(".", 1)
            per_param.setdefault(fqn, {})[name] = value
    return per_param


# ZeroRedundancyOptimizer is not supported by torch.distributed.checkpoint's state-dict API, and its
# own consolidate_state_dict() sends everything to one rank. Each rank holds the state of its
# partition in the inner `opt.optim`; gathering those over the dp axis gives the same flat format.

def _export_zero1(module: nn.Module, opt: ZeroRedundancyOptimizer, dp_mesh: DeviceMesh) -> dict[str, Any]:
    names = param_names(module)
    flat = {k: v.detach().cpu().clone() for k, v in flat_optimizer_state(module, opt.optim).items()}
    parts: list[dict[str, Any]] = [{} for _ in range(dp_mesh.size())]
    dist.all_gather_object(parts, flat, group=dp_mesh.get_group())
    merged = {k: v for part in parts for k, v in part.items()}
    if not merged:
        return {}
    for group in opt.param_groups:
        for param in group["params"]:
            for key, value in group.items():
                if key != "params":
                    merged[f"param_groups.{names[param]}.{key}"] = value
    return merged


def _import_zero1(opt: ZeroRedundancyOptimizer, names: dict[nn.Parameter, str],
                  per_param: dict[str, dict[str, Any]]) -> None:
    for group in opt.optim.param_groups:  # this rank's partition only
        for param in group["params"]:
            opt.optim.state[param] = {
                # AdamW keeps its step counter on the CPU (unless capturable/fused); the rest with the
                # parameter. Copies, as above.
                key: value.clone() if key == "step" else value.to(param.device, param.dtype, copy=True)
                for key, value in per_param[names[param]].items()
            }


def _merge_over_axis(state: dict[str, Any], mesh: DeviceMesh, axis: str) -> dict[str, Any]:
    """Pipeline stages hold different layers: all-gather their dicts along `axis` and merge them."""
    if mesh[axis].size() == 1:
        return state
    parts: list[dict[str, Any]] = [{} for _ in range(mesh[axis].size())]
    dist.all_gather_object(parts, state, group=mesh[axis].get_group())
    merged = dict(state)
    for key in ("model", "optim"):
        merged[key] = {k: v for part in parts for k, v in part[key].items()}
    return merged


def _copy(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tree.items()}


def _to_cpu(tree: dict[str, Any]) -> dict[str, Any]:
    # copy=True: on a CPU rank .cpu() would return the live parameter or optimizer moment itself,
    # and the exported state would keep changing as training goes on.
    return {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in tree.items()}
