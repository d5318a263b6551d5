"""What one forward of a whole model leaves for backward, measured without the estimator: the held-to figure of the
tests that check the estimated activations (the built-in model's and any other's)."""

from __future__ import annotations

import gc

import torch

from workbench.config import Config


def _live(exclude: set[int]) -> dict[int, int]:
    """Every tensor storage the garbage collector reaches (parameters and `exclude`d storages aside)."""
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in exclude and storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def kept_by_one_forward(cfg: Config) -> int:
    """Bytes one forward of `cfg`'s model (one process, its recompute policy applied) leaves for backward, measured
    two independent ways at once: the saved-tensor hooks (the telemetry's meter: what autograd saves outside
    checkpointed regions, and their inputs) and every live tensor the garbage collector reaches that the forward
    made (which also finds what the selective checkpoint API caches, kept in Python dicts the hooks never see).
    Parameters, buffers, the batch and the loss excluded."""
    from workbench.engine.parallel.recompute import apply_ac
    from workbench.models.build import build_whole
    from workbench.models.transformer import loss_fn
    from workbench.telemetry.activations import ActivationMeter

    model = apply_ac(build_whole(cfg.model, cfg.seed), None, cfg)
    tokens = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), tokens]}
    before = _live(own)
    meter = ActivationMeter(buffers=list(model.buffers()))
    with meter.watching(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    gc.collect()
    kept = sum(n for p, n in _live(own | {loss.untyped_storage().data_ptr()}).items() if p not in before)
    loss.backward()
    assert meter.live == 0  # everything counted was freed by backward: nothing but saved tensors was counted
    return kept
