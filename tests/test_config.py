"""Every impossible Config is refused on construction, naming the field, the values and a fix."""

from __future__ import annotations

import dataclasses

import pytest

import workbench as wb
from workbench.config import Config, ConfigError, ModelConfig

TINY = ModelConfig.preset("tiny")  # 4 heads, 2 kv heads, 4 layers, MLP 384


@pytest.mark.parametrize("changes, field, fix", [
    (dict(tp=3), "tp", "choose tp among [1, 2, 4]"),
    (dict(tp=4), "tp", "key/value heads"),  # 4 divides the 4 query heads but not the 2 kv heads
    (dict(pp=3), "pp", "n_layers=4"),
    (dict(pp=2, schedule="interleaved_1f1b", stages_per_rank=4, micro_batches=2), "pp", "pp·stages_per_rank=8"),
    (dict(pp=2, schedule="1f1b", micro_batches=1), "micro_batches", "set micro_batches ≥ 2"),
    (dict(pp=2, schedule="interleaved_1f1b", micro_batches=3), "micro_batches", "multiple of 2"),
    (dict(dp=3, batch_size=16), "batch_size", "multiple of 3"),
    (dict(dp=2, micro_batches=3, batch_size=16), "batch_size", "dp·micro_batches=2·3"),
    (dict(schedule="zigzag"), "schedule", "gpipe"),
    (dict(precision="fp8"), "precision", "bf16"),
    (dict(activation_checkpointing="some"), "activation_checkpointing", "selective"),
    (dict(zero=4), "zero", "(0, 1, 2, 3)"),
    (dict(zero=1), "zero", "dp·cp=1"),
    (dict(dp=2, tp=2, zero=1), "zero", "use zero=2"),
    (dict(dp=0), "dp", "dp > 0"),
    (dict(batch_size=-4), "batch_size", "batch_size > 0"),
    (dict(seq_len=0), "seq_len", "seq_len > 0"),
    (dict(lr=0.0), "lr", "lr > 0"),
    (dict(seq_len=4096), "seq_len", "max_seq_len"),
    (dict(tp=2, seq_len=129), "seq_len", "multiple of 2"),
    (dict(dp=2.0), "dp", "int"),
    (dict(model="tiny"), "model", "ModelConfig.preset"),
])
def test_refusals_name_the_field_and_the_fix(changes, field, fix):
    with pytest.raises(ConfigError) as info:
        Config(**{"model": TINY, **changes})
    message = str(info.value)
    assert message.startswith(f"{field}:"), message
    assert fix in message, message
    assert "Fix:" in message


@pytest.mark.parametrize("changes, field", [
    (dict(dim=130, n_heads=4), "model.n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "model.n_kv_heads"),
    (dict(dim=0), "model.dim"),
    (dict(n_layers=-1), "model.n_layers"),
])
def test_model_shapes_are_checked_too(changes, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        dataclasses.replace(TINY, **changes)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown preset 'huge'.*'tiny'"):
        ModelConfig.preset("huge")


def test_world_size_and_device_checks():
    cfg = Config(dp=2, tp=2)
    with pytest.raises(ConfigError, match=r"dp·tp·pp = 2·2·1 = 4, but the pool has 2 ranks.*new Workbench"):
        cfg.check_world(2)
    cfg.check_world(4)
    with pytest.raises(ConfigError, match="^precision: fp16 is not supported on a GPU"):
        Config(precision="fp16").check_device("a GPU", fp16=False)


def test_configs_are_frozen_values_with_a_layout_name():
    cfg = Config(dp=2, zero=3, precision="bf16", activation_checkpointing="full")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dp = 4
    assert cfg.layout == "dp2·zero3·ac:full·bf16"
    assert cfg.replace(zero=0).layout == "dp2·ac:full·bf16"
    assert Config(pp=2, micro_batches=4).layout == "pp2·1f1b×4"
    assert cfg.world_size == 2 and cfg.micro_batch_size == 8
    assert wb.Config() == Config(model=TINY)


# --- compression and offload ------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, field, fix", [
    (dict(compression="int8"), "compression", "dp ≥ 2"),
    (dict(dp=2, compression="zip"), "compression", "one of"),
    (dict(dp=2, zero=2, compression="int8"), "compression", "zero=0 or 1"),
    (dict(dp=2, zero=3, compression="powersgd"), "compression", "zero=0 or 1"),
    (dict(dp=2, zero=2, compression="1bit"), "compression", "zero=0 or 1"),
    (dict(dp=2, tp=2, compression="fp16"), "compression", "zero=2"),
    (dict(dp=2, compression="powersgd", powersgd_rank=0), "powersgd_rank", "> 0"),
    (dict(tp=2, offload=True), "offload", "tp=1"),
    (dict(offload="yes"), "offload", "True or False"),
])
def test_compression_and_offload_refusals_name_the_field_and_fix(changes, field, fix):
    with pytest.raises(ConfigError) as e:
        Config(**changes)
    assert str(e.value).startswith(f"{field}:") and fix in str(e.value)


