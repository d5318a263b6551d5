"""Hugging Face families through the model protocol, in one process: the adapter computes the family's own model.

No download anywhere: every config is built in the test from its class (tests/models/families.py).
"""

from __future__ import annotations

import pytest
import torch

from workbench.config import Config, ConfigError, HFModel, ModelConfig
from workbench.models.build import build, build_whole, parameter_count
from workbench.models.init import whole_model
from workbench.models.protocol import Unsupported, chunk
from workbench.models.tp import tp_problems
from workbench.models.transformer import build_model

from tests.models.families import family, hf_model

ALL = ("llama", "mistral", "qwen3", "gemma", "qwen3_moe", "mixtral")


@pytest.mark.parametrize("name", ALL)
def test_the_adapted_forward_is_the_familys_own(name):
    cfg = Config(model=family(name), seq_len=16)
    ours, theirs = build_whole(cfg.model, cfg.seed), hf_model(cfg)
    tokens = torch.randint(0, 256, (2, 16))  # 16 > mistral's window of 8: its masks are built and used
    assert torch.equal(ours(tokens), theirs(tokens).logits)
    # Pipeline chunks compose to the same forward, and keep transformers' parameter names.
    first, last = chunk(ours, range(0, 2), first=True, last=False), chunk(ours, range(2, 4), first=False, last=True)
    assert torch.equal(last(first(tokens)), theirs(tokens).logits)
    assert set(first.state_dict()) | set(last.state_dict()) == set(theirs.state_dict())


@pytest.mark.parametrize("name", ALL)
def test_parts_plan_and_support_come_from_the_family(name):
    model = build(family(name), seed=0).model
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    parts = model.lm_parts
    assert (parts.embedding, parts.blocks, parts.norm, parts.head) == ("model.embed_tokens", "model.layers",
                                                                        "model.norm", "lm_head")
    assert list(model.block_modules) == ["0", "1", "2", "3"]
    assert model.block_tp_plan["self_attn.q_proj"] == "colwise"
    experts = model.routed_experts()
    moe = name in ("qwen3_moe", "mixtral")
    assert [e.call for e in experts] == (["routed"] * 4 if moe else [])
    support = model.layout_support()
    assert support["tp"] is None and support["pp"] is None and support["cp"] is None
    assert (support["ep"] is None) == moe
    assert parameter_count(model) == sum(p.numel() for p in hf_model(Config(model=family(name), seq_len=16)).parameters())


def test_initial_values_are_the_same_whatever_piece_is_asked():
    built = build(family("qwen3"), seed=5)
    whole = whole_model(built.model, built.values)
    name = "model.layers.2.self_attn.q_proj.weight"
    region = (((8, 16),), ((0, 32),))  # rows 8..15, the second quarter of the heads' outputs
    pieces = dict(built.values.pieces({name: region}))
    assert list(pieces) == [name] and torch.equal(pieces[name], whole[name][8:16])
    assert not torch.equal(whole_model(build(family("qwen3"), seed=6).model, build(family("qwen3"), 6).values)[name],
                           whole[name])


def test_the_builtin_model_on_the_meta_device_replays_build_model_exactly():
    for preset in ("tiny", "tiny-moe"):
        cfg = ModelConfig.preset(preset)
        built, reference = build_whole(cfg, seed=3), build_model(cfg, 3)
        assert list(built.state_dict()) == list(reference.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), reference.state_dict().values()))


def test_tensor_parallel_problems_name_the_module():
    model = build(family("llama"), seed=0).model
    assert tp_problems(model, 2) == []
    problems = tp_problems(model, 4)
    assert "model.layers.*.self_attn.k_proj: its 2 heads do not divide tp=4" in problems
    assert not any("q_proj" in p for p in problems)  # 4 query heads split over 4


def test_what_the_adapter_cannot_lay_out_is_refused_before_any_rank():
    tied = family("gemma", tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="tp: tp=2: the model's head shares the embedding's weight"):
        Config(model=tied, tp=2)
    with pytest.raises(ConfigError, match="pp=2"):
        Config(model=tied, pp=2, micro_batches=2)
    support = build(tied, 0).model.layout_support()
    assert "shares the embedding" in support["tp"] and "shares the embedding" in support["pp"]
    with pytest.raises(ConfigError, match="cp: cp=2: the ring exchange .* sliding window of 8 < seq_len=16"):
        Config(model=family("mistral"), cp=2, seq_len=16)
    with pytest.raises(ConfigError, match="model.config.final_logit_softcapping"):
        HFModel({"model_type": "gemma2", "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 256,
                 "final_logit_softcapping": 30.0})
    with pytest.raises(Unsupported, match="BertLMHeadModel: could not find its blocks"):
        build(HFModel({"model_type": "bert", "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 256}), 0)


def test_a_hugging_face_source_is_a_plain_value(tmp_path):
    source = family("qwen3_moe")
    cfg = Config(model=source, dp=2, ep=2, zero=2, seq_len=16)
    data = cfg.to_dict()
    assert data["model"]["source"] == "huggingface" and data["model"]["config"]["num_local_experts"] == 4
    assert Config.from_dict(data) == cfg and hash(cfg) == hash(Config.from_dict(data))
    (tmp_path / "config.json").write_text(__import__("json").dumps(source.config))
    assert HFModel(tmp_path) == source  # a folder holding config.json is the same source
    assert (source.n_layers, source.n_heads, source.kv_heads, source.head_dim, source.n_experts) == (4, 4, 2, 8, 4)
    assert repr(source) == "HFModel(qwen3_moe: 4 layers, hidden 32)"
    with pytest.raises(ConfigError, match="model.kwargs|model.colour: unknown field"):
        Config.from_dict({**data, "model": {**data["model"], "colour": "red"}})
