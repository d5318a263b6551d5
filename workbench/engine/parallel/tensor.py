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
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workbench.config import Config
from workbench.engine.model import Transformer


def block_plan() -> dict[str, ParallelStyle]:
    """The plan of one transformer block; its input and output are sharded over the sequence dim."""
    return {
        "attention_norm": SequenceParallel(),
        # Gather the sequence before the projections: every rank needs all positions for its heads.
        # The second input (the rotary table) is a plain replicated buffer and passes through.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


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
    parallelize_module(model, tp_mesh, model_plan(model, loss_parallel=loss_parallel))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())
    return model

