"""Rank functions for the pipeline tests (importable, so pooled or spawned ranks can run them).

Each takes plain arguments, runs on every rank of an initialised gloo world,
and returns picklable results; the tests compare them with `reference_losses`,
a single process training the whole model on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tests.engine.rank_fns import reference_run
from workbench.config import Config
from workbench.engine.mesh import build_mesh
from workbench.models.transformer import build_model, loss_fn
from workbench.engine.parallel.pipeline import build_pipeline


class Batches:
    """The global batches of these tests: random byte tokens, a function of the step alone."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def global_batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randint(0, self.cfg.model.vocab_size, (self.cfg.batch_size, self.cfg.seq_len + 1), generator=g)


def batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` as (inputs, targets shifted by one)."""
    tokens = Batches(cfg).global_batch(step)
    return tokens[:, :-1], tokens[:, 1:]


def reference_losses(cfg: Config, steps: int) -> list[float]:
    """One process, the whole model, the whole batch, AdamW: what every layout must reproduce."""
    return reference_run(cfg, steps, Batches(cfg))["losses"]


def _parallelize(kind: str | None, mesh: DeviceMesh, cfg: Config) -> Callable[[nn.Module], nn.Module] | None:
    """"ddp" or "fsdp": our own DP over the mesh's "dp" axis (DDP; FSDP2 per block + chunk), independent of
    the engine's; "engine": the engine's `parallelize` (TP → AC → DP/ZeRO as cfg says)."""
    if kind is None:
        return None
    if kind == "engine":
        from workbench.engine.parallelize import parallelize

        return lambda chunk: parallelize(chunk, mesh, cfg)
    dp_mesh = mesh["dp"]
    if kind == "ddp":
        return lambda chunk: nn.parallel.DistributedDataParallel(chunk, process_group=dp_mesh.get_group())

    from torch.distributed.fsdp import fully_shard

    def shard(chunk: nn.Module) -> nn.Module:
        for block in chunk.layers.values():
            fully_shard(block, mesh=dp_mesh)
        return fully_shard(chunk, mesh=dp_mesh)

    return shard


def _compute_actions(order: list) -> list[str]:
    """torch's IR as printed, compute actions only; DualPipeV's OVERLAP_F_B as its sub-actions, in order."""
    out = []
    for a in order:
        if a is not None and a.computation_type.value == "OVERLAP_F_B":
            out += _compute_actions(list(a.sub_actions))
        elif a is not None and a.computation_type.value in ("F", "B", "I", "W"):
            out.append(str(a))
    return out


def train(cfg: Config, steps: int, parallel: str | None = None) -> dict:
    """Train `steps` steps through the pipeline; report losses (last stage), timings and names."""
    torch.manual_seed(0)
    mesh = build_mesh(cfg, "cpu")
    model = build_model(cfg.model, cfg.seed)
    runner = build_pipeline(model, mesh, cfg, loss_fn, "cpu", _parallelize(parallel, mesh, cfg))
    params = [p for m in runner.modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    intervals: list[tuple] = []
    runner.on_action = lambda kind, stage, mb, t0, t1: intervals.append((runner.pp_rank, stage, mb, kind, t0, t1))
    dp_rank, local = mesh["dp"].get_local_rank(), cfg.batch_size // cfg.dp
    losses = []
    for step in range(steps):
        intervals.clear()
        inputs, targets = batch(cfg, step)
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        loss = runner.step(inputs[rows], targets[rows])
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return {
        "pp_rank": runner.pp_rank,
        "dp_rank": dp_rank,
        "stage_ids": runner.stage_ids,
        "losses": losses if runner.is_last else None,
        "fqns": sorted(n for m in runner.modules for n, _ in m.named_parameters()),
        "torch_order": _compute_actions(runner.schedule.pipeline_order[runner.pp_rank]),
        "grid": str(runner.grid()),
        "intervals": list(intervals),
    }


def autocast_dtypes(cfg: Config, precisions: list[str]) -> dict[str, dict]:
    """One step per precision: the dtypes this rank's Linear layers produced, the loss, whether grads are finite."""
    mesh = init_device_mesh("cpu", (cfg.pp,), mesh_dim_names=("pp",))
    results = {}
    for precision in precisions:
        runner = build_pipeline(build_model(cfg.model, cfg.seed), mesh, cfg.replace(precision=precision), loss_fn, "cpu")
        seen: set[str] = set()
        for module in runner.modules[0].modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda _m, _a, out: seen.add(str(out.dtype)))
        inputs, targets = batch(cfg, 0)
        loss = runner.step(inputs, targets)
        params = [p for m in runner.modules for p in m.parameters()]
        results[precision] = {
            "dtypes": sorted(seen),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "grads_finite": all(bool(p.grad.isfinite().all()) for p in params),
            "loss": None if loss is None else loss.item(),
            "autocast_left_on": torch.is_autocast_enabled("cpu"),
        }
    return results


def loss_scale_grads(cfg: Config, scale: float) -> dict:
    """Gradients and loss of one step with and without a loss scale (same weights, same batch)."""
    mesh = init_device_mesh("cpu", (cfg.pp,), mesh_dim_names=("pp",))
    runner = build_pipeline(build_model(cfg.model, cfg.seed), mesh, cfg, loss_fn, "cpu")
    inputs, targets = batch(cfg, 0)
    results = []
    for scale_loss in (None, lambda loss: loss * scale):
        loss = runner.step(inputs, targets, scale_loss=scale_loss)
        grads = {n: p.grad.clone() for m in runner.modules for n, p in m.named_parameters()}
        for m in runner.modules:
            m.zero_grad()
        results.append((None if loss is None else loss.item(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    ratio = max(float((grads_b[n] - scale * grads_a[n]).abs().max() / grads_b[n].abs().max()) for n in grads_a)
    return {"losses": (loss_a, loss_b), "max_rel_err": ratio}


def waited_for_a_core_ns() -> int:
    """How long this process's threads have, all told, been ready to run but kept off the cores by others (the
    kernel's run-queue wait, `workbench.machine.run_queue_wait_s`); 0 where the kernel does not say."""
    import os

    from workbench.machine import run_queue_wait_s

    return round(run_queue_wait_s([os.getpid()]) * 1e9)


def timed_steps(cfg: Config, steps: int) -> dict:
    """Forward + backward steps through the pipeline (no optimizer: only their timing is read), the first one
    untimed (it infers shapes and allocates). Per timed step: every action as (pp_rank, stage, micro-batch, kind,
    start_ns, end_ns), the CPU time this rank's thread spent in the step beside the wall time its actions took
    (a rank that other processes kept off the cores shows a low ratio), and how long its threads waited for a core
    during the step (what a busy machine adds, counted by the kernel)."""
    import time

    mesh = build_mesh(cfg, "cpu")
    runner = build_pipeline(build_model(cfg.model, cfg.seed), mesh, cfg, loss_fn, "cpu")
    intervals: list[tuple] = []
    runner.on_action = lambda kind, stage, mb, t0, t1: intervals.append((runner.pp_rank, stage, mb, kind, t0, t1))
    inputs, targets = batch(cfg, 0)
    out = []
    for step in range(steps + 1):
        intervals.clear()
        cpu, waited = time.thread_time_ns(), waited_for_a_core_ns()
        runner.step(inputs, targets)
        cpu, waited = time.thread_time_ns() - cpu, waited_for_a_core_ns() - waited
        for m in runner.modules:
            m.zero_grad(set_to_none=True)
        if step:
            busy = sum(end - start for *_, start, end in intervals)
            out.append({"intervals": list(intervals), "cpu_over_busy": cpu / busy, "waited_ns": waited})
    return {"pp_rank": runner.pp_rank, "steps": out}
