"""Rank functions for the engine tests, plus the single-process reference they are compared with.

Each rank function runs on every rank of an initialised gloo world, takes
plain picklable arguments, builds everything it needs (mesh, trainer) and
returns picklable results, so it runs the same under the pool's
`run(fn, *args)`.

Engine work runs inside `rank.unchecked()`: its collectives are symmetric by
construction (torch's parallel modules), and the pool's mismatch check
misreads some of them (a scatter's list exists on the source rank only).

The reference (`reference_run`) shares nothing with the engine but the model,
the loss and the optimizer's class (Lion's own test holds it to the paper): one process, the whole batch, a plain optimizer loop (with
autocast and GradScaler for low precision; the Config's optimizer, AdamW by
default). Every layout must reproduce it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import Config
from workbench.engine.mesh import build_mesh
from workbench.models.transformer import build_model, loss_fn, moe_aux_loss, moe_routing, set_moe_aux_grad_scale
from workbench.engine.optimizers import OPTIMIZERS, hyperparameters
from workbench.engine.precision import DTYPES
from workbench.engine.reshard import export_full_state, import_full_state
from workbench.engine.reshard_direct import reshard_into
from workbench.engine.trainer import Flags, Trainer
from workbench.pool import rank


def unchecked(fn: Callable) -> Callable:
    """Run a rank function with the pool's collective check off (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with rank.unchecked():
            return fn(*args, **kwargs)

    return wrapper


class SyntheticData:
    """Deterministic random byte batches, a pure function of (seed, step), in `workbench.engine.data`'s shape.

    Random tokens, not text: the tests need identical batches everywhere, not learnable ones.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def global_batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        return torch.randint(0, self.cfg.model.vocab_size, (self.cfg.batch_size, self.cfg.seq_len + 1), generator=g)

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        return self.global_batch(step).chunk(dp_size)[dp_rank]


def reference_run(cfg: Config, steps: int, data: Any = None) -> dict[str, Any]:
    """One process trains the whole model on whole batches: losses, skipped steps, final scale and weights.

    The single-process reference of every parity test. `data` is anything with `global_batch(step)` returning
    (batch_size, seq_len + 1) tokens; `SyntheticData(cfg)` when None. On synthetic data it is computed once per
    test session for each (what it reads of `cfg`, steps): layouts that differ only in their degrees, ZeRO stage,
    schedule or recompute share one reference, and each caller gets its own copy.
    """
    if data is None:
        return copy.deepcopy(_reference_on_synthetic_data(_what_the_reference_reads(cfg), steps))
    return _reference(cfg, steps, data)


def _what_the_reference_reads(cfg: Config) -> Config:
    """`cfg` with every field `_reference` does not read at its default: the cache key. A field `_reference` starts
    to read must be copied here too."""
    return Config(model=cfg.model, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                  precision=cfg.precision, batch_size=cfg.batch_size, seq_len=cfg.seq_len)


@functools.cache
def _reference_on_synthetic_data(cfg: Config, steps: int) -> dict[str, Any]:
    return _reference(cfg, steps, SyntheticData(cfg))


def _reference(cfg: Config, steps: int, data: Any) -> dict[str, Any]:
    model = build_model(cfg.model, cfg.seed)
    opt = OPTIMIZERS[cfg.optimizer](model.parameters(), **hyperparameters(cfg))  # AdamW unless the Config says
    scaler = torch.amp.GradScaler("cpu", enabled=cfg.precision == "fp16")
    dtype = DTYPES[cfg.precision]
    losses, skipped, aux_losses, loads, dropped = [], [], [], [], []
    for step in range(steps):
        tokens = data.global_batch(step)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            aux = moe_aux_loss(model)  # a mixture of experts' balancing loss, reported; None when dense
        if aux is not None:
            aux_losses.append(aux.item())
            loads.append(moe_routing(model)[0].tolist())
            dropped.append(moe_routing(model)[1].tolist())
        scale_before = scaler.get_scale()
        # The MoE layers backpropagate their balancing loss themselves, weighted as the loss: by the loss scale.
        set_moe_aux_grad_scale(model, scale_before)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        skipped.append(scaler.is_enabled() and scaler.get_scale() < scale_before)
    return {"losses": losses, "skipped": skipped, "scale": scaler.get_scale() if scaler.is_enabled() else None,
            "aux_losses": aux_losses, "expert_load": loads, "tokens_dropped": dropped,
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _trainer(cfg: Config) -> Trainer:
    return Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", SyntheticData(cfg))


@unchecked
def train(cfg: Config, steps: int) -> dict[str, Any]:
    """Train `steps` steps of `cfg`'s layout from scratch; every rank reports the agreed losses."""
    trainer = _trainer(cfg)
    metrics = [trainer.step(i) for i in range(steps)]
    return {"losses": [m.loss for m in metrics], "skipped": [m.skipped for m in metrics],
            "aux_losses": [m.aux_loss for m in metrics], "expert_load": [[list(r) for r in m.expert_load] for m in metrics],
            "tokens_dropped": [list(m.tokens_dropped) for m in metrics],
            "scale": trainer.precision.loss_scale, "skipped_steps": trainer.skipped_steps,
            "mesh": mesh_coordinates(trainer.mesh),
            "params_local": sum(p.numel() for p in _local_params(trainer)),  # this rank's shards (DTensors' local)
            # Parameters that are no DTensor (e.g. a MoE FFN's under tp): their values, to compare across ranks.
            "plain_params": [float(p.detach().double().sum()) for m in trainer.modules for p in m.parameters()
                             if not hasattr(p, "to_local")]}


