"""The mixture-of-experts model on its own (one process, no ranks): config refusals, parameter counts,
routing and capacity against a pure-Python recount, the balancing loss against its formula, and a MoE of
identical experts equal to the dense FFN."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from workbench.config import Config, ConfigError, ModelConfig
from workbench.models.transformer import FeedForward, MoEFeedForward, build_model, moe_aux_loss, moe_routing

MOE = ModelConfig.preset("tiny-moe")


@pytest.mark.parametrize("changes, field", [
    (dict(n_experts=-1), "model.n_experts"), (dict(n_experts=1), "model.n_experts"),
    (dict(n_experts=4, top_k=5), "model.top_k"), (dict(n_experts=4, top_k=0), "model.top_k"),
    (dict(n_experts=4, capacity_factor=0), "model.capacity_factor"),
    (dict(n_experts=4, aux_loss_coef=-0.1), "model.aux_loss_coef"),
    (dict(n_experts=4, moe_every=5), "model.moe_every"),
])
def test_model_refusals_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"^{field}:.*Fix:"):
        ModelConfig(n_layers=4, **changes)


@pytest.mark.parametrize("kwargs, field", [
    (dict(dp=2, ep=2), "ep"),                                   # dense model
    (dict(model=MOE, dp=4, ep=3, batch_size=12), "ep"),           # n_experts % ep
    (dict(model=dataclasses.replace(MOE, n_experts=6), dp=3, ep=2, batch_size=12), "ep"),  # dp % ep
    (dict(model=MOE, dp=2, ep=2, zero=1), "zero"),
])
def test_config_refusals_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}:.*Fix:"):
        Config(**kwargs)


def test_expert_parallel_layout_name_and_world():
    cfg = Config(model=MOE, dp=4, ep=2, zero=3)
    assert cfg.world_size == 4 and cfg.layout == "dp4·ep2·zero3"


@pytest.mark.parametrize("changes", [{}, dict(shared_expert=True), dict(moe_every=2), dict(n_experts=8, top_k=1)])
def test_parameter_count_matches_the_module(changes):
    m = dataclasses.replace(MOE, **changes)
    model = build_model(m, 0)
    assert sum(p.numel() for p in model.parameters()) == m.num_params
    ffn = 3 * m.dim * m.hidden_dim
    per_token = sum(p.numel() for n, p in model.named_parameters() if "experts." not in n) + \
        m.n_moe_layers * m.top_k * ffn
    assert m.active_params == per_token


def _recount(probs: torch.Tensor, k: int, capacity: int) -> tuple[list[int], int]:
    """Routing by hand, one assignment at a time: per sequence, all first choices in token order, then seconds."""
    n = probs.shape[-1]
    load, dropped = [0] * n, 0
    for seq in probs.tolist():
        ranked = [sorted(range(n), key=lambda e: (-p[e], e))[:k] for p in seq]
        taken = [0] * n
        for slot in range(k):
            for choices in ranked:
                e = choices[slot]
                load[e] += 1
                if taken[e] < capacity:
                    taken[e] += 1
                else:
                    dropped += 1
    return load, dropped


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0])
def test_drops_and_load_match_a_recount(capacity_factor):
    cfg = dataclasses.replace(MOE, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg)
    torch.nn.init.normal_(moe.router.weight, std=0.5)  # a decisive router: unequal loads, real drops
    for w in moe.experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    x = torch.randn(3, 40, cfg.dim)
    moe(x)
    probs = torch.nn.functional.linear(x, moe.router.weight).softmax(-1)
    capacity = math.ceil(capacity_factor * 40 * cfg.top_k / cfg.n_experts)
    load, dropped = _recount(probs, cfg.top_k, capacity)
    assert moe.last_load.tolist() == load
    assert int(moe.last_dropped) == dropped
    assert (dropped > 0) == (capacity_factor < 2.0)
    # The balancing loss, from its definition: per sequence E·Σ f_e·P_e, then the mean, times the weight.
    counts = torch.zeros(3, cfg.n_experts)
    for b in range(3):
        for e in probs[b].topk(cfg.top_k, dim=-1).indices.flatten().tolist():
            counts[b, e] += 1
    expected = cfg.aux_loss_coef * cfg.n_experts * ((counts / (40 * cfg.top_k)) * probs.mean(1)).sum(-1).mean()
    torch.testing.assert_close(moe.last_aux_loss, expected)


def test_identical_experts_make_the_dense_ffn():
    # Every expert a copy of one dense FFN, nothing dropped: the renormalised top-k weights sum to 1.
    cfg = dataclasses.replace(MOE, capacity_factor=MOE.n_experts / MOE.top_k)
    torch.manual_seed(0)
    dense, moe = FeedForward(cfg), MoEFeedForward(cfg)
    torch.nn.init.normal_(moe.router.weight, std=0.1)
    with torch.no_grad():
        moe.experts.w1.copy_(dense.w1.weight.T.expand_as(moe.experts.w1))
        moe.experts.w3.copy_(dense.w3.weight.T.expand_as(moe.experts.w3))
        moe.experts.w2.copy_(dense.w2.weight.T.expand_as(moe.experts.w2))
    x = torch.randn(2, 16, cfg.dim)
    torch.testing.assert_close(moe(x), dense(x), rtol=1e-5, atol=1e-6)
    assert int(moe.last_dropped) == 0


def test_the_model_reports_aux_loss_and_routing_of_every_moe_layer():
    m = dataclasses.replace(MOE, moe_every=2)
    model = build_model(m, 0)
    assert moe_aux_loss(model) is None and moe_routing(model) is None
    model(torch.randint(0, 256, (2, 32)))
    load, dropped = moe_routing(model)
    assert load.shape == (2, m.n_experts) and dropped.shape == (2,)
    assert load.sum(-1).tolist() == [2 * 32 * m.top_k] * 2
    assert moe_aux_loss(model).item() == pytest.approx(sum(l.last_aux_loss.item()
                                                           for l in model.modules() if isinstance(l, MoEFeedForward)))


def test_routing_settings_keep_the_weights_so_a_layout_change_carries_them():
    assert MOE.same_weights(dataclasses.replace(MOE, capacity_factor=0.5, top_k=1, aux_loss_coef=0.0))
    assert not MOE.same_weights(dataclasses.replace(MOE, n_experts=8))
    assert not MOE.same_weights(dataclasses.replace(MOE, shared_expert=True))


def test_moe_flops_per_token_agree_with_the_flop_counter():
    # Nothing dropped (capacity for a whole sequence): each token goes through top_k experts and the router.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from workbench.models.transformer import loss_fn
    from workbench.estimate import flops_per_token

    cfg = dataclasses.replace(MOE, capacity_factor=2.0, shared_expert=True)
    model = build_model(cfg, 0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert counter.get_total_flops() / (2 * 64) == flops_per_token(cfg, 64)


def test_the_balancing_loss_trains_through_the_layers_output_weighted_as_the_loss():
    # Megatron's MoEAuxLossAutoScaler: loss.backward() alone gives the gradient of loss + aux (the router's balancing
    # term included), and with the aux gradient scaled by s that of s·(loss + aux), as a scaled loss's backward gives.
    from workbench.models.transformer import loss_fn, set_moe_aux_grad_scale

    m = dataclasses.replace(MOE, moe_every=2)
    tokens = torch.randint(0, m.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))

    def grads(scale: float, add_aux: bool) -> dict[str, torch.Tensor]:
        model = build_model(m, 0)
        set_moe_aux_grad_scale(model, scale if not add_aux else 0.0)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        (scale * (loss + moe_aux_loss(model)) if add_aux else scale * loss).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    expected = grads(1.0, add_aux=True)
    routers = [n for n in expected if n.endswith("router.weight")]
    assert routers and all(expected[n].abs().sum() > 0 for n in routers)
    for scale in (1.0, 256.0):
        got = grads(scale, add_aux=False)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad * scale, rtol=1e-5, atol=1e-9)
    # Without the balancing loss's gradient, the routers' gradients differ: the test can fail.
    model = build_model(m, 0)
    set_moe_aux_grad_scale(model, 0.0)
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert not torch.allclose(model.get_parameter(routers[0]).grad, expected[routers[0]])
