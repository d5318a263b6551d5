"""Activation checkpointing: keep a block's input, recompute its insides in backward.

A checkpointed block stores only its input during forward; backward runs its
forward again to rebuild the activations it needs. That trades one extra
forward of the block for its activation memory. "selective" does this for
every other block (about half the saving for half the recomputation), "full"
for every block. The non-reentrant implementation is used: it composes with
DTensor, FSDP2 hooks and inputs that do not require grad.
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import Config, checkpointed_blocks
from workbench.engine.model import Transformer


def apply_ac(model: Transformer, mesh: DeviceMesh, cfg: Config) -> Transformer:
    """Wrap the chosen blocks of `model` (or a pipeline chunk) in place; parameter names do not change."""
    for index in checkpointed_blocks([int(k) for k in model.layers], cfg.activation_checkpointing):
        key = str(index)
        # The model has no randomness (no dropout), so saving and restoring RNG state is wasted work.
        model.layers[key] = checkpoint_wrapper(model.layers[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                               preserve_rng_state=False)
    return model
