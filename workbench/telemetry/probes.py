"""Rank-side probes: what one trainer step did to time, memory and FLOPs.

A `StepProbe` rides along a trainer's step. It opens compute spans in the
compiled recorder (collectives are recorded by the recording backend on
their own), counts the bytes autograd saves for backward as they come and go
(`telemetry.activations`: on the steps its sampling watches, the last figure
with its step on the others), reads memory by category from the actual tensors
(`telemetry.memory`: local shards under ZeRO and TP), and turns the step's
spans into communication time, exposed communication and overlap. `NullProbe` is the same interface doing nothing,
so the trainer reads the same with telemetry on or off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterator

import torch

from workbench.flops import flops_per_token
from workbench.telemetry.activations import ActivationMeter, MeterSampling
from workbench.telemetry.analysis import step_summary
from workbench.telemetry.events import Interval, StepMetrics
from workbench.telemetry.grad_sync import grad_sync_bytes
from workbench.telemetry.memory import ModelMemory, process_bytes


class NullProbe:
    """Telemetry off: the trainer's calls cost nothing and the metrics keep their empty defaults."""

    enabled = False

    def span(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def activations(self, batch: torch.Tensor) -> contextlib.AbstractContextManager:
        """Around a forward of `batch` (a micro-batch, or a pipeline step's whole batch)."""
        return contextlib.nullcontext()

    def begin_step(self) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def before_vote(self) -> None:
        pass

    def finish(self, metrics: StepMetrics) -> StepMetrics:
        return metrics

    def close(self) -> None:
        """Take the probe's hooks off the trainer's parameters, optimizers and pipeline (the trainer is done)."""


class StepProbe(NullProbe):
    """Telemetry on: spans, memory by category, FLOPs and MFU for every step of one trainer.

    Compute spans cover computation only, never a wait for communication, or
    overlap would read higher than it is: backward ends at the last gradient
    produced (not when DDP's final bucket wait returns), the optimizer span is
    the inner optimizer's own step (not ZeRO-1's parameter broadcast), and a
    pipeline's compute is its measured F/B actions.
    """

    enabled = True

    def __init__(self, trainer: Any) -> None:
        from workbench.telemetry import comm, native

        if comm.recording_backend_of(device=trainer.device.type) is None:
            # Without it the timeline would show no communication at all: a wrong picture, not a smaller one.
            raise RuntimeError("telemetry needs the recording communication backend on the ranks: start the pool "
                               'with backend_setup="workbench.telemetry.comm:register" (wb.Workbench does), or '
                               "build the trainer with telemetry=False")
        self.native, self.trainer, self.device = native, trainer, trainer.device
        cfg = trainer.cfg
        self.meter = ActivationMeter(buffers=[b for module in trainer.modules for b in module.buffers()])
        # A mixture of experts' router decides each step how many tokens every expert keeps, so what it saves.
        self.sampling = MeterSampling(every_step=bool(cfg.model.n_experts))
        self._watching: bool | None = None  # whether the meter watches this step; decided at its first forward
        self.memory = ModelMemory(trainer.modules, trainer.optimizers, trainer.device)
        self._now = native.load().now_ns  # the native clock, looked up once: hooks call it for every gradient
        self._sync_groups = _sync_groups(trainer)
        # Model FLOPs of one step on this rank: the whole step's, shared by every rank.
        self.flops = flops_per_token(cfg.model, cfg.seq_len) * cfg.tokens_per_step / dist_world_size()
        self.peak_flops, self.peak_source = peak_flops_for(self.device, cfg.precision)
        self.spans: list[Interval] = []
        self.actions: list[tuple[int, int, str, int, int]] = []
        self._after_backward: dict[str, int] = {}
        self._params_peak = 0
        self._last_grad_ns = 0
        self._optimizer_start = 0
        # Every hook holds the probe weakly and is removed by close(). A gradient hook is kept by the parameter's
        # C++ autograd metadata, which Python's gc cannot see into: a bound method there made parameter -> probe ->
        # trainer -> model -> parameter a cycle no collection could break, so every apply kept the old model,
        # optimizer and data alive (issue 17).
        self._handles = [p.register_post_accumulate_grad_hook(_weakly(self._grad_ready))
                         for module in trainer.modules for p in module.parameters() if p.requires_grad]
        for opt in trainer.optimizers:
            inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: time the local step, not the broadcast
            self._handles += [inner.register_step_pre_hook(_weakly(self._optimizer_begins)),
                              inner.register_step_post_hook(_weakly(self._optimizer_ends))]
        if trainer.pipeline is not None:
            trainer.pipeline.on_action = _weakly(self._pipeline_action)
        # On a GPU, compute spans are CUDA event marks on the compute stream, resolved at step end with the
        # backend's marks of each collective (cuda_step); host clocks would time the launches, not the work.
        self.gpu = None
        if self.device.type == "cuda":
            from workbench.telemetry.cuda_step import CudaStepClock

            self.gpu = CudaStepClock(self.device)
        self._optimizer_token = 0
        self._vote_ns = 0
        native.recorder().set_enabled(True)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.trainer.pipeline is not None:
            self.trainer.pipeline.on_action = None

    # -- hooks --------------------------------------------------------------------------------------
    def _grad_ready(self, _param: torch.Tensor) -> None:
        if self.gpu is not None:
            self.gpu.roll()  # runs on the stream autograd computed this gradient on
            return
        self._last_grad_ns = self._now()

    def _optimizer_begins(self, *_: Any) -> None:
        if self.gpu is not None:
            self._optimizer_token = self.gpu.begin("compute", "optimizer")
            return
        self._optimizer_start = self._now()

    def _optimizer_ends(self, *_: Any) -> None:
        if self.gpu is not None:
            self.gpu.end(self._optimizer_token)
            return
        self.spans.append(Interval("compute", "optimizer", self._optimizer_start, self._now()))

    def _pipeline_action(self, kind: str, stage: int, microbatch: int, start_ns: int, end_ns: int) -> None:
        self.actions.append((stage, microbatch, kind, start_ns, end_ns))
        # Named as torch's schedules write actions ("1F0": stage 1, forward, micro-batch 0).
        self.spans.append(Interval("compute", f"{stage}{kind}{microbatch}", start_ns, end_ns))

    # -- the trainer's calls ------------------------------------------------------------------------
    def span(self, name: str) -> contextlib.AbstractContextManager:
        if self.gpu is not None:
            return self.gpu.span(name)
        return self.native.span("compute", name)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        # The end of forward: what ZeRO-2 keeps gathered (and ZeRO-3 has freed) until backward.
        self._params_peak = max(self._params_peak, self.memory.parameter_bytes())
        if self.gpu is not None:
            self.gpu.drop_rolling()  # a stray roll before backward (user code) would end it too early
            token = self.gpu.begin("compute", "backward")
            try:
                yield
            except BaseException:
                self.gpu.cancel(token)
                raise
            # The last gradient's mark, not a mark now: the stream may already be waiting for DDP's last bucket.
            self.gpu.end(token, self.gpu.take_rolling())
            return
        start = self._now()
        yield
        end = self._last_grad_ns if self._last_grad_ns > start else self._now()
        self.spans.append(Interval("compute", "backward", start, end))

    def activations(self, batch: torch.Tensor) -> contextlib.AbstractContextManager:
        if self._watching is None:
            self._watching = self.sampling.watch((tuple(batch.shape), batch.dtype))
        return self.meter.watching() if self._watching else contextlib.nullcontext()

    def begin_step(self) -> None:
        self.native.drain()  # spans from between steps (a checkpoint, user code) belong to no step
        if self.gpu is not None:
            self.gpu.begin_step()
        self.spans, self.actions = [], []
        self._params_peak = 0
        self._watching = None
        self.meter.reset_peak()

    def after_backward(self) -> None:
        self._after_backward = {"parameters": self.memory.parameter_bytes(), "gradients": self.memory.gradient_bytes(),
                                "process": process_bytes(self.device)}

    def before_vote(self) -> None:
        # On the native recorder's clock: the dp group's collectives before this moment are the gradient sync,
        # the step's vote (on the world group, which is the dp group on a 1-D mesh) and what follows are not.
        self._vote_ns = self._now()

    def _grad_sync_bytes(self, intervals: tuple[Interval, ...]) -> int:
        """Bytes the gradient sync sent in the step, from the recorded collectives (0 without replicas).

        The sync runs over the trainer's gradient mesh: dp, or dp·cp with context parallel; under HSDP (a 2-D
        mesh) FSDP2 reduce-scatters within the shard group, then all-reduces across the replicate group."""
        return sum(grad_sync_bytes(intervals, label, zero, before_ns=self._vote_ns)
                   for label, zero in self._sync_groups)

    def finish(self, metrics: StepMetrics) -> StepMetrics:
        gpu_spans = self.gpu.finish() if self.gpu is not None else []
        intervals = tuple(sorted([*self.native.drain(), *self.spans, *gpu_spans], key=lambda iv: iv.start_ns))
        comm_s, exposed_s, overlap = step_summary(intervals)
        if self._watching:
            self.sampling.measured(metrics.step, self.meter.peak, self.meter.live)
        activations = self.sampling.latest  # this step's, or the last watched step's
        current = {
            "parameters": self.memory.parameter_bytes(),
            "gradients": self.memory.gradient_bytes(),
            "optimizer": self.memory.optimizer_bytes(),
            "activations": activations.live if activations else 0,
        }
        process = process_bytes(self.device)
        current["other"] = max(0, process - sum(current.values()))
        after = self._after_backward or {}
        peak = {
            "parameters": max(current["parameters"], after.get("parameters", 0), self._params_peak),
            "gradients": max(current["gradients"], after.get("gradients", 0)),
            "optimizer": current["optimizer"],
            "activations": activations.peak if activations else 0,
        }
        peak["other"] = max(0, max(process, after.get("process", 0)) - sum(peak.values()))
        mfu = self.flops / metrics.step_time_s / self.peak_flops if self.peak_flops else None
        return dataclasses.replace(metrics, memory=current, peak_memory=peak, comm_time_s=comm_s,
                                   exposed_comm_s=exposed_s, overlap=overlap, flops=self.flops, mfu=mfu,
                                   mfu_basis=self.peak_source, intervals=intervals,
                                   pipeline_actions=tuple(self.actions), device_memory=self._device_memory(),
                                   grad_sync_bytes=self._grad_sync_bytes(intervals),
                                   activations_step=activations.step if activations else None)

    def _device_memory(self) -> dict[str, int]:
        if self.device.type != "cuda":
            return {}
        from workbench.telemetry.cuda_step import device_memory

        return device_memory(self.device)


def _sync_groups(trainer: Any) -> list[tuple[str, int]]:
    """The groups the gradient sync runs on, as the recording backend labels them, each with the ZeRO stage that
    says which of its collectives are the sync; fixed by the layout, so found once (a mesh lookup costs ~0.1 ms)."""
    mesh, zero = trainer.dp_mesh, trainer.cfg.zero
    if mesh.size() == 1:
        return []
    if mesh.ndim == 2:  # HSDP: reduce-scatter in the shard group, all-reduce across the replicas
        return [(_group_label(mesh.get_group(1)), zero), (_group_label(mesh.get_group(0)), 0)]
    return [(_group_label(mesh.get_group()), zero)]


def _group_label(group: Any) -> str:
    """A process group as the recording backend names it: its description, else its name."""
    desc = getattr(group, "group_desc", "")
    return group.group_name if desc in ("", "undefined") else desc


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """`method` as a hook that does not keep its object alive (and does nothing once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        target = ref()
        if target is not None:
            target(*args)

    return hook


def dist_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def peak_flops_for(device: torch.device, precision: str) -> tuple[float | None, str]:
    """The peak the MFU divides by, and where it comes from (a datasheet, or measured on this rank)."""
    from workbench import hardware

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return hardware.profile(key).peak(precision), f"{key.upper()} datasheet"
        return None, f"unknown GPU {name!r}: no MFU"
    return hardware.measure_cpu().peak(precision), "measured matmul peak of this CPU rank"
