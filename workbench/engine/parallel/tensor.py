"""Tensor parallel: Megatron column/row splits with sequence parallel, as DTensor plans.

Each block is split the Megatron way (Shoeybi et al., 2019): wq/wk/wv and w1/w3
are split by output columns, so every rank computes its own heads and its own
slice of the MLP width with no communication; wo and w2 are split by input
rows, so their partial outputs are summed across the tp axis. That sum is done
as a reduce-scatter over the sequence dim instead of an all-reduce (sequence
parallel, Korthikanti et al., 2022): the norms and residual adds between
blocks then run on seq/tp positions per rank, and the all-gather back to the
full sequence happens at the next block's input. Attention needs no change:
it infers the number of (local) heads from the projected tensor's shape, and
rotary embedding rotates whichever heads it is given.

The embedding table is split by rows (vocabulary) and the output head by
columns, as torchtitan does. With `loss_parallel` the logits stay sharded over
the vocabulary dim and the cross-entropy must run under
`torch.distributed.tensor.parallel.loss_parallel()`; without it they are
gathered, so the ordinary loss function works unchanged.

A mixture-of-experts FFN is not split by tp (`moe_block_plan`): its input is
all-gathered over the sequence dim, every tp rank routes the whole sequences
(the routing group) and runs every expert on them, the same computation on
the same data, and each keeps its own sequence shard of the output. The
router and expert weights are plain tensors, whole on every tp rank, whose
gradients come out identical there without a sync (the output gradient is
all-gathered, so each rank backpropagates the whole of it), as long as the
kernels are deterministic: on CPU they are (tests/engine/test_moe.py checks
the replicas stay equal); on CUDA, `index_add_` (the MoE's combine) adds
with atomics, which for top_k > 2 could let the replicas drift apart in the
last bits. Experts are split over ranks by ep instead, within the dp axis.

Float8 linears with tensorwise scales (precision "fp8_tensorwise") take
torchao's Float8 styles instead of the plain ones (`Float8ColwiseParallel`,
`Float8RowwiseParallel`, `PrepareFloat8ModuleInput`): the input is cast to fp8
before the sequence-parallel all-gather, which then moves one byte an element,
and the cast's scale is agreed over the tp ranks. The rowwise and MX recipes
keep the plain styles (their scales are per row or block, local to each shard),
as torchtitan does.

Async TP (Config.async_tp, CUDA only) is torch's micro-pipelined tensor
parallel: with `torch._inductor.config._micro_pipeline_tp` set, inductor finds
each all-gather feeding a matmul and each matmul feeding a reduce-scatter in
the compiled block and replaces the pair by a fused op that computes the matmul
in tp chunks while the chunks move through symmetric memory (peers writing into
each other's buffers over NVLink), so only the first (or last) chunk's transfer
is waited for. The tp group's symmetric memory is enabled once, here.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workbench.config import Config
from workbench.engine.model import MoEFeedForward, Transformer


def _styles(float8: bool) -> tuple[type, type, type]:
    """(column, row, module-input) styles: torch's, or torchao's Float8 ones for tensorwise Float8 linears."""
    if not float8:
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def block_plan(float8: bool = False) -> dict[str, ParallelStyle]:
    """The plan of one transformer block; its input and output are sharded over the sequence dim. `float8`: its
    linears are torchao Float8Linear with tensorwise scales (their inputs gathered in fp8)."""
    colwise, rowwise, prepare = _styles(float8)
    return {
        "attention_norm": SequenceParallel(),
        # Gather the sequence before the projections: every rank needs all positions for its heads.
        # The second input (the rotary table) is a plain replicated buffer and passes through.
        "attention": prepare(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(),
        "feed_forward.w3": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
    }


def moe_block_plan() -> dict[str, ParallelStyle]:
    """The plan of a block whose FFN is a mixture of experts: attention as in `block_plan`; the MoE FFN gets the
    whole sequence as a plain tensor (an all-gather), computes it replicated on every tp rank, and hands on its
    rank's sequence shard (a slice; backward: an all-gather of the output gradient, a slice of the input's)."""
    # Float8 converts no expert (parallel/float8.py): the MoE block keeps torch's styles.
    plan = {name: style for name, style in block_plan().items() if not name.startswith("feed_forward")}
    plan["feed_forward"] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
    return plan


def model_plan(model: Transformer, *, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The plan of the parts outside the blocks; a pipeline stage may lack some of them."""
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        # Each rank looks up the tokens of its vocabulary rows; the partial sums are reduce-scattered
        # over the sequence dim, which is what the first block's sequence-parallel norm expects.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, cfg: Config, *, loss_parallel: bool = False) -> Transformer:
    """Split `model` (or a pipeline chunk of it) across the ranks of the 1-D `tp_mesh`, in place."""
    if tp_mesh.size() == 1:
        return model
    # src_data_rank=None: each rank cuts its shards from its own copy, no scatter from rank 0 (one per parameter):
    # every rank built the same weights from the seed.
    parallelize_module(model, tp_mesh, model_plan(model, loss_parallel=loss_parallel), src_data_rank=None)
    float8 = cfg.precision == "fp8_tensorwise"
    for block in model.layers.values():
        moe = isinstance(block.feed_forward, MoEFeedForward)
        parallelize_module(block, tp_mesh, moe_block_plan() if moe else block_plan(float8), src_data_rank=None)
    if cfg.async_tp:
        enable_async_tp(tp_mesh)
    else:
        _disable_async_tp()
    return model


