"""Rank-side probes: what one trainer step did to time, memory and FLOPs.

A `StepProbe` rides along a trainer's step. It opens compute spans in the
compiled recorder (collectives are recorded by the recording backend on
their own), counts the bytes autograd saves for backward as they come and go,
reads memory by category from the actual tensors (local shards under ZeRO and
TP), and turns the step's spans into communication time, exposed
communication and overlap. `NullProbe` is the same interface doing nothing,
so the trainer reads the same with telemetry on or off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from workbench.estimate import flops_per_token
from workbench.telemetry.events import MEMORY_CATEGORIES as CATEGORIES
from workbench.telemetry.events import Interval, StepMetrics


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's shard on this rank, read without going through autograd (to_local would record a node).
    return getattr(t, "_local_tensor", t)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t`: a DTensor's local shard, a plain tensor's own elements."""
    local = _local(t)
    return local.numel() * local.element_size()


def parameter_bytes(modules: list[nn.Module]) -> int:
    """Parameters held now, counting FSDP2's gathered (unsharded) copies while they are allocated."""
    total, seen = 0, set()
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += local_bytes(p)
        for fsdp_param in _fsdp_params(module):
            # While gathered, the module exposes the unsharded parameter and the shard lives on beside it.
            sharded = getattr(fsdp_param, "sharded_param", None)
            if sharded is not None and id(sharded) not in seen:
                seen.add(id(sharded))
                total += local_bytes(sharded)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and id(unsharded) not in seen:
                seen.add(id(unsharded))
                total += unsharded.untyped_storage().nbytes()  # 0 while resharded (storage freed)
    return total


def _fsdp_params(module: nn.Module) -> Iterator[Any]:
    # FSDP2 keeps the gathered parameters apart from the sharded ones the module exposes.
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        if group is not None:
            yield from group.fsdp_params


def gradient_bytes(modules: list[nn.Module]) -> int:
    return sum(local_bytes(p.grad) for m in modules for p in m.parameters() if p.grad is not None)


def optimizer_bytes(optimizers: list[torch.optim.Optimizer], device: torch.device) -> int:
    """Optimizer state held on `device`: with offload (Config.offload) a GPU rank's moments live on the host and
    are not counted; on a CPU rank the host is the device."""
    total = 0
    for opt in optimizers:
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's state in .optim
        for state in inner.state.values():
            total += sum(local_bytes(v) for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device.type == device.type)
    return total


