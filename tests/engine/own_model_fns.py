"""Rank functions for the foreign-model tests: train a layout, then write the model as a Hugging Face checkpoint."""

from __future__ import annotations

from typing import Any

from workbench.config import Config
from workbench.engine.export_hf import export_hf

from workbench.engine.mesh import build_mesh
from workbench.engine.trainer import Trainer

from tests.engine.rank_fns import _trainer, unchecked
from tests.models.families import data_of


@unchecked
def train(cfg: Config, steps: int) -> dict[str, Any]:
    """rank_fns.train, on `data_of(cfg)`'s batches (a user's module does not say its vocabulary before it is built)."""
    trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", data_of(cfg))
    return {"losses": [trainer.step(i).loss for i in range(steps)]}


@unchecked
def train_and_export(cfg: Config, steps: int, directory: str) -> dict[str, Any]:
    """Train `steps` steps of `cfg`'s layout from its initial values (its weights, if any), then export_hf."""
    trainer = _trainer(cfg)
    losses = [trainer.step(i).loss for i in range(steps)]
    return {"losses": losses, "files": export_hf(trainer, directory, 5 * 2**30)}
