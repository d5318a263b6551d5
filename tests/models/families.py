"""Tiny configs of the Hugging Face families the workbench is tested with, built offline, and their reference.

The reference of every parity test on a foreign model is the family's own model, as transformers builds it
(`AutoModelForCausalLM.from_config`), its own forward, given the initial values the workbench draws for it
(`whole_model`): one process, the whole batch, a plain AdamW loop. It shares nothing with the engine but the
initial values, the loss and the optimizer's class, so a layout matching it trains the family's own model.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from workbench.config import Config, HFModel  # noqa: E402
from workbench.models.build import build  # noqa: E402
from workbench.models.init import whole_model  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
"""Every family at the same tiny shape: 4 blocks (pp=2 with two stages a rank), 4 query and 2 key/value heads."""


def family(name: str, **overrides: Any) -> HFModel:
    """A tiny config of family `name` (a transformers model_type), as a model source."""
    import transformers

    extra = {
        "llama": {},
        "mistral": {"sliding_window": 8},  # shorter than the tests' sequences: the masks path runs
        "qwen3": {"head_dim": 8},
        "gemma": {"head_dim": 8},
        "qwen3_moe": {"head_dim": 8, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2},
        "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    }[name]
    config_class = transformers.CONFIG_MAPPING[name]
    return HFModel(config_class(**{**SMALL, **extra, **overrides}))


FAMILIES = ("llama", "mistral", "qwen3", "gemma", "qwen3_moe")


def hf_model(cfg: Config) -> torch.nn.Module:
    """The family's own model (transformers' class and forward) with the workbench's initial values."""
    from transformers import AutoModelForCausalLM

    from workbench.models.huggingface import hf_config

    model = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.float32, attn_implementation="sdpa")
    built = build(cfg.model, cfg.seed)
    missing, unexpected = model.load_state_dict(whole_model(built.model, built.values), strict=False)
    tied = {"lm_head.weight"} if cfg.model.tied_embeddings else set()
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    return model


def hf_reference(cfg: Config, steps: int) -> list[float]:
    """The losses of the family's own model, one process, whole batches (fp32, AdamW): what every layout matches."""
    return list(_reference(Config(model=cfg.model, seed=cfg.seed, lr=cfg.lr, batch_size=cfg.batch_size,
                                  seq_len=cfg.seq_len), steps))


@functools.cache
def _reference(cfg: Config, steps: int) -> tuple[float, ...]:
    from tests.engine.rank_fns import SyntheticData
    from workbench.engine.optimizers import OPTIMIZERS, hyperparameters
    from workbench.models.transformer import loss_fn

    model, data = hf_model(cfg), SyntheticData(cfg)
    opt = OPTIMIZERS[cfg.optimizer](model.parameters(), **hyperparameters(cfg))
    losses = []
    for step in range(steps):
        tokens = data.global_batch(step)
        loss = loss_fn(model(tokens[:, :-1]).logits, tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return tuple(losses)
