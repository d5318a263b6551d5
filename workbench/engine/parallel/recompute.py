"""Activation checkpointing: keep a block's input, recompute its insides in backward.

A checkpointed block stores only its input during forward; backward runs its
forward again to rebuild the activations it needs. That trades one extra
forward of the block for its activation memory. "selective" does this for
every other block (about half the saving for half the recomputation), "full"
for every block. The non-reentrant implementation is used: it composes with
DTensor, FSDP2 hooks and inputs that do not require grad.

"op" is torchtitan's selective op policy, through torch's selective
checkpoint API (`create_selective_checkpoint_contexts`): every block is
checkpointed, but the outputs of every other matmul (wq, wv, w1, w2 of its
seven) and of attention (and, under tensor parallel, of the sequence-parallel
reduce-scatters) are kept from forward; backward's recomputation runs only the
rest (the norms, rotary, wk, wo, w3, SwiGLU's activation), which costs little
compute for most of the memory.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from workbench.config import Config, checkpointed_blocks
from workbench.models.protocol import CausalLM

_aten, _c10d = torch.ops.aten, torch.ops._c10d_functional
OP_POLICY_SAVES = frozenset({
    _aten.mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,  # the CPU kernel, so CPU runs keep what GPUs do
    _c10d.reduce_scatter_tensor.default,
})
"""The ops whose outputs the "op" policy keeps (torchtitan's `_save_list`, with the CPU attention kernel)."""


def op_policy() -> Callable[[Any, Any], CheckpointPolicy]:
    """One block's policy for one forward (and its recomputation): keep the outputs of OP_POLICY_SAVES, except
    every second matmul, counted separately in forward and in recomputation so both pick the same ones."""
    counts: defaultdict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is _aten.mm.default:
            counts["recompute" if ctx.is_recompute else "forward"] += 1
            if counts["recompute" if ctx.is_recompute else "forward"] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in OP_POLICY_SAVES else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_contexts():
    return create_selective_checkpoint_contexts(op_policy())


def apply_ac(model: CausalLM, mesh: DeviceMesh, cfg: Config) -> CausalLM:
    """Wrap the chosen blocks of `model` (or a pipeline chunk) in place; parameter names do not change."""
    blocks = model.block_modules
    if cfg.activation_checkpointing == "op":
        chosen, extra = [int(k) for k in blocks], {"context_fn": _op_contexts}
    else:
        chosen, extra = checkpointed_blocks([int(k) for k in blocks], cfg.activation_checkpointing), {}
    for index in chosen:
        key = str(index)
        # The models trained here draw no randomness in forward (no dropout; Config refuses attention dropout), so
        # saving and restoring RNG state is wasted work.
        blocks[key] = checkpoint_wrapper(blocks[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                         preserve_rng_state=False, **extra)
    return model
