"""The estimator for any model, by tracing (issue 32, item 6): one forward and backward on fake tensors gives
each block's parameters, FLOPs and saved activations; the estimator applies the layout's arithmetic to them.

Held to independent measures: the built-in model's own formulas (every category of the estimate within 1%), and
for Hugging Face families built offline from tiny configs, their numel, FlopCounterMode on a real CPU run and the
ranks' ActivationMeter on the same run.
"""

from __future__ import annotations

import dataclasses

import functools

import pytest
import torch

import workbench as wb
from workbench.estimate import estimate
from workbench.model_profile import ModelProfile
from workbench.telemetry.activations import ActivationMeter
from workbench.tracing.estimate import traced_profile
from workbench.tracing.kernels import FLOP_FORMULAS
from workbench.tracing.trace import trace

LAYOUTS = [dict(), dict(dp=2), dict(dp=2, zero=1), dict(dp=4, zero=3), dict(tp=2), dict(tp=2, dp=2, zero=2),
           dict(pp=2, micro_batches=4), dict(pp=2, schedule="interleaved_1f1b", stages_per_rank=3, micro_batches=4),
           dict(cp=2), dict(activation_checkpointing="full"), dict(activation_checkpointing="selective", pp=2,
                                                                    micro_batches=2),
           dict(activation_checkpointing="op"), dict(precision="bf16"), dict(precision="bf16", tp=2),
           dict(precision="bf16", dp=2, zero=3, mixed_precision="fsdp"), dict(precision="fp16", pp=2, micro_batches=2),
           dict(offload=True, dp=2, zero=1)]


def _figures(est) -> dict[str, float]:
    """Every category an estimate reports, by name: memory per category (and the GPU allocator's), FLOPs, time,
    and each collective's wire bytes and time."""
    out = {f"memory.{k}": getattr(est.memory, k) for k in ("parameters", "gradients", "optimizer", "buffers",
                                                             "activations", "other", "host", "allocated", "reserved")}
    out.update({"flops": max(s.flops for s in est.stages), "model_flops": est.model_flops,
                "compute_s": est.compute_s, "step_time_s": est.step_time_s})
    for c in est.comm:
        out[f"{c.axis}.{c.kind}.{c.role}.wire"] = c.wire_bytes
        out[f"{c.axis}.{c.kind}.{c.role}.time"] = c.time_s
    return out


@pytest.mark.parametrize("hardware", ["cpu", "h100"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()) or "single")
def test_the_traced_estimate_of_the_built_in_model_agrees_with_its_formulas(layout, hardware):
    cfg = wb.Config(model=wb.ModelConfig.preset("small"), batch_size=16, seq_len=256, **layout)
    formulas, traced = wb.estimate(cfg, hardware, trace=False), wb.estimate(cfg, hardware, trace=True)
    a, b = _figures(formulas), _figures(traced)
    assert a.keys() == b.keys()
    off = {k: (a[k], b[k]) for k in a if abs(a[k] - b[k]) > 0.01 * abs(a[k])}
    assert not off, f"{cfg.layout} on {hardware}: traced differs from the formulas by over 1% in {off}"


def test_a_traced_profile_counts_the_built_in_model_exactly():
    m = wb.ModelConfig.preset("tiny")
    p = traced_profile(m, 128, "fp32")
    assert p.params == m.num_params and len(p.kinds) == 1 and p.blocks == (0,) * m.n_layers
    assert (p.dim, p.vocab_size, p.embedding_params, p.head_params, p.norm_params) == (128, 256, 32768, 32768, 128)
    block = p.kinds[0]
    assert block.split_params == 2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 384, "wq, wo; wk, wv; w1, w3, w2"
    assert block.params - block.split_params == 2 * 128, "the two norms are all tensor parallel keeps whole"
    assert [(g.n, g.k, g.split) for g in block.gemms] == [  # wq, wk, wv, wo, w1, w3, w2 as they ran
        (128, 128, "column"), (64, 128, "column"), (64, 128, "column"), (128, 128, "row"),
        (384, 128, "column"), (384, 128, "column"), (128, 384, "row")]
    assert traced_profile(m, 128, "fp32") is p, "traced once per model, sequence length and precision"


def test_a_trace_allocates_nothing():
    """The 1B preset holds 1.5 B parameters (6 GB in fp32): traced, this process grows by far less."""
    psutil = pytest.importorskip("psutil")
    model = wb.ModelConfig.preset("1b")
    before = psutil.Process().memory_info().rss
    p = trace(lambda: __import__("workbench.models.transformer", fromlist=["Transformer"]).Transformer(model), seq_len=512)
    grew = psutil.Process().memory_info().rss - before
    assert p.params == model.num_params and grew < 1e9, f"grew {grew / 1e9:.2f} GB"


def test_a_profile_for_another_sequence_length_is_refused():
    cfg = wb.Config(seq_len=64)
    with pytest.raises(ValueError, match="traced at seq_len=128.*seq_len=64"):
        estimate(cfg, "cpu", traced=traced_profile(cfg.model, 128, "fp32"))


