"""Pipeline parallel: the model cut into chunks of consecutive blocks, run by torch's schedules.

The model's blocks (the model protocol's `block_modules`) are split into pp·v
chunks (v = stages_per_rank for the interleaved schedules, 2 for the V-shaped
ones, else 1), of equal size or of the sizes Config.stage_layers gives
(torchtitan's first and last stages lighter, as they also hold the embedding
and the head); the embedding goes with the first chunk and the final norm and
output head with the last. A chunk is the model itself with the other blocks
deleted and the other parts set to None (`protocol.chunk`, done on the meta
device before any parameter exists), so its parameter names stay those of the
full model ("layers.5.attention.wq.weight") and checkpoints written by any
layout load into any other. Rank r on the "pp" axis holds stages r, r+pp, r+2pp, ...
(torch's "loop" placement), or under ZBV and DualPipeV stages r and 2pp-1-r
(the "v" placement: rank 0 holds the first and the last stage).

Each chunk becomes a `torch.distributed.pipelining.PipelineStage` and the
stages are driven by torch's schedule of cfg.schedule (`TORCH_CLASSES`):
GPipe, 1F1B, interleaved 1F1B (Huang et al. 2019; Narayanan et al. 2021),
interleaved zero bubble, ZBV (Qi et al. 2024) or DualPipeV (DeepSeek-V3). The
schedule owns data-parallel gradient sync: DDP runs every micro-batch but the
last under `no_sync`; FSDP2 (and `replicate`) run all of them with
`set_requires_gradient_sync(False)` and reduce after the last, so under
pipelining a ZeRO-2/3 stage holds unsharded gradients until the step's end.
The zero-bubble schedules split each backward into an input-gradient half (I)
and a weight-gradient half (W); torch 2.13 computes W with autograd.grad and
writes `.grad` itself, past DDP's hooks, so DDP would never all-reduce those
gradients. Under them zero=0 is torch's FSDP2-based `replicate` and zero=2
FSDP2, both reduced in the schedule's REDUCE_GRAD step; Config refuses zero 1
(ZeroRedundancyOptimizer cannot update replicate's DTensors) and zero 3 (the I
half looks for the parameters its graph used while FSDP2 holds them resharded,
so their W never runs).

Loss scaling: torch's schedules backpropagate each micro-batch's loss as is, so
the gradients add up over micro-batches. Each micro-batch's mean loss is
divided by m before its backward (and then multiplied by the fp16 loss scale,
when one is given), so the accumulated gradient is the gradient of the batch's
mean loss, exactly what one process computes on the whole batch; the DP
wrappers then average over dp ranks. Dividing the loss rather than letting
torch divide `.grad` afterwards (`scale_grads=True`) keeps every scaling in one
place that also carries GradScaler's factor.

Mixed precision: each chunk's forward runs under `torch.autocast`, entered by a
forward pre-hook and left by a forward hook. Hooks (not a wrapper module) keep
the parameter names and the module class, which DDP/FSDP and the stage's
isinstance checks rely on; and because they sit on the chunk, they also cover
the stage's shape-inference forward on the first step, so the activation
dtypes it infers (and allocates receive buffers for) are those that training
sends. Backward runs outside autocast, as torch recommends.

Mixture of experts: each MoE FFN attaches its balancing loss to its output
(models/transformer.py's `AttachAuxLoss`), so the stage's own backward trains its routers
on it; the loss function on the last stage sees only the training loss. The
trainer sets `runner.after_forward` to read each stage's router counts after
every micro-batch's forward.

Telemetry: set `runner.on_action = hook`; every forward and backward of one
micro-batch through one stage then calls
`hook(kind, stage, microbatch, start_ns, end_ns)` with kind "F", "B" (a full
backward), "I" or "W" (the halves of a split one) and
`time.monotonic_ns()` times (on CUDA after a device synchronize, so they are
kernel times, not launch times). F excludes the loss, which the schedule
computes just after it; the last B of each stage includes DDP's gradient
all-reduce, which its hooks run inside backward (FSDP's reduce-scatter runs
after the last B and is not inside any interval). Waits for activations and
gradients from other ranks fall between intervals: that is the bubble, which
`workbench.schedules.measured_bubble` computes from the intervals.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.nn.parallel import DistributedDataParallel

from workbench.config import Config
from workbench.engine.materialize import on_device
from workbench.models.protocol import CausalLM
from workbench.models.protocol import chunk as model_chunk
from workbench.engine.precision import DTYPES
from workbench.schedules import (
    TORCH_CLASSES,
    Grid,
    Kind,
    config_rank_stages,
    config_stages,
    orders_from_torch,
    place,
    split_layers,
)
from workbench.schedules.torch_orders import SINGLE_STAGE

ActionHook = Callable[[Kind, int, int, int, int], None]
"""on_action(kind, stage, microbatch, start_ns, end_ns): one measured F, B, I or W."""
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Make `module`'s forward run under torch.autocast, keeping its class and parameter names."""
    active: list[torch.autocast] = []

    def enter(_module: nn.Module, _args: Any) -> None:
        ctx = torch.autocast(device_type, dtype=dtype)
        ctx.__enter__()
        active.append(ctx)

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    # always_call: leave autocast even when the forward raises, or it would leak into the caller.
    module.register_forward_hook(leave, always_call=True)