def train_on_device(cfg: Config, steps: int) -> list[float]:
    """Train `steps` steps of `cfg` on this rank's own device (a GPU in a CUDA pool); the agreed losses."""
    device = rank.info.device
    trainer = Trainer(cfg, build_mesh(cfg, device.split(":")[0]), device, SyntheticData(cfg))
    return [trainer.step(i).loss for i in range(steps)]


@unchecked
def train_through_layouts(plan: list[tuple[Config, int]], direct: bool = False) -> dict[str, Any]:
    """Train each (cfg, steps) in turn, resharding the state into the next layout in between.

    Returns the losses of all steps; for every reshard, whether exporting
    again right after the import gives back exactly the state imported; the
    exported state's checksum at every boundary (ranks compare cheaply); and,
    on rank 0, the final exported model weights. `direct`: reshard trainer to
    trainer with `reshard_into` (its path per reshard in "paths") instead of
    importing the exported full state.
    """
    losses: list[float] = []
    checksums: list[float] = []
    exact_roundtrips: list[bool] = []
    paths: list[str] = []
    state = old = None
    step = 0
    for cfg, steps in plan:
        trainer = _trainer(cfg)
        if state is not None:
            if direct:
                paths.append(reshard_into(old, trainer))
            else:
                import_full_state(trainer, state)
            exact_roundtrips.append(_identical(export_full_state(trainer), state))
        for _ in range(steps):
            losses.append(trainer.step(step).loss)
            step += 1
        state, old = export_full_state(trainer), trainer
        checksums.append(_checksum(state))
    return {"losses": losses, "checksums": checksums, "exact_roundtrips": exact_roundtrips, "paths": paths,
            "steps_done": state["trainer"]["steps_done"], "model": state["model"] if dist.get_rank() == 0 else None}


@unchecked
def reshard_roundtrip(source: Config, steps: int, target: Config) -> dict[str, Any]:
    """Train `source` for `steps`, export, import into `target`, export again: what changed?"""
    trainer = _trainer(source)
    for i in range(steps):
        trainer.step(i)
    state = export_full_state(trainer)
    kept = copy.deepcopy(state)
    del trainer
    resharded = _trainer(target)
    import_full_state(resharded, state)
    again = export_full_state(resharded)
    resharded.step(steps)  # must not write through into `state`
    return {"identical": _identical(again, kept), "source_untouched": _identical(state, kept),
            "model_keys": sorted(state["model"]),
            "optim_keys": sorted(again["optim"]), "scaler": again["scaler"], "trainer": again["trainer"]}


@unchecked
def inject_overflow(cfg: Config, steps: int, at_step: int, on_rank: int) -> dict[str, Any]:
    """Train fp16, putting an inf into one gradient on one rank only, after the gradients are synced."""
    trainer = _trainer(cfg)
    forward_backward = trainer._forward_backward

    def poisoned(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        loss = forward_backward(inputs, targets)
        if current == at_step and dist.get_rank() == on_rank:
            grad = next(p.grad for p in trainer.modules[0].parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        return loss

    trainer._forward_backward = poisoned
    out: dict[str, Any] = {"skipped": [], "scales": [], "unchanged": None}
    for current in range(steps):
        before = [p.detach().clone() for p in _local_params(trainer)]
        metrics = trainer.step(current)
        if current == at_step:
            out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _local_params(trainer)))
        out["skipped"].append(metrics.skipped)
        out["scales"].append(metrics.loss_scale)
        out["reason"] = out.get("reason") or metrics.skip_reason
    out["skipped_steps"] = trainer.skipped_steps
    return out


@unchecked
def vote(cfg: Config, stop_on: int | None, skip_on: int | None) -> dict[str, Any]:
    """One step where one rank votes stop and/or skip: every rank must come out agreeing."""
    trainer = _trainer(cfg)
    before = [p.detach().clone() for p in _local_params(trainer)]
    rank = dist.get_rank()
    metrics = trainer.step(0, Flags(stop=rank == stop_on, skip=rank == skip_on))
    return {"stop": trainer.agreed.stop, "skipped": metrics.skipped, "reason": metrics.skip_reason,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, _local_params(trainer)))}


def mesh_coordinates(mesh: DeviceMesh) -> dict[str, Any]:
    """This rank's place on a built mesh, and its group along each axis."""
    return {axis: (mesh.get_local_rank(axis), mesh[axis].mesh.tolist()) for axis in mesh.mesh_dim_names}


def _local_params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.to_local() if hasattr(p, "to_local") else p for m in trainer.modules for p in m.parameters()]


def _identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):  # optimizer.load_state_dict turns AdamW's betas tuple into a list
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_identical, a, b))
    return a == b


def _checksum(state: dict[str, Any]) -> float:
    total = 0.0
    for part in ("model", "optim"):
        for key in sorted(state[part]):
            value = state[part][key]
            if isinstance(value, torch.Tensor):
                total += float(value.double().abs().sum())
    return total


@unchecked
def loss_parallel_step(cfg: Config) -> dict[str, float]:
    """One forward + backward of the tp-split model with vocabulary-sharded logits, against the whole model."""
    from torch.distributed.tensor.parallel import loss_parallel

    from workbench.engine.parallel.tensor import apply_tp

    tokens = SyntheticData(cfg).global_batch(0)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    whole = build_model(cfg.model, cfg.seed)
    expected = loss_fn(whole(inputs), targets)
    expected.backward()
    split = apply_tp(build_model(cfg.model, cfg.seed), build_mesh(cfg, "cpu")["tp"], cfg, loss_parallel=True)
    logits = split(inputs)
    with loss_parallel():
        loss = loss_fn(logits, targets)
        loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in split.named_parameters()}
    return {"logits_placement": str(logits.placements), "loss": loss.full_tensor().item(), "expected": expected.item(),
            "max_grad_err": max(float((grads[n] - p.grad).abs().max()) for n, p in whole.named_parameters())}