# -- Hugging Face families, built offline from tiny configs ------------------------------------------------------
def _families() -> dict:
    from transformers import (Gemma2Config, GemmaConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config,
                              Qwen3Config, Qwen3MoeConfig)

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)
    return {
        "llama": LlamaConfig(**shape),
        "mistral": MistralConfig(**shape, sliding_window=None),
        "qwen3": Qwen3Config(**shape, head_dim=16),
        "gemma": GemmaConfig(**shape, head_dim=16),
        "gemma2": Gemma2Config(**shape, head_dim=16, sliding_window=16),
        "phi3": Phi3Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "qwen3_moe": Qwen3MoeConfig(**shape, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[]),
        "mixtral": MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2),
    }


FAMILIES = ["llama", "mistral", "qwen3", "gemma", "gemma2", "phi3", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("precision", ["fp32", "bf16_params"])
def test_a_hugging_face_llama_keeps_what_the_built_in_llama_of_its_shape_keeps(precision):
    # transformers builds in fp32 whatever the default dtype; under FSDP2's mixed precision its parameters are
    # cast to bf16 for compute, so the trace casts them too: what the per-op policy keeps (matmul outputs,
    # attention's output) is then the built-in model's, byte for byte, not twice it.
    from transformers import LlamaConfig

    m = wb.ModelConfig.preset("tiny")
    config = LlamaConfig(hidden_size=m.dim, intermediate_size=m.hidden_dim, num_hidden_layers=m.n_layers,
                         num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab_size,
                         tie_word_embeddings=False, max_position_embeddings=256)
    ours, theirs = (traced_profile(model, 128, precision).block(0) for model in (m, wb.HFModel(config)))
    assert theirs.op_kept_bytes == ours.op_kept_bytes
    assert theirs.params == ours.params


def _measured(config, seq_len: int) -> tuple[int, float, int]:
    """A real CPU run of one sequence: its numel, FlopCounterMode's FLOPs and the ActivationMeter's peak."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    inputs, targets = torch.randint(0, config.vocab_size, (2, 1, seq_len))
    meter = ActivationMeter(model.buffers())
    with torch.utils.flop_counter.FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        with meter.watching():
            logits = model(inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
    return sum(p.numel() for p in model.parameters()), counter.get_total_flops(), meter.peak


def _saved(p: ModelProfile) -> int:
    return sum(p.block(i).saved_bytes for i in range(p.n_layers)) + p.first_saved + p.shared_saved + p.last_saved


def _flops(p: ModelProfile) -> float:
    blocks = sum(p.block(i).forward_flops + p.block(i).backward_flops for i in range(p.n_layers))
    return blocks + p.head_forward_flops + p.head_backward_flops


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hugging_face_family_traces_to_its_numel_flops_and_measured_activations(family):
    from transformers import AutoModelForCausalLM

    config = _families()[family]
    p = trace(lambda: AutoModelForCausalLM.from_config(config), seq_len=64, name=family)
    numel, flops, activations = _measured(config, 64)
    assert p.params == numel, "the traced parameter count is the model's numel, exactly"
    assert _flops(p) == flops
    assert _saved(p) == pytest.approx(activations, rel=0.02)
    assert p.n_layers == 3 and p.dim == 64 and p.vocab_size == 320
    assert p.kinds[p.blocks[-1]].gathered_bytes > 0, "its tensor-parallel plan names the column-parallel inputs"
    if family == "qwen3_moe":  # every other block is a mixture of experts: two kinds
        assert len(p.kinds) == 2 and p.block(1).expert_params == 3 * 4 * 64 * 32 and p.block(0).expert_params == 0
        assert 0 < p.block(1).replicated_flops < p.block(1).forward_flops + p.block(1).backward_flops


def test_a_model_built_on_the_meta_device_traces_as_one_built_on_fake_tensors():
    """The ranks build a model on the meta device before laying it out; traced from there, it is the same. A tied
    head holds no parameters of its own."""
    import dataclasses

    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=320, tie_word_embeddings=True)

    def on_meta():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    fake = trace(lambda: AutoModelForCausalLM.from_config(config), seq_len=64)
    meta = trace(on_meta, seq_len=64)
    assert dataclasses.replace(meta, trace_s=0) == dataclasses.replace(fake, trace_s=0)
    assert meta.head_params == 0 and meta.params == meta.embedding_params + sum(
        meta.block(i).params for i in range(3)) + meta.norm_params


def test_a_dense_hugging_face_model_is_estimated_and_planned_on_a_gpu_by_its_own_count():
    """`wb.estimate` and `wb.plan` of an HFModel on the GPU kernel model: the layers it routes are its config's, and
    the parameter count printed is the trace's, which is transformers' numel (not the built-in model's formula)."""
    from transformers import AutoModelForCausalLM

    config = _families()["qwen3"]
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    source = wb.HFModel(config)
    est = wb.estimate(wb.Config(model=source, dp=4, tp=2, zero=3, seq_len=256, batch_size=8, precision="bf16"), "h100")
    assert est.model_params == numel and f"model     {round(numel / 1e3)} k parameters," in str(est)
    planned = wb.plan(source, "h100", gpus=8, global_batch=16, seq_len=256, max_micro_batches=2)
    assert planned.best.estimate.fits and f"plan  {numel / 1e9:.2f} B-parameter model" in planned.table()
    assert [source.is_moe_layer(i) for i in range(3)] == [False] * 3
    moe = wb.HFModel(_families()["qwen3_moe"])  # decoder_sparse_step=2: every second block routes
    assert [moe.is_moe_layer(i) for i in range(3)] == [False, True, False]
    assert wb.HFModel(_families()["mixtral"]).is_moe_layer(0)


def test_a_module_of_ones_own_is_estimated_and_planned_from_its_trace_and_its_failures_refuse_what_they_touch():
    """Its depth, width and heads are known only once built: the trace's. Layouts the built module cannot take (a pp
    its 4 blocks do not divide, bf16 parameters its rotary's fp32 tables cannot meet in attention) are refused each
    with the reason, the others planned; asked for directly, such a precision is refused naming the model."""
    from tests.models.custom_models import tiny_gpt

    source = wb.CustomModel("tests.models.custom_models:tiny_gpt")
    numel = sum(p.numel() for p in tiny_gpt().parameters())
    est = wb.estimate(wb.Config(model=source, dp=2, seq_len=32), "cpu")
    assert est.model_params == numel and est.fits and est.step_time_s > 0
    planned = wb.plan(source, "h100", gpus=8, global_batch=16, seq_len=256, max_micro_batches=2)
    assert planned.best.estimate.model_params == numel
    reasons = {c.refused for c in planned.refused}
    assert "invalid: 8 pipeline stages do not divide 4 layers; choose a divisor of n_layers" in reasons
    assert any(c.config is None and c.choice.get("mixed_precision") == "fsdp" for c in planned.refused)
    assert all(c.config.mixed_precision != "fsdp" and c.config.pp in (1, 2, 4) for c in planned.ranked)
    with pytest.raises(wb.ConfigError, match=r"^model: tests.models.custom_models:tiny_gpt failed one forward and "
                                             r"backward with bf16 parameters on fake tensors"):
        wb.estimate(wb.Config(model=source, dp=2, zero=3, seq_len=32, precision="bf16", mixed_precision="fsdp"),
                    "h100")


@pytest.mark.slow
def test_a_qwen3_8b_plan_on_64_h100s_is_made_on_fake_tensors():
    """Qwen3-8B's published shape, never allocated: the plan ranks layouts by its traced figures; its parameter
    count is the model's own (q/k norms included), not the Llama-style formula's."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         tie_word_embeddings=False)
    shape = wb.ModelConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, vocab_size=151936,
                           max_seq_len=4096, rope_theta=1e6)
    profiles = functools.cache(lambda precision: trace(lambda: AutoModelForCausalLM.from_config(config),
                                                       seq_len=4096, precision=precision, name="qwen3-8b"))
    p = profiles("low")
    assert p.params == 8_190_735_360 == shape.num_params + 36 * 2 * 128
    # Up to 8 micro-batches a step (as notebook 07): the default 32 makes the search larger, not the property.
    planned = wb.plan(shape, "h100", gpus=64, global_batch=256, seq_len=4096, traced=profiles, max_micro_batches=8)
    best = planned.ranked[0]
    assert best.estimate.fits and best.config.world_size == 64 and len(planned.ranked) > 10
    # Its stages hold the traced model: what tensor parallel splits once, what it keeps whole on each tp rank.
    tp = best.config.tp
    whole = sum(p.block(i).params - p.block(i).split_params for i in range(36)) + p.norm_params
    assert sum(s.params for s in best.estimate.stages) * tp - (tp - 1) * whole == p.params


def test_a_foreign_models_estimate_and_plan_print_its_traced_parameter_count():
    """Its source does not know its parameter count (a user's module says nothing before it is built): what is
    printed is the trace's, the model's numel."""
    from transformers import AutoModelForCausalLM

    from tests.models.families import family
    from workbench.hardware import si
    from workbench.models.huggingface import hf_config

    source = family("qwen3")
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config(source)).parameters())
    est = wb.estimate(wb.Config(model=source, batch_size=4, seq_len=32, dp=2), "h100")
    assert est.model_params == numel
    assert f"model     {si(numel, '').rstrip()} parameters" in str(est)
    planned = wb.plan(source, "h100", gpus=8, global_batch=16, seq_len=32, precision="fp32")
    assert {c.estimate.model_params for c in planned.ranked} == {numel}
    assert planned.table().startswith(f"plan  {numel / 1e9:.2f} B-parameter model on 8 ×")
    # Where no layout fits (every one refused on its memory, its time never priced), the count is still the trace's.
    tiny = dataclasses.replace(wb.hardware.profile("h100"), memory_bytes=1)
    nothing = wb.plan(source, tiny, gpus=8, global_batch=16, seq_len=32, precision="fp32")
    assert not nothing.ranked and nothing.table().startswith(f"plan  {numel / 1e9:.2f} B-parameter model on 8 ×")
