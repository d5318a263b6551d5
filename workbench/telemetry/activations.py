"""Activations as autograd keeps them: the bytes saved for backward, counted live as they are saved and freed.

`ActivationMeter` is a saved-tensor hook pair. Each saved storage is counted
once however many ops save it (views, wrappers such as DTensor), parameters
and the model's own buffers are not activations, and the meter keeps only
detached aliases, so a graph dropped without backward frees as it should.

`MeterSampling` says which steps the meter watches. Watching costs a dense
step ~2% (a Python call per saved tensor, and the alias that keeps autograd
from reusing a saved buffer), yet a dense layout at fixed shapes saves the
same bytes every step: the meter watches a layout's first steps until two
agree, then every `REMEASURE_EVERY`-th step and any step whose batch shape
changed, and the steps between report the last measured figure with the step
it was measured at (`StepMetrics.activations_step`).
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from workbench.telemetry.memory import local_tensor


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
        # Autograd calls this for every tensor a forward saves (~180 a step of the tiny model), so a plain tensor
        # takes a short path; a wrapper subclass (DTensor, an async collective's result) the general one.
        if type(t) in _PLAIN:
            base = t._base
            if base is None:
                base = t
            # A leaf that requires grad is a parameter (sharded, gathered by FSDP, or plain) or a pipeline stage's
            # receive buffer, not an activation; a view's memory is its base's.
            if base.is_leaf and base.requires_grad:
                return _Kept(t)
            # Hold a detached alias, never the tensor itself: an op's own output (rsqrt's, attention's) carries
            # that op's grad_fn, which owns this packed object, a cycle through C++ that Python's gc cannot see.
            # Backward breaks it as it frees the saved tensors, but a graph dropped without backward (the first
            # pipeline stage's shape-inference forward) would then hold its saved tensors for ever. Autograd
            # reattaches the grad_fn on unpack, so nothing is lost.
            t = t.detach()
            try:
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # no storage to go by (a sparse tensor): only itself
                ptr, nbytes = id(t), t.numel() * t.element_size()
        else:
            # Tensor parallel wraps a received input in a DTensor that is no leaf, so the local tensor is looked
            # at too.
            if _leaf_requiring_grad(t) or _leaf_requiring_grad(local_tensor(t)):
                return _Kept(t)
            t = t.detach()
            ptr, nbytes = _storage(t)
        if not nbytes or ptr in self._ignored:
            return _Kept(t)
        ref = self._refs.get(ptr)
        if ref is None:
            self._refs[ptr] = ref = [0, nbytes]
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        ref[0] += 1
        return _Saved(t, ptr, ref, self)


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
"""Tensor types that are no wrapper: their storage is their own, and `local_tensor` of one is itself."""


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


class _Kept:
    """What autograd stores for a tensor the meter does not count (a parameter, a buffer, an empty tensor)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Saved:
    """What autograd stores instead of a counted tensor; when the graph drops it, its bytes are released."""

    __slots__ = ("tensor", "ptr", "ref", "meter")

    def __init__(self, tensor: torch.Tensor, ptr: int, ref: list[int], meter: ActivationMeter) -> None:
        self.tensor, self.ptr, self.ref, self.meter = tensor, ptr, ref, meter

    def __del__(self) -> None:
        ref = self.ref
        ref[0] -= 1
        if not ref[0]:
            meter = self.meter
            meter.live -= ref[1]
            del meter._refs[self.ptr]


# Both packed kinds keep the tensor as `.tensor`: unpacking is then an attribute read in C, no Python frame.
_unpack = operator.attrgetter("tensor")


REMEASURE_EVERY = 10
"""A settled layout's meter watches one step in this many: its cost on a dense step is then ~0.2%, and a figure
is at most this many steps old."""


@dataclass(frozen=True)
class Measured:
    """The meter's figures of one watched step."""

    step: int
    peak: int
    """Bytes saved for backward at their peak in the step."""
    live: int
    """Bytes still saved at the step's end (0 when backward freed everything)."""


class MeterSampling:
    """Which steps the activation meter watches, and the figure the others report.

    A layout's steps are watched until two in a row measure the same (the first
    step may differ: a pipeline's shape inference, lazy initialisation); then
    it is settled, and only every `every`-th step is watched, or a step whose
    batch shape is new. A watched step that measures something else unsettles
    it again. `every_step` is for layouts whose saved bytes depend on the data
    (a mixture of experts: the router decides how many tokens each expert keeps).
    """

    def __init__(self, every: int = REMEASURE_EVERY, every_step: bool = False) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1 step, got {every}")
        self.every, self.every_step = every, every_step
        self.latest: Measured | None = None
        """The last watched step's figures; None before one."""
        self._settled = False
        self._shape: tuple | None = None
        self._unwatched = 0  # steps since the last watched one

    def watch(self, shape: tuple) -> bool:
        """Whether the meter watches this step, whose (first micro-)batch has `shape`; asked once a step."""
        if self.every_step or not self._settled or shape != self._shape or self._unwatched + 1 >= self.every:
            self._shape, self._unwatched = shape, 0
            return True
        self._unwatched += 1
        return False

    def measured(self, step: int, peak: int, live: int) -> None:
        """What the meter saw in the step it watched; the step settles the layout if it repeats the last figure."""
        latest = self.latest
        self._settled = latest is not None and (latest.peak, latest.live) == (peak, live)
        self.latest = Measured(step, peak, live)
