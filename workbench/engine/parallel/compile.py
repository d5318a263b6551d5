"""torch.compile per transformer block (Config.compile), as torchtitan applies it; CUDA Graphs with it on GPU.

Each block's forward is compiled in place (`block.forward = torch.compile(block.forward)`):
parameter names do not change, so checkpoints and reshards are the same with
and without it, and the hooks that FSDP2 and DDP put on the module run
eagerly around the compiled code. Per block rather than the whole model:
every block runs the same code (`TransformerBlock.forward`), and dynamo keeps
one cache per code object with guards on what it depends on (shapes, dtypes,
DTensor placements), not on which block, so one compilation serves them all
and the compile time does not grow with depth; the collectives between blocks
(FSDP2's gathers, the pipeline's sends) stay outside, where they overlap.

A reshard builds new blocks, but the cache stays: a layout seen before in this
process (same local shapes and placements) compiles nothing; a new one compiles
its own graphs (tp=2 shards heads and DTensors, so its graph differs; dp and
ZeRO keep a block's local shapes when the micro-batch is the same). That is why
the recompile limit is raised: a session explores many layouts, and past
dynamo's default of 8 variants a block would silently fall back to eager.

Each compilation is reported as a `Compilation` event (started; then ended),
for the dashboard's timeline and status line: the first step after a new layout
is long, and this says why.

CUDA Graphs (Config.cuda_graphs) are torch.compile's mode="reduce-overhead"
(CUDA graph trees): each compiled block's kernels are captured once and replayed,
removing the per-kernel launch cost. Config refuses them where a block's inputs
move between steps (FSDP2 re-gathers parameters into new memory, offload keeps
them on the host) and where this workbench has not checked them (pipelines,
mixtures of experts); `Workbench.check` refuses them on a device without CUDA.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from workbench.config import Config
from workbench.models.protocol import CausalLM, Unsupported

RECOMPILE_LIMIT = 64
"""Variants one block's code may compile to in a process (dynamo's default is 8): one per layout explored."""


def apply_compile(model: CausalLM, cfg: Config) -> CausalLM:
    """Compile each block of `model` (or a pipeline chunk) in place, when cfg.compile is set."""
    if not cfg.compile:
        return model
    _configure()
    mode = "reduce-overhead" if cfg.cuda_graphs else None
    # A mixture of experts routes tokens with data-dependent indexing: let dynamo break the graph there.
    try:
        routed = {experts.layer for experts in model.routed_experts()}
    except Unsupported:  # experts expert parallel cannot split are still experts
        routed = {int(key) for key in model.block_modules}
    for key, block in model.block_modules.items():
        whole = model.blocks_compile_whole and int(key) not in routed
        block.forward = _settled_inputs(torch.compile(block.forward, backend=cfg.compile_backend, mode=mode,
                                                      fullgraph=whole))
    return model


def _settled_inputs(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`compiled`, given plain tensors for inputs that are a collective still in flight.

    With tensor parallel the first block's input is the embedding's reduce-scatter, left asynchronous by
    torch's RowwiseParallel (an AsyncCollectiveTensor). Handed to compiled code as it is, its gradient comes
    back from the compiled backward as a plain tensor where DTensor's redistribute expects a DTensor (torch
    2.13: "'Tensor' object has no attribute '_local_tensor'"). One eager op settles it first: waits for the
    collective and gives a plain tensor whose gradient flows back through the usual path.
    """
    @functools.wraps(compiled)
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(x, AsyncCollectiveTensor):
            x = x.mul(1)  # not x.wait(): that returns the inner tensor, cut off from autograd
        return compiled(x, *args, **kwargs)

    return forward


def _configure() -> None:
    """Room for a session's layouts in dynamo's caches, and the compile events (registered again if
    `torch._dynamo.reset()`, which clears every callback, ran since)."""
    import torch._dynamo
    from torch._dynamo.callback import callback_handler

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if _started not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_started)
        callback_handler.register_end_callback(_ended)


_open: dict[str, int] = {}


def _started(args) -> None:  # noqa: ANN001 - torch._dynamo.callback.CallbackArgs
    _open[args.compile_id] = time.monotonic_ns()
    _emit(str(args.compile_id), args.callback_trigger.name.lower(), _open[args.compile_id], None)


def _ended(args) -> None:  # noqa: ANN001
    start = _open.pop(args.compile_id, None)
    _emit(str(args.compile_id), args.callback_trigger.name.lower(), start or time.monotonic_ns(), time.monotonic_ns())


def _emit(compile_id: str, trigger: str, start_ns: int, end_ns: int | None) -> None:
    from workbench.pool import rank
    from workbench.telemetry.events import Compilation

    if rank.info is None:  # compiling outside a rank (a test in one process): nobody to tell
        return
    rank.emit(Compilation(rank=rank.get_rank(), compile_id=compile_id, trigger=trigger, start_ns=start_ns,
                          end_ns=end_ns))