@pytest.mark.parametrize("changes", [
    dict(dp=2, compression="fp16"), dict(dp=2, zero=1, compression="1bit"), dict(dp=2, zero=2, compression="bf16"),
    dict(dp=2, zero=3, compression="fp16"), dict(dp=2, compression="powersgd"), dict(offload=True),
    dict(dp=2, zero=1, offload=True), dict(dp=2, zero=3, offload=True, compression="bf16"),
])
def test_supported_compression_and_offload_layouts(changes):
    cfg = Config(**changes)
    assert (cfg.compression == "none") or cfg.compression in cfg.layout
    assert cfg.offload == ("offload" in cfg.layout)


# --- every bad value, refused by name (issue 17's drills) ------------------------------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("changes, field, fix", [
    (dict(lr=NAN), "lr", "finite"), (dict(lr=INF), "lr", "finite"), (dict(lr=-1e-3), "lr", "lr > 0"),
    (dict(seed=2**70), "seed", "64 bits"), (dict(seed=1.5), "seed", "int"),
    (dict(weight_decay="0"), "weight_decay", "float"), (dict(weight_decay=NAN), "weight_decay", "finite"),
    (dict(zero=True), "zero", "int"), (dict(dp=True), "dp", "int"), (dict(micro_batches=2.0), "micro_batches", "int"),
    (dict(offload=1), "offload", "True or False"), (dict(schedule=1), "schedule", "gpipe"),
    (dict(precision=None), "precision", "fp32"),
])
def test_bad_values_are_refused_by_name(changes, field, fix):
    with pytest.raises(ConfigError) as info:
        Config(**changes)
    assert str(info.value).startswith(f"{field}:") and fix in str(info.value), str(info.value)


@pytest.mark.parametrize("changes, field, fix", [
    (dict(dim=128.0), "model.dim", "int"), (dict(n_layers=2.5), "model.n_layers", "int"),
    (dict(n_heads=True), "model.n_heads", "int"), (dict(n_kv_heads=2.0), "model.n_kv_heads", "int"),
    (dict(max_seq_len=2**40), "model.max_seq_len", "max_seq_len ≤ 2,097,152"),  # tiny's head_dim is 32
    (dict(vocab_size=10), "model.vocab_size", "≥ 256"), (dict(norm_eps=-1), "model.norm_eps", "> 0"),
    (dict(norm_eps=NAN), "model.norm_eps", "finite"), (dict(rope_theta=0), "model.rope_theta", "> 0"),
    (dict(rope_theta=INF), "model.rope_theta", "finite"), (dict(shared_expert=1), "model.shared_expert", "True"),
    (dict(n_experts=4, capacity_factor=NAN), "model.capacity_factor", "finite"),
    (dict(n_experts=4, aux_loss_coef=INF), "model.aux_loss_coef", "finite"),
])
def test_bad_model_values_are_refused_by_name(changes, field, fix):
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(TINY, **changes)
    assert str(info.value).startswith(f"{field}:") and fix in str(info.value), str(info.value)


def test_the_bounds_admit_what_real_runs_use():
    Config(seed=2**64 - 1), Config(seed=-1), Config(lr=1, weight_decay=0)  # ints are real numbers
    ModelConfig(dim=4096, n_heads=32, max_seq_len=131072)  # Llama 3.1's context at head_dim 128
    assert ModelConfig.preset("8b").vocab_size == 128256
