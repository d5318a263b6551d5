"""A rank's random generators as tensors: torch's (CPU and its CUDA device), Python's and NumPy's. What a checkpoint
(`rng.<rank>.<generator>` keys) and a notebook-held snapshot carry, so a resumed run draws what it would have."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's (CPU and this rank's CUDA device), Python's and NumPy's global generators, as tensors."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "numpy": torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64),
        "gauss": torch.tensor([float("nan") if gauss is None else gauss, cached], dtype=torch.float64),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    python, numpy, (gauss, cached) = state["python"].tolist(), state["numpy"].tolist(), state["gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), None if gauss != gauss else gauss))
    np.random.set_state(("MT19937", np.array(numpy[:-2], dtype=np.uint32), numpy[-2], numpy[-1], cached))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
