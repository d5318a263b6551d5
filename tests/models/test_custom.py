"""A user's own module through the model protocol: its parts found or named, refused naming what is missing."""

from __future__ import annotations

import pytest
import torch

from workbench.config import Config, ConfigError, CustomModel
from workbench.models.build import build, build_whole
from workbench.models.check import check_model, describe

from tests.models.custom_models import PLAN
from tests.models.families import own_module

GPT = "tests.models.custom_models:tiny_gpt"


def test_parts_are_found_and_the_forward_is_the_modules_own():
    cfg = Config(model=CustomModel(GPT, plan=PLAN), seq_len=16)
    model = build(cfg.model, 0).model
    parts = model.lm_parts
    assert (parts.embedding, parts.blocks, parts.norm, parts.head) == ("wte", "h", "ln_f", "lm_head")
    assert model.block_tp_plan == {k.removeprefix("h.*."): v for k, v in PLAN.items()}
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(build_whole(cfg.model, 0)(tokens), own_module(cfg)(tokens))
    check_model(cfg.replace(tp=2))  # heads and widths divide 2
    facts = describe(cfg.model)
    assert (facts.name, facts.params, facts.blocks) == (GPT, sum(p.numel() for p in own_module(cfg).parameters()), 4)
    assert facts.support["tp"] is None and facts.support["cp"] is None and "dense" in facts.support["ep"]


@pytest.mark.parametrize("factory,kwargs,field,message", [
    ("no_blocks", {}, "model", "could not find its blocks .* Fix: name them, parts={'blocks'"),
    ("with_positions", {}, "model", "several modules could be its embedding \\(wte, wpe\\)"),
    ("with_positions", {"parts": {"embedding": "wte"}}, "model", "own forward gives other logits"),
    ("unscaled", {}, "model", "ln_f: Scale holds parameters but has no reset_parameters"),
    ("tiny_gpt", {"heads": 2, "plan": PLAN}, "tp", "h.\\*.attn.q: its 2 heads do not divide tp=4"),
    ("tiny_gpt", {}, "tp", "no tensor-parallel plan"),
    ("tiny_gpt", {"plan": {"h.*.attn.qkv": "colwise"}}, "model", "plan entry 'h.\\*.attn.qkv' names no module"),
    ("tiny_gpt", {"plan": {"h.*.attn.q": "diagonal"}}, "tp", "unknown style 'diagonal'"),
    ("tiny_gpt", {}, "ep", "ep=2 splits experts, but the model is dense|model has none"),
    ("list_moe", {}, "ep", "h.0.mlp.experts: the experts are a list of modules the layer calls one by one"),
    ("nowhere", {}, "model", "cannot import|has no callable"),
])
def test_what_cannot_be_laid_out_is_refused_naming_it(factory, kwargs, field, message):
    tp = 4 if kwargs.get("heads") or kwargs.get("plan") == PLAN else 2
    layout = {"tp": dict(tp=tp), "ep": dict(dp=2, ep=2)}.get(field, {})
    source = CustomModel(f"tests.models.custom_models:{factory}", **kwargs)
    with pytest.raises(ConfigError, match=f"^{field}: .*({message})"):
        check_model(Config(model=source, seq_len=16, **layout))


def test_a_factory_is_a_plain_value():
    source = CustomModel(GPT, plan=PLAN, dim=32, layers=4)
    cfg = Config(model=source, pp=2, micro_batches=2)
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["model"] == {"source": "custom", "factory": GPT, "plan": PLAN, "parts": {},
                                      "kwargs": {"dim": 32, "layers": 4}}
    with pytest.raises(ConfigError, match="model.kwargs: the factory's arguments must be plain JSON values"):
        CustomModel(GPT, dim=torch.zeros(1))
    with pytest.raises(ConfigError, match="model.factory: expected 'package.module:callable'"):
        CustomModel("tests.models.custom_models.tiny_gpt")
