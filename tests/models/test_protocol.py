"""The model protocol on the built-in transformer: its parts, one block's call, chunks, positions, support."""

from __future__ import annotations

import pytest
import torch

from workbench.config import PRESETS, ModelConfig
from workbench.models.protocol import CausalLM, Parts, Unsupported, chunk
from workbench.models.transformer import Transformer, build_model, rotary_table


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return build_model(ModelConfig.preset("tiny"), seed=0)


def test_forward_is_the_parts_in_order(tiny):
    tokens = torch.randint(0, 256, (2, 16))
    hidden = tiny.embedding_module(tokens)
    inputs = tiny.block_inputs(hidden)
    for block in tiny.block_modules.values():
        hidden = tiny.call_block(block, hidden, inputs)
    by_hand = tiny.output_head(tiny.final_norm(hidden))
    assert torch.equal(tiny(tokens), by_hand)
    assert [path for path, _ in tiny.block_paths()] == [f"layers.{i}" for i in range(4)]


def test_chunks_compose_to_the_model_and_keep_its_names(tiny):
    tokens = torch.randint(0, 256, (2, 16))
    first = chunk(tiny, range(0, 1), first=True, last=False)
    middle = chunk(tiny, range(1, 3), first=False, last=False)
    last = chunk(tiny, range(3, 4), first=False, last=True)
    assert torch.equal(last(middle(first(tokens))), tiny(tokens))
    names = [set(c.state_dict()) for c in (first, middle, last)]
    assert set().union(*names) == set(tiny.state_dict()) and sum(map(len, names)) == len(tiny.state_dict())
    assert first.final_norm is None and first.output_head is None and middle.embedding_module is None
    assert list(middle.block_modules) == ["1", "2"]


def test_a_chunk_of_a_meta_model_allocates_nothing():
    with torch.device("meta"):
        model = Transformer(ModelConfig.preset("tiny"))
    piece = chunk(model, range(2, 4), first=False, last=True)
    assert all(p.is_meta for p in piece.parameters())


def test_positions_pick_the_rotary_rows(tiny):
    model = build_model(ModelConfig.preset("tiny"), seed=0)
    whole = model.rope
    model.set_positions(torch.arange(64))
    assert model.rope is whole  # a table from position 0 already serves 0..63
    positions = torch.tensor([0, 1, 6, 7])
    model.set_positions(positions)
    assert torch.equal(model.rope, rotary_table(32, 1024, 10000.0)[positions])
    assert torch.equal(model.token_positions(4, torch.device("cpu")), positions)


def test_plan_experts_and_support():
    dense = build_model(ModelConfig.preset("tiny"), seed=0)
    assert dense.block_tp_plan["attention.wo"] == "rowwise"
    assert dense.routed_experts() == []
    assert dense.layout_support() == {**dict.fromkeys(dense.layout_support()), "ep": "a dense model: no experts to split"}
    moe = build_model(ModelConfig.preset("tiny-moe"), seed=0)
    experts = moe.routed_experts()
    assert [(e.path, e.layer, e.n_experts, e.call) for e in experts][0] == ("layers.0.feed_forward.experts", 0, 4,
                                                                            "sorted")
    assert len(experts) == 4
    support = moe.layout_support()
    assert support["ep"] is None and "whole sequences" in support["cp"]


def test_attention_kernel_replaces_every_attention(tiny):
    model = build_model(ModelConfig.preset("tiny"), seed=0)
    tokens = torch.randint(0, 256, (1, 8))
    reference = model(tokens)
    calls = []

    def kernel(q, k, v, scale):
        calls.append(scale)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=True)

    model.use_attention(kernel)
    assert torch.allclose(model(tokens), reference, atol=1e-6)
    assert calls == pytest.approx([32 ** -0.5] * 4)


class _Bare(CausalLM):
    lm_parts = Parts(embedding="emb", blocks="blocks", norm=None, head="out")

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.blocks = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4)})
        self.out = torch.nn.Linear(4, 8)


def test_defaults_refuse_what_a_model_does_not_say():
    model = _Bare()
    assert model(torch.tensor([[1, 2]])).shape == (1, 2, 8)
    with pytest.raises(Unsupported, match="attention cannot be reached"):
        model.use_attention(lambda q, k, v, s: q)
    support = model.layout_support()
    assert "no tensor-parallel plan" in support["tp"] and "one block" in support["pp"]
    assert support["dp"] is None and support["zero"] is None


@pytest.mark.parametrize("name", [*PRESETS, "one block", "moe every other block"])
def test_the_built_in_models_facts_from_its_shape_are_its_built_models(name):
    """The dashboard describes the built-in model from its shape (no torch in the notebook): the same name, count,
    blocks and support as the model built on the meta device says, counted from its own parameters."""
    from workbench.config.support import builtin_facts
    from workbench.models.check import describe

    model = {"one block": ModelConfig(dim=64, n_layers=1, n_heads=4),
             "moe every other block": ModelConfig(dim=64, n_layers=4, n_heads=4, n_experts=4, moe_every=2)}.get(
        name) or PRESETS[name]
    built = describe(model)
    assert builtin_facts(model) == built
    with torch.device("meta"):
        assert built.params == sum(p.numel() for p in Transformer(model).parameters())