class _TimedStage(PipelineStage):
    """A PipelineStage that reports the interval of each forward and backward (or backward half) to `on_action`."""

    on_action: ActionHook | None = None
    after_forward: Callable[[nn.Module], None] | None = None
    """Called with the chunk after each micro-batch's forward (not the first step's shape inference, nor the
    recomputation of activation checkpointing), while what the forward measured is still in the chunk."""

    def _now(self) -> int:
        if torch.device(self.device).type == "cuda":
            # Kernels run asynchronously; without a sync the interval would be the launch, not the work.
            torch.cuda.synchronize(self.device)
        return time.monotonic_ns()

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = self._now() if self.on_action is not None else 0
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.on_action is not None:
            self.on_action("F", self.stage_index, fwd_chunk_id, start, self._now())
        if self.after_forward is not None:
            self.after_forward(self.submod)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        if self.on_action is None:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        start = self._now()
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self.on_action("B" if full_backward else "I", self.stage_index, bwd_chunk_id, start, self._now())

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        if self.on_action is None:
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        start = self._now()
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self.on_action("W", self.stage_index, bwd_chunk_id, start, self._now())


class _MicroBatchLoss:
    """The loss torch's schedule backpropagates per micro-batch: mean loss / m, times the loss scale if any.

    Also keeps the unscaled losses, which are what a step reports.
    """

    def __init__(self, loss_fn: LossFn, microbatches: int) -> None:
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.losses: list[torch.Tensor] = []

    def begin(self, scale: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.scale = scale
        self.losses.clear()

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        self.losses.append(loss.detach())
        loss = loss / self.microbatches
        return self.scale(loss) if self.scale is not None else loss

    def step_mean(self) -> torch.Tensor:
        # The schedule's first step also calls the loss once to infer shapes: only the last m are this step's.
        return torch.stack(self.losses[-self.microbatches:]).mean()


class PipelineRunner:
    """The stages this rank holds and the schedule that runs them; `step()` is one forward + backward."""

    def __init__(self, stages: list[_TimedStage], schedule: PipelineScheduleSingle | PipelineScheduleMulti,
                 loss: _MicroBatchLoss, cfg: Config, pp_rank: int) -> None:
        self.stages = stages
        self.schedule = schedule
        """The torch.distributed.pipelining schedule object (its `pipeline_order` is torch's own grid)."""
        self.cfg = cfg
        self.pp_rank = pp_rank
        self._loss = loss
        self._on_action: ActionHook | None = None

    @property
    def modules(self) -> list[nn.Module]:
        """This rank's chunks, as parallelized (DDP/FSDP wrapped): the optimizer takes their parameters."""
        return [stage.submod for stage in self.stages]

    @property
    def stage_ids(self) -> list[int]:
        """Global stage indices held by this rank."""
        return [stage.stage_index for stage in self.stages]

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    @property
    def on_action(self) -> ActionHook | None:
        """Called with (kind, stage, microbatch, start_ns, end_ns) after every F and B; None turns timing off."""
        return self._on_action

    @on_action.setter
    def on_action(self, hook: ActionHook | None) -> None:
        self._on_action = hook
        for stage in self.stages:
            stage.on_action = hook

    @property
    def after_forward(self) -> Callable[[nn.Module], None] | None:
        """Called with the chunk after every forward of one micro-batch through one of this rank's stages (the
        trainer reads the MoE routers' statistics there); None for nothing."""
        return self.stages[0].after_forward

    @after_forward.setter
    def after_forward(self, hook: Callable[[nn.Module], None] | None) -> None:
        for stage in self.stages:
            stage.after_forward = hook

    def grid(self) -> Grid:
        """The ideal time-step × rank grid of this pipeline's schedule, from torch's own `pipeline_order`."""
        return place(orders_from_torch(self.schedule.pipeline_order), config_stages(self.cfg))

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *,
             scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Forward + backward of this dp rank's batch in cfg.micro_batches micro-batches.

        Gradients accumulate into the chunks' parameters, equal to those of the
        batch's mean loss. Returns the mean loss over micro-batches on the rank
        holding the last stage, None elsewhere. `scale_loss` (e.g.
        `GradScaler.scale`) multiplies each micro-batch's loss before backward.
        """
        self._loss.begin(scale_loss)
        device = self.stages[0].device
        args = (inputs.to(device),) if self.is_first else ()
        target = targets.to(device) if self.is_last else None
        # return_outputs=False: the logits of every micro-batch would otherwise be kept for the caller.
        self.schedule.step(*args, target=target, return_outputs=False)
        return self._loss.step_mean() if self.is_last else None


def build_pipeline(model: CausalLM, mesh: DeviceMesh, cfg: Config, loss_fn: LossFn, device: torch.device | str,
                   parallelize_chunk: Callable[[nn.Module], nn.Module] | None = None) -> PipelineRunner:
    """Cut `model` into this rank's stages along the mesh's "pp" axis and build cfg.schedule over them.

    `model` is the full model, identical on every rank; it is left untouched.
    `parallelize_chunk` applies TP/AC/DP to one chunk (for FSDP2 it must
    `fully_shard` the chunk itself, so the stage sees an FSDPModule and
    controls its gradient sync).
    """
    pp_mesh = mesh["pp"]
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    if pp != cfg.pp:
        raise ValueError(f"the mesh's pp axis has {pp} ranks but cfg.pp={cfg.pp}; build the mesh from this Config")
    device = torch.device(device)
    per_rank = config_stages(cfg)
    n_stages = pp * per_rank
    layers = split_layers(len(model.block_modules), n_stages, cfg.stage_layers)
    loss = _MicroBatchLoss(loss_fn, cfg.micro_batches)

    stages: list[_TimedStage] = []
    for stage_id in config_rank_stages(cfg, pp_rank):
        chunk = on_device(model_chunk(model, layers[stage_id], first=stage_id == 0, last=stage_id == n_stages - 1),
                          device)
        # The one table of autocast dtypes (engine/precision.py); under "fsdp" FSDP2 casts the parameters instead.
        if DTYPES[cfg.precision] is not None and cfg.mixed_precision != "fsdp":
            autocast_forward(chunk, device.type, DTYPES[cfg.precision])
        if parallelize_chunk is not None:
            chunk = parallelize_chunk(chunk)
        if isinstance(chunk, DistributedDataParallel):
            # The stage arms DDP's reducer itself before the last micro-batch's backward. DDP's own
            # forward would arm it too whenever sync is on, which in a pipeline happens only in the
            # stage's one-off shape-inference forward (no backward follows): the reducer then counts
            # every parameter twice and fails an internal assert. So DDP's forward never syncs here.
            chunk.require_backward_grad_sync = False
        stages.append(_TimedStage(chunk, stage_id, n_stages, device, group=pp_mesh.get_group()))

    # scale_grads=False: the loss is already divided by m (see the module docstring).
    schedule_class = getattr(pipelining, TORCH_CLASSES[cfg.schedule])
    schedule: PipelineScheduleSingle | PipelineScheduleMulti = schedule_class(
        stages[0] if cfg.schedule in SINGLE_STAGE else stages, cfg.micro_batches, loss_fn=loss, scale_grads=False)
    return PipelineRunner(stages, schedule, loss, cfg, pp_rank)
