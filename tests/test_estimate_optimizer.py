"""The estimator reads Config.optimizer: each optimizer's state bytes, held to the state the real one keeps."""

from __future__ import annotations

import pytest
import torch

from workbench.config import Config, ModelConfig
from workbench.models.transformer import build_model, loss_fn
from workbench.engine.optimizers import OPTIMIZERS, hyperparameters
from workbench.estimate import estimate

TINY = ModelConfig.preset("tiny")


def _state_bytes(optimizer: str) -> int:
    """Bytes of per-parameter state the engine's optimizer holds after one step (its 0-d step counters aside)."""
    cfg = Config(model=TINY, optimizer=optimizer)
    model = build_model(TINY, seed=0)
    opt = OPTIMIZERS[optimizer](model.parameters(), **hyperparameters(cfg))
    tokens = torch.randint(0, TINY.vocab_size, (2, 17))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    return sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "sgd"])
def test_optimizer_state_is_what_the_optimizer_keeps(optimizer):
    assert estimate(Config(model=TINY, optimizer=optimizer), "cpu").memory.optimizer == _state_bytes(optimizer)


def test_optimizer_state_shards_and_prices_by_optimizer():
    base = Config(model=TINY, dp=4, zero=1, batch_size=16)
    adamw, lion, sgd = (estimate(base.replace(optimizer=o), "cpu").memory.optimizer for o in ("adamw", "lion", "sgd"))
    assert lion == sgd == adamw // 2 == 4 * TINY.num_params // 4
    # On a GPU the step is memory-bound: SGD's (32 B a parameter) beats AdamW's (40 B), Lion's op by op (60 B) not.
    gpu = Config(model=ModelConfig.preset("1b"), dp=8, zero=3, precision="bf16", batch_size=8, seq_len=2048)
    step = {o: estimate(gpu.replace(optimizer=o), "h100").step_time_s for o in ("sgd", "adamw", "lion")}
    assert step["sgd"] < step["adamw"] < step["lion"]
