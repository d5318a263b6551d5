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

from workbench.config import Config, CustomModel, HFModel  # noqa: E402
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


def data_of(cfg: Config):
    """The tests' synthetic batches (tests/engine/rank_fns.py), over the byte vocabulary where the model does not
    say its own before it is built (a user's module)."""
    from tests.engine.rank_fns import SyntheticData
    from workbench.config import ModelConfig

    return SyntheticData(cfg if cfg.model.vocab_size else cfg.replace(model=ModelConfig.preset("tiny")))


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
    """The losses of the family's own model (a user's module: its own), one process, whole batches, under the
    Config's precision (autocast; fp16 with a GradScaler) and optimizer: what every layout matches."""
    return list(_reference(Config(model=cfg.model, seed=cfg.seed, lr=cfg.lr, batch_size=cfg.batch_size,
                                  seq_len=cfg.seq_len, precision=cfg.precision, optimizer=cfg.optimizer), steps))


@functools.cache
def _reference(cfg: Config, steps: int) -> tuple[float, ...]:
    from workbench.engine.optimizers import OPTIMIZERS, hyperparameters
    from workbench.engine.precision import DTYPES
    from workbench.models.transformer import loss_fn

    model, data = (own_module(cfg) if isinstance(cfg.model, CustomModel) else hf_model(cfg)), data_of(cfg)
    opt = OPTIMIZERS[cfg.optimizer](model.parameters(), **hyperparameters(cfg))
    scaler = torch.amp.GradScaler("cpu", enabled=cfg.precision == "fp16")
    dtype = DTYPES[cfg.precision]
    losses = []
    for step in range(steps):
        tokens = data.global_batch(step)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(tokens[:, :-1])
            loss = loss_fn(getattr(out, "logits", out), tokens[:, 1:])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return tuple(losses)


def own_module(cfg: Config) -> torch.nn.Module:
    """A user's module as its own factory builds it (its own class and forward), with the workbench's initial
    values: the reference of a CustomModel."""
    from workbench.models.custom import load_factory

    module = load_factory(cfg.model.factory)(**cfg.model.kwargs)
    built = build(cfg.model, cfg.seed)
    missing, unexpected = module.load_state_dict(whole_model(built.model, built.values), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return module
