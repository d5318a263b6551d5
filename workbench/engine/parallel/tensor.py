"""Tensor parallel: Megatron column/row splits with sequence parallel, as DTensor plans, from the model's own plan.

Each block is split the Megatron way (Shoeybi et al., 2019), as the model's plan (`block_tp_plan`, transformers'
vocabulary) says: the query/key/value and the MLP's input projections are split by output columns ("colwise"),
so every rank computes its own heads and its own slice of the MLP width with no communication; the attention's
and the MLP's output projections are split by input rows ("rowwise"), so their partial outputs are summed across
the tp axis. That sum is done as a reduce-scatter over the sequence dim instead of an all-reduce (sequence
parallel, Korthikanti et al., 2022): the norms and residual adds between sublayers then run on seq/tp positions
per rank, and the all-gather back to the whole sequence happens at the next sublayer's input. Attention needs no
change: it infers the number of (local) heads from the projected tensor's shape.

The plan names modules inside a block; the rest of the block follows from its structure, the same for every
family (`block_styles`): each child of the block holding planned modules is a sublayer whose input is gathered
(`GatherSequence`); a child whose parameters are all vectors (a norm) runs on the sequence shards
(`SequenceParallel`); any other child with parameters (a mixture of experts: router and experts are not split by
tp) computes the whole sequence on every tp rank and keeps its slice (`ComputeWhole`). Its router and expert
weights are plain tensors, whole on every tp rank, whose gradients come out identical there without a sync (the
output gradient is all-gathered, so each rank backpropagates the whole of it), as long as the kernels are
deterministic: on CPU they are (tests/engine/test_moe.py checks the replicas stay equal); on CUDA, `index_add_`
(the MoE's combine) adds with atomics, which for top_k > 2 could let the replicas drift apart in the last bits.
Experts are split over ranks by ep instead, within the dp axis.

The embedding is split by rows (vocabulary) and the output head by columns, as torchtitan does. With
`loss_parallel` the logits stay sharded over the vocabulary dim and the cross-entropy must run under
`torch.distributed.tensor.parallel.loss_parallel()`; without it they are gathered, so the ordinary loss function
works unchanged. The positions the model is given are set to the whole sequence's: its blocks' inputs hold only a
slice of the tokens.

Float8 linears with tensorwise scales (precision "fp8_tensorwise") take torchao's Float8 styles for their splits
(`Float8ColwiseParallel`, `Float8RowwiseParallel`): the scale of each cast is agreed over the tp ranks. torchtitan
also casts a sublayer's input to fp8 before the sequence-parallel all-gather (`PrepareFloat8ModuleInput`); the
generic gather here (`GatherSequence`, for either calling convention) moves it in its own precision, which the
estimator, pricing torchtitan's runs, does not assume. The rowwise and MX recipes keep the plain styles (their
scales are per row or block, local to each shard), as torchtitan does.

Async TP (Config.async_tp, CUDA only) is torch's micro-pipelined tensor parallel: with
`torch._inductor.config._micro_pipeline_tp` set, inductor finds each all-gather feeding a matmul and each matmul
feeding a reduce-scatter in the compiled block and replaces the pair by a fused op that computes the matmul in tp
chunks while the chunks move through symmetric memory (peers writing into each other's buffers over NVLink), so
only the first (or last) chunk's transfer is waited for. The tp group's symmetric memory is enabled once, here.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workbench.config import Config
from workbench.engine.parallel.tensor_styles import ComputeWhole, GatherSequence, translate
from workbench.models.protocol import CausalLM, Unsupported
from workbench.models.tp import matching, tp_problems


def block_styles(block: nn.Module, plan: dict[str, str], where: str, float8: bool = False) -> dict[str, ParallelStyle]:
    """The DTensor styles of one block, from the model's plan and the block's structure (module docstring);
    `float8`: its linears are torchao Float8Linear with tensorwise scales."""
    styles: dict[str, ParallelStyle] = {}
    names = [name for name, _ in block.named_modules() if name]
    for pattern, style in plan.items():
        for name in matching(names, pattern):
            styles[name] = translate(style, f"{where}.{name}", float8)
    for child, module in block.named_children():
        if any(name.startswith(child + ".") for name in styles):
            styles.setdefault(child, GatherSequence())
        elif child not in styles and (params := list(module.parameters())):
            styles[child] = SequenceParallel() if all(p.dim() == 1 for p in params) else ComputeWhole()
    return styles


def model_styles(model: CausalLM, *, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The styles of the parts outside the blocks; a pipeline stage may lack some of them."""
    parts, styles = model.lm_parts, {}
    if model.embedding_module is not None:
        # Each rank looks up the tokens of its vocabulary rows; the partial sums are reduce-scattered
        # over the sequence dim, which is what the first block's sequence-parallel norm expects.
        styles[parts.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.final_norm is not None:
        styles[parts.norm] = SequenceParallel()
    if model.output_head is not None:
        styles[parts.head] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return styles


def apply_tp(model: CausalLM, tp_mesh: DeviceMesh, cfg: Config, *, loss_parallel: bool = False) -> CausalLM:
    """Split `model` (or a pipeline chunk of it) across the ranks of the 1-D `tp_mesh`, in place."""
    if tp_mesh.size() == 1:
        return model
    problems = tp_problems(model, tp_mesh.size())
    if problems:
        raise Unsupported("; ".join(problems))
    plan = model.block_tp_plan
    # src_data_rank=None: each rank cuts its shards from its own copy, no scatter from rank 0 (one per parameter):
    # every rank holds the same values (on the meta device, nothing yet: they are filled in per piece afterwards).
    parallelize_module(model, tp_mesh, model_styles(model, loss_parallel=loss_parallel), src_data_rank=None)
    float8 = cfg.precision == "fp8_tensorwise"
    for path, block in model.block_paths():
        parallelize_module(block, tp_mesh, block_styles(block, plan, path, float8), src_data_rank=None)
    if model.wb_positions is None:
        model.set_positions(torch.arange(cfg.seq_len))
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