def process_bytes(device: torch.device) -> int:
    """Everything this rank's process holds on its device: RSS on CPU, the caching allocator on CUDA."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ActivationMeter:
    """Bytes the forward graph saves for backward, live: counted when saved, released when the graph frees them.

    Only what the micro-batches in flight add: a saved parameter, or a view of
    one (linear saves its weight transposed), and a saved view of a module
    buffer (`buffers`: the rotary table) share memory the model holds anyway;
    so does a pipeline stage's input, received into a buffer torch allocates
    per micro-batch once and keeps between steps.
    A storage saved by several ops counts once, also when reached through
    wrappers that own none (a DTensor, an async collective's result). Under
    activation checkpointing the checkpoint's own hooks take precedence inside
    checkpointed regions: what they discard is never counted (exactly the
    memory recompute saves), and neither is the block backward rebuilds from
    it, a transient of backward like the gradients in flight. So the peak is
    the end of the forward that leaves the most saved, the moment
    `wb.estimate`'s `activations` describes.
    """

    def __init__(self, buffers: Iterable[torch.Tensor] = ()) -> None:
        self.live = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._ignored = {_storage(b)[0] for b in buffers}

    def reset_peak(self) -> None:
        self.peak = self.live

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        # A leaf that requires grad is a parameter (sharded, gathered by FSDP, or plain) or a pipeline stage's
        # receive buffer, not an activation; a view's memory is its base's. Tensor parallel wraps a received input
        # in a DTensor that is no leaf, so the local tensor is looked at too.
        if _leaf_requiring_grad(t) or _leaf_requiring_grad(_local(t)):
            return t
        # Hold a detached alias, never the tensor itself: an op's own output (rsqrt's, attention's) carries that
        # op's grad_fn, which owns this packed object, a cycle through C++ that Python's gc cannot see. Backward
        # breaks it as it frees the saved tensors, but a graph dropped without backward (the first pipeline stage's
        # shape-inference forward) would then hold its saved tensors for ever. Autograd reattaches the grad_fn on
        # unpack, so nothing is lost.
        t = t.detach()
        ptr, nbytes = _storage(t)
        if not nbytes or ptr in self._ignored:
            return t
        ref = self._refs.get(ptr)
        if ref is None:
            self._refs[ptr] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1
        return _Saved(t, ptr, self)

    def _release(self, ptr: int) -> None:
        ref = self._refs[ptr]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[ptr]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """The address and size of the memory behind `t`, the key under which the meter counts it once.

    Wrapper subclasses own no storage: a DTensor holds its local shard, and an
    async collective's result (the sequence-parallel reduce-scatter after the
    embedding, which the first block's norm saves twice) holds the tensor the
    collective wrote. Each detach makes a new wrapper around the same memory, so
    keyed by the wrapper's identity that memory would count once per save
    (one sharded residual more per micro-batch under tp). So look through to
    the tensor that owns the storage.
    """
    while is_traceable_wrapper_subclass(t):
        # Flattening may name non-tensor parts too (DTensor's device mesh).
        inner = [x for x in (getattr(t, name) for name in t.__tensor_flatten__()[0]) if isinstance(x, torch.Tensor)]
        if len(inner) != 1:
            break
        t = inner[0]
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:  # a subclass with several inner tensors, or none: only itself to go by
        return id(t), t.numel() * t.element_size()


def _leaf_requiring_grad(t: torch.Tensor) -> bool:
    base = t if t._base is None else t._base
    return base.is_leaf and base.requires_grad


class _Saved:
    """What autograd stores instead of the tensor; when the graph drops it, its bytes are released."""

    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: torch.Tensor, ptr: int, meter: ActivationMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter._release(self.ptr)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


class NullProbe:
    """Telemetry off: the trainer's calls cost nothing and the metrics keep their empty defaults."""

    enabled = False

    def span(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def activations(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def begin_step(self) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def finish(self, metrics: StepMetrics) -> StepMetrics:
        return metrics


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
        # Model FLOPs of one step on this rank: the whole step's, shared by every rank.
        self.flops = flops_per_token(cfg.model, cfg.seq_len) * cfg.tokens_per_step / dist_world_size()
        self.peak_flops, self.peak_source = peak_flops_for(self.device, cfg.precision)
        self.spans: list[Interval] = []
        self.actions: list[tuple[int, int, str, int, int]] = []
        self._after_backward: dict[str, int] = {}
        self._params_peak = 0
        self._last_grad_ns = 0
        self._optimizer_start = 0
        for module in trainer.modules:
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
        for opt in trainer.optimizers:
            inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: time the local step, not the broadcast
            inner.register_step_pre_hook(self._optimizer_begins)
            inner.register_step_post_hook(self._optimizer_ends)
        if trainer.pipeline is not None:
            trainer.pipeline.on_action = self._pipeline_action
        # On a GPU, compute spans are CUDA event marks on the compute stream, resolved at step end with the
        # backend's marks of each collective (cuda_step); host clocks would time the launches, not the work.
        self.gpu = None
        if self.device.type == "cuda":
            from workbench.telemetry.cuda_step import CudaStepClock

            self.gpu = CudaStepClock(self.device)
        self._optimizer_token = 0
        native.recorder().set_enabled(True)

    # -- hooks --------------------------------------------------------------------------------------
    def _grad_ready(self, _param: torch.Tensor) -> None:
        if self.gpu is not None:
            self.gpu.roll()  # runs on the stream autograd computed this gradient on
            return
        self._last_grad_ns = self.native.now_ns()

    def _optimizer_begins(self, *_: Any) -> None:
        if self.gpu is not None:
            self._optimizer_token = self.gpu.begin("compute", "optimizer")
            return
        self._optimizer_start = self.native.now_ns()

    def _optimizer_ends(self, *_: Any) -> None:
        if self.gpu is not None:
            self.gpu.end(self._optimizer_token)
            return
        self.spans.append(Interval("compute", "optimizer", self._optimizer_start, self.native.now_ns()))

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
        self._params_peak = max(self._params_peak, parameter_bytes(self.trainer.modules))
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
        start = self.native.now_ns()
        yield
        end = self._last_grad_ns if self._last_grad_ns > start else self.native.now_ns()
        self.spans.append(Interval("compute", "backward", start, end))

    def activations(self) -> contextlib.AbstractContextManager:
        return self.meter.watching()

    def begin_step(self) -> None:
        self.native.drain()  # spans from between steps (a checkpoint, user code) belong to no step
        if self.gpu is not None:
            self.gpu.begin_step()
        self.spans, self.actions = [], []
        self._params_peak = 0
        self.meter.reset_peak()

    def after_backward(self) -> None:
        modules = self.trainer.modules
        self._after_backward = {"parameters": parameter_bytes(modules), "gradients": gradient_bytes(modules),
                                "process": process_bytes(self.device)}

    def finish(self, metrics: StepMetrics) -> StepMetrics:
        gpu_spans = self.gpu.finish() if self.gpu is not None else []
        intervals = tuple(sorted([*self.native.drain(), *self.spans, *gpu_spans], key=lambda iv: iv.start_ns))
        comm_s, exposed_s, overlap = self.native.step_summary(intervals)
        modules = self.trainer.modules
        current = {
            "parameters": parameter_bytes(modules),
            "gradients": gradient_bytes(modules),
            "optimizer": optimizer_bytes(self.trainer.optimizers, self.trainer.device),
            "activations": self.meter.live,
        }
        process = process_bytes(self.device)
        current["other"] = max(0, process - sum(current.values()))
        after = self._after_backward or {}
        peak = {
            "parameters": max(current["parameters"], after.get("parameters", 0), self._params_peak),
            "gradients": max(current["gradients"], after.get("gradients", 0)),
            "optimizer": current["optimizer"],
            "activations": self.meter.peak,
        }
        peak["other"] = max(0, max(process, after.get("process", 0)) - sum(peak.values()))
        mfu = self.flops / metrics.step_time_s / self.peak_flops if self.peak_flops else None
        return dataclasses.replace(metrics, memory=current, peak_memory=peak, comm_time_s=comm_s,
                                   exposed_comm_s=exposed_s, overlap=overlap, flops=self.flops, mfu=mfu,
                                   mfu_basis=self.peak_source, intervals=intervals,
                                   pipeline_actions=tuple(self.actions), device_memory=self._device_memory())

    def _device_memory(self) -> dict[str, int]:
        if self.device.type != "cuda":
            return {}
        from workbench.telemetry.cuda_step import device_memory

        return device_memory(self.device)


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
