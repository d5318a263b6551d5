"""The DTensor parallel styles tensor parallel is made of: a model's plan (transformers' style names) translated,
and the two styles a sequence-parallel block needs that torch's own do not cover for any calling convention.

Under sequence parallel the residual stream between sublayers holds each rank's slice of the sequence (Shard(1)).
A sublayer the plan splits (attention, an MLP) takes the whole sequence: `GatherSequence` all-gathers its input,
however the block passes it (first positional argument, or `hidden_states=` as transformers' blocks do). A sublayer
the plan leaves whole but that holds matrices (a mixture of experts' router and experts) computes the whole
sequence on every tp rank and keeps its slice of the output: `ComputeWhole`. Their weights' gradients then come out
equal on every tp rank with no sync (each rank backpropagates the whole gradient), as long as the kernels are
deterministic.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from workbench.models.protocol import Unsupported


def _whole(x: Any, mesh: DeviceMesh) -> Any:
    """A sequence-sharded activation (a local slice, or a DTensor) as a DTensor of the whole sequence."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()])
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])


def _first_input(args: tuple, kwargs: dict, change) -> tuple[tuple, dict]:
    if args:
        return (change(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}
    raise Unsupported("a sublayer under sequence parallel must take the hidden states first, or as hidden_states=")


class GatherSequence(ParallelStyle):
    """A sublayer the plan splits: its input gathered from the sequence shards to the whole sequence (a DTensor,
    which the split linear layers take as their replicated input). What PrepareModuleInput(Shard(1) → Replicate)
    does for a positional input, for either calling convention."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _first_input(args, kwargs, lambda x: _whole(x, device_mesh))

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


class ComputeWhole(ParallelStyle):
    """A sublayer with matrices the plan leaves whole: it computes the whole sequence (its input gathered, as a plain
    tensor) on every tp rank, and hands on this rank's sequence slice of its output (backward: the output's gradient
    gathered, the input's sliced). PrepareModuleInputOutput's arithmetic, for either calling convention."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _first_input(args, kwargs, lambda x: _whole(x, device_mesh).to_local())

        def keep_slice(_module: nn.Module, _args: tuple, output: Any) -> Any:
            def cut(out):
                return DTensor.from_local(out, device_mesh, [Replicate()], run_check=False).redistribute(
                    device_mesh, [Shard(1)]).to_local()
            return (cut(output[0]), *output[1:]) if isinstance(output, tuple) else cut(output)

        module.register_forward_pre_hook(gather, with_kwargs=True)
        module.register_forward_hook(keep_slice)
        return module


def _splits(float8: bool) -> tuple[type, type]:
    """(column, row) split styles: torch's, or torchao's Float8 ones for Float8 linears with tensorwise scales."""
    if not float8:
        return ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel, Float8RowwiseParallel


def translate(style: str, where: str, float8: bool = False) -> ParallelStyle:
    """A plan's style name (transformers' vocabulary) as a DTensor style inside a sequence-parallel block: a row
    split's partial sums are reduce-scattered onto the sequence shards (Shard(1)) rather than all-reduced.
    `float8`: the module is a torchao Float8Linear with tensorwise scales (its splits agree the scale over tp)."""
    colwise, rowwise = _splits(float8)
    if style == "colwise":
        return colwise()
    if style == "rowwise":
        return rowwise(output_layouts=Shard(1))
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise_rep", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if style == "replicated_with_grad_allreduce":
        # Parameters whole on every rank, input this rank's own slice (its heads, for a per-head norm): torch's
        # SequenceParallel is exactly that (Replicate parameters, gradients left Partial and summed after backward by
        # `reduce_partial_gradients`); the sharded dim only has to be one the module does not reduce over, and dim 0
        # (the batch) is that for every norm along the last dim.
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    raise Unsupported(f"{where}: tensor-parallel style {style!r} is not one the workbench lays out (colwise, rowwise, "
                      "colwise_rep, rowwise_rep, replicated_with_grad_allreduce)")
