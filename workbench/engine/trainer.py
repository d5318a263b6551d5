"""The trainer: one rank's model, optimizer and loss scaler, and the step that trains them.

A `Trainer` is built on every rank from the same (cfg, mesh, device, data);
each holds its share of the layout that `parallelize` (and, for pp > 1, the
pipeline) gives it. `step()` runs one optimizer step and ends with exactly one
all-reduce over the whole world, which carries the loss and every per-rank
vote (fp16 overflow, stop, skip), so all ranks leave the step agreeing on what
happened without further round trips.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import Config, ModelConfig
from workbench.engine.materialize import materialize, on_device
from workbench.flops import flops_per_token as model_flops
from workbench.models.build import build
from workbench.models.transformer import loss_fn, set_moe_aux_grad_scale
from workbench.engine.mesh import mesh_axis
from workbench.engine.parallel.context import shard_sequence
from workbench.engine.parallel.data_parallel import build_optimizer, gradient_mesh, gradient_sync
from workbench.engine.parallel.float8 import after_optimizer_step
from workbench.engine.parallel.tensor import reduce_partial_gradients
from workbench.engine.parallelize import parallelize
from workbench.engine.precision import MixedPrecision
from workbench.engine.routing import RouterTally
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.probes import NullProbe, StepProbe


class Batches(Protocol):
    """Where batches come from (`workbench.engine.data`): a pure function of the step and the dp slice."""

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """Token ids (batch_size / dp_size, seq_len + 1) of this dp rank's slice of the step's global batch."""
        ...


@dataclass(frozen=True)
class Flags:
    """One rank's votes for a step. The step's all-reduce agrees them: any rank's vote holds for all."""

    stop: bool = False
    """Stop training after this step (e.g. the user asked, and only one rank saw the request)."""
    skip: bool = False
    """Do not apply this step's update anywhere."""
    oom: bool = False
    """This rank ran out of memory in the step: the update is skipped everywhere."""


@dataclass(frozen=True)
class Agreed:
    """What every rank knows after a step's all-reduce."""

    loss: float
    """Mean loss of the global batch."""
    stop: bool = False
    skip: bool = False
    """A rank voted to skip the update."""
    overflow: bool = False
    """A rank found inf/nan in its fp16 gradients: the update was skipped and the loss scale lowered."""
    oom: bool = False
    """A rank ran out of memory: the update was skipped."""
    nonfinite: bool = False
    """The loss was inf/nan: the update was skipped rather than written into the weights."""
    aux_loss: float | None = None
    """Mixture of experts: mean load-balancing loss of the global batch; None for a dense model."""
    expert_load: tuple[tuple[int, ...], ...] = ()
    """Mixture of experts: router assignments per MoE layer × expert, summed over the global batch."""
    tokens_dropped: tuple[int, ...] = ()
    """Mixture of experts: assignments dropped per MoE layer, summed over the global batch."""

    @property
    def skipped(self) -> bool:
        return self.skip or self.overflow or self.oom or self.nonfinite

    @property
    def skip_reason(self) -> str:
        if self.oom:
            return "out of memory on a rank"
        if self.skip:
            return "skip requested by a rank"
        if self.overflow:
            return "fp16 gradient overflow"
        return "non-finite loss" if self.nonfinite else ""