def _disable_async_tp() -> None:
    # The pass is a process-wide inductor setting: a layout without async TP after one with it turns it off.
    config = sys.modules.get("torch._inductor.config")
    if config is not None and getattr(config, "_micro_pipeline_tp", False):
        config._micro_pipeline_tp = False


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor micro-pipeline the tp group's collectives with their matmuls (module docstring); CUDA only:
    the fused ops move the chunks through CUDA symmetric memory. Config.check_device refuses async_tp elsewhere
    before any rank is touched; a rank reached some other way refuses here, saying why."""
    if tp_mesh.device_type != "cuda":
        raise RuntimeError(f"async_tp: async TP exchanges tensor parallel's shards through CUDA symmetric memory, and "
                           f"this rank's tp group is on {tp_mesh.device_type}. Fix: set async_tp=False off CUDA")
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def reduce_partial_gradients(modules) -> None:
    """Sum the gradients that backward left Partial over a mesh, once, in place; every rank calls it after backward.

    Sequence parallel leaves each norm weight's gradient Partial over tp: every rank summed the positions of its
    own sequence shard. Left so, every optimizer op that reads it all-reduces it anew (AdamW: three per norm weight
    per step, each a latency-bound message). Reduced here, they cost one all-reduce per step per tp group, all the
    norms of a stage coalesced into one buffer, as Megatron-LM all-reduces its layernorm gradients under sequence
    parallel. The sums are the ones the optimizer's own reductions made, so the updates are unchanged.
    """
    pending: dict[tuple, list[torch.nn.Parameter]] = {}
    for module in modules:
        for p in module.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                pending.setdefault((g.device_mesh, tuple(g.placements), g.dtype), []).append(p)
    for (mesh, placements, _), params in pending.items():
        replicated = [Replicate() if pl.is_partial() else pl for pl in placements]
        if mesh.ndim != 1 or placements[0].reduce_op != "sum":
            for p in params:  # not the sequence-parallel case: one reduction each, by DTensor's own rules
                p.grad = p.grad.redistribute(mesh, replicated)
            continue
        locals_ = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, local, piece in zip(params, locals_, flat.split([t.numel() for t in locals_])):
            p.grad = DTensor.from_local(piece.view_as(local), mesh, replicated, run_check=False)