class Trainer:
    """One rank's share of a training run: model (parallelized), optimizers, loss scaler, step counters."""

    def __init__(self, cfg: Config, mesh: DeviceMesh, device: torch.device | str, data: Batches,
                 telemetry: bool = False, flops_per_token: float | None = None) -> None:
        cfg.check_world(dist.get_world_size())
        self.cfg, self.mesh, self.device, self.data = cfg, mesh, torch.device(device), data
        self.dp_rank, self.dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
        self.dp_mesh = gradient_mesh(mesh, cfg)
        """The ranks that hold the same weights and average gradients: dp, times cp; 2-D under HSDP."""
        self._cp_mesh = mesh_axis(mesh, cfg, "cp")
        # Every rank builds the model on the meta device and fills in only its own pieces, from the same initial
        # values (the seed's draws, or the source's weights): every layout starts from the same weights.
        built = build(cfg.model, cfg.seed)
        # FSDP2's CPUOffloadPolicy keeps the shards on the host; everything else lives on the device.
        shards_at = torch.device("cpu") if cfg.offload and cfg.zero >= 2 else self.device

        def lay_out(model: nn.Module) -> nn.Module:
            return parallelize(on_device(model, self.device), mesh, cfg,
                               materialize=lambda m: materialize([m], built.values, shards_at))

        self.pipeline = None
        if cfg.pp > 1:
            from workbench.engine.parallel.pipeline import build_pipeline

            self.pipeline = build_pipeline(built.model, mesh, cfg, loss_fn, self.device, lay_out)
            self.modules: list[nn.Module] = list(self.pipeline.modules)
        else:
            self.modules = [lay_out(built.model)]
        routes = isinstance(cfg.model, ModelConfig) and cfg.model.n_experts
        self._routing = RouterTally(cfg.model, cfg.micro_batches, self.device) if routes else None
        """Mixture of experts: this rank's router statistics of the step, for the step's all-reduce; None if dense."""
        if self.pipeline is not None and self._routing is not None:
            self.pipeline.after_forward = self._routing.add  # every stage reads its own layers' routers
        # One optimizer per module part, as torchtitan does: each is then a (model, optimizer) pair
        # that torch.distributed.checkpoint can turn into a full state dict on its own.
        self.optimizers = [build_optimizer(module, self.dp_mesh, cfg) for module in self.modules]
        self.precision = MixedPrecision(cfg, self.device.type)
        self._after_update = after_optimizer_step(cfg)  # fp8 with FSDP2: the next gather's scales, in one go
        self.steps_done = 0
        """Optimizer steps run by this trainer, skipped ones included; carried across a reshard."""
        self.skipped_steps = 0
        self.agreed = Agreed(loss=float("nan"))
        """The verdicts of the last step: read `agreed.stop` to end a training loop on every rank at once."""
        self.flops_per_token = (model_flops(cfg.model, cfg.seq_len) if isinstance(cfg.model, ModelConfig)
                                else flops_per_token)
        """Model FLOPs of forward and backward per token (MFU's numerator): the built-in model's formula, another
        model's as the notebook traced it; None when not known (then no MFU is measured)."""
        self.probe = StepProbe(self) if telemetry else NullProbe()
        """Measures each step (spans, memory by category, FLOPs) when telemetry is on; else does nothing."""

    def close(self) -> None:
        """Done with this trainer (a new layout replaced it): take the probe's hooks off, so nothing the process
        keeps (parameters' autograd hooks, the recorder) holds this trainer's model, optimizer or data, and they are
        freed as soon as the last reference goes. The trainer measures nothing afterwards."""
        self.probe.close()
        self.probe = NullProbe()

    def step(self, step_index: int, flags: Flags = Flags()) -> StepMetrics:
        """One optimizer step on global batch `step_index` (also the metrics' `step`); all ranks call it together.

        `flags` are this rank's votes; what the world agreed is in `self.agreed` afterwards.
        """
        self.probe.begin_step()
        self._begin_routing()
        start = time.perf_counter()
        inputs, targets = self._batch(step_index)
        try:
            loss = self._forward_backward(inputs, targets)  # this rank's mean loss; None off the last stage
            if self.cfg.tp > 1:
                reduce_partial_gradients(self.modules)  # sequence parallel's norm gradients, once per step
        except torch.OutOfMemoryError as e:
            if dist.get_world_size() > 1:
                self._drop_gradients()  # a partial step's gradients must not leak into the next
                raise self._oom_mid_step(e) from e
            loss = None
            flags = dataclasses.replace(flags, oom=True)
        found_inf = torch.zeros(())
        if not flags.oom:
            try:
                self.probe.after_backward()
                found_inf = self.precision.unscale(self.optimizers)  # fp16 only: this rank's own verdict
            except torch.OutOfMemoryError:
                # Past the step's collectives, every rank can still skip together: the vote says so.
                loss, flags = None, dataclasses.replace(flags, oom=True)
        if flags.oom:
            self._drop_gradients()  # half made, and freed before the vote; the activations went with the exception
        self.probe.before_vote()  # what the dp group sent before the vote is the gradient sync
        agreed = self._agree(loss, found_inf, flags)  # the step's one world all-reduce
        self.precision.step(self.optimizers, overflow=agreed.overflow, skip=agreed.skipped and not agreed.overflow)
        if not agreed.skipped:
            self._after_update(self.modules)
        self._drop_gradients()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so the step time includes the optimizer's kernels

        self.agreed = agreed
        self.steps_done += 1
        skipped = agreed.skipped
        self.skipped_steps += skipped
        elapsed = time.perf_counter() - start
        return self.probe.finish(StepMetrics(
            step=step_index, loss=agreed.loss, tokens=self.cfg.tokens_per_step, step_time_s=elapsed,
            tokens_per_s=self.cfg.tokens_per_step / elapsed, rank=dist.get_rank(), layout=self.cfg.layout,
            skipped=skipped, skip_reason=agreed.skip_reason, loss_scale=self.precision.loss_scale,
            aux_loss=agreed.aux_loss, expert_load=agreed.expert_load, tokens_dropped=agreed.tokens_dropped,
        ))

    def _drop_gradients(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _oom_mid_step(self, error: torch.OutOfMemoryError) -> torch.OutOfMemoryError:
        """Out of memory inside forward/backward, where the other ranks wait for this one in the step's collectives
        (gradient sync, tensor-parallel gathers, pipeline sends). Skipping would send this rank into the step's
        vote while they wait in another collective: a mismatch that hangs or, on gloo, reads garbage. So it fails
        the command instead, naming the cause; the pool then stops the waiting ranks at once."""
        cfg = self.cfg
        return torch.OutOfMemoryError(
            f"{error}\nOut of memory on rank {dist.get_rank()} in forward/backward of layout {cfg.layout}, "
            f"micro-batch {cfg.micro_batch_size} x {cfg.seq_len} tokens. The step cannot be skipped there: the other "
            "ranks wait for this one inside the step's collectives. Fix: more micro_batches, "
            "activation_checkpointing='full', or a higher zero stage; then pool.restart(), apply and load the last "
            "checkpoint.")

    def _batch(self, step_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Every tp and pp rank of a dp group reads the same slice: tp ranks all need the whole
        # input, the first pipeline stage needs the inputs and the last one the targets.
        tokens = self.data.local_batch(step_index, self.dp_rank, self.dp_size).to(self.device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if self._cp_mesh is not None:  # context parallel: this rank's two balanced chunks of every sequence
            inputs, targets = shard_sequence(inputs, self._cp_mesh), shard_sequence(targets, self._cp_mesh)
        return inputs, targets

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Accumulate the gradient of this dp rank's mean loss; return that loss (detached)."""
        # The probe counts what autograd saves for backward, live, while forwards run. Backward saves nothing for
        # itself (recompute runs under the checkpoint's own hooks), and hooks installed there cost it time.
        if self.pipeline is not None:  # its schedule interleaves forwards and backwards
            with self.probe.activations(inputs):
                return self.pipeline.step(inputs, targets, scale_loss=self.precision.scale)
        model, n = self.modules[0], self.cfg.micro_batches
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            with gradient_sync(model, enabled=i == n - 1):
                with self.probe.span("forward"), self.probe.activations(x), self.precision.autocast():
                    # Divided by n so the accumulated gradient is that of the mean over the whole batch.
                    # A MoE model's balancing loss is not added: its layers' outputs carry it into backward.
                    loss = loss_fn(model(x), y) / n
                if self._routing is not None:
                    self._routing.add(model)
                # Backward outside autocast, as torch recommends: it reuses the forward's dtypes.
                with self.probe.backward():
                    self.precision.scale(loss).backward()
            total += loss.detach()
        return total

    def _begin_routing(self) -> None:
        """Mixture of experts: clear the step's router tally, and weight the balancing loss's gradient as the
        loss's: each micro-batch's loss is divided by the micro-batches, then multiplied by the fp16 loss scale
        (constant within a step: it changes in the optimizer step)."""
        if self._routing is None:
            return
        self._routing.reset()
        scale = (self.precision.loss_scale or 1.0) / self.cfg.micro_batches
        for module in self.modules:
            set_moe_aux_grad_scale(module, scale)

    def _agree(self, loss: torch.Tensor | None, found_inf: torch.Tensor, flags: Flags) -> Agreed:
        # Summed over the world: ranks holding a loss (all but non-last pipeline stages) add it with
        # weight 1; every dp rank's loss is the mean of an equal share, so the mean of them is the
        # global batch's mean, identical everywhere. The votes are counts: > 0 means some rank said yes.
        def scalar(value: float | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(value, dtype=torch.float32, device=self.device).reshape(())

        has_loss = loss is not None
        payload = torch.stack([scalar(loss if has_loss else 0.0), scalar(float(has_loss)), scalar(found_inf),
                               scalar(float(flags.stop)), scalar(float(flags.skip)), scalar(float(flags.oom))])
        if self._routing is not None:  # same payload shape on every rank, whatever happened on this one
            # Mixture of experts rides the same all-reduce: balancing loss (summed over the pipeline stages, then
            # averaged over dp below), router counts and drops (summed: each dp rank routed its own tokens, each
            # stage its own layers). The tp ranks of a dp replica route the same tokens (the MoE FFN is replicated
            # over tp): only the first sends. A rank that ran out of memory sends zeros: its counts are partial.
            counted = not flags.oom and self.mesh.get_local_rank("tp") == 0
            moe = self._routing.payload() if counted else torch.zeros_like(self._routing.payload())
            payload = torch.cat([payload, moe.to(self.device)])
        dist.all_reduce(payload)
        values = payload.tolist()  # the step's one host sync
        loss_sum, weight, overflow, stop, skip, oom = values[:6]
        loss = loss_sum / weight if weight else float("nan")
        extra = {}
        if self._routing is not None:
            layers, experts = self._routing.load.shape
            counts = [round(v) for v in values[7:]]
            # Each dp replica's stages together sent its whole balancing loss once: the mean is over dp.
            extra = dict(aux_loss=values[6] / self.dp_size if weight else float("nan"),
                         expert_load=tuple(tuple(counts[i * experts:(i + 1) * experts]) for i in range(layers)),
                         tokens_dropped=tuple(counts[layers * experts:]))
        # Every rank sees the same sum, so a non-finite loss is a verdict all agree on, at no extra cost.
        return Agreed(loss=loss, stop=stop > 0, skip=skip > 0, overflow=overflow > 0, oom=oom > 0,
                      nonfinite=not math.isfinite(loss), **extra)
