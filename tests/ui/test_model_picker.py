"""The model picker without a browser: a Hugging Face config folder or a factory of one's own becomes the Config's model
source and is applied as it; the name and parameter count shown are the model's own (counted on the model its own
class builds, not by the workbench); what the model sources or the model refuse is said inline and reaches no rank."""

from __future__ import annotations

import json
import re

import pytest

import workbench as wb
from tests.models.custom_models import PLAN, tiny_gpt
from tests.ui.fakes import fake_workbench
from workbench.ui.controls import Controls
from workbench.ui.model_picker import FACTORY, HF_FOLDER

GPT = "tests.models.custom_models:tiny_gpt"
QWEN3 = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture
def bench():
    return fake_workbench(world_size=2, step_s=0.02)


@pytest.fixture
def qwen3_folder(tmp_path):
    """A folder as a transformers user has one: config.json and the model's safetensors, written by transformers."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3))
    model.save_pretrained(tmp_path / "qwen3")
    return tmp_path / "qwen3", model


def _shown(c: Controls) -> tuple[str, int]:
    """The name and the parameter count the picker shows, read from its text."""
    found = re.search(r"<b>(.*?)</b> · ([\d,]+) parameters", c.picker.facts.value)
    assert found, c.picker.facts.value
    return found.group(1), int(found.group(2).replace(",", ""))


def _applied(c: Controls, bench) -> wb.Config:
    c.apply()
    c.wait(10)
    assert "applied" in c.status.value, c.status.value
    return bench.session.applied[-1]


def test_a_config_folder_is_applied_as_a_hugging_face_source(bench, qwen3_folder):
    folder, model = qwen3_folder
    c = Controls(bench)
    assert c.picker.widget.children[0].layout.display == "none"  # a preset: no folder to type
    c.model.value = HF_FOLDER
    assert c.picker.widget.children[0].layout.display == "flex"
    c.picker.folder.value = str(folder)
    assert c.error is None and c.config == wb.Config(model=wb.HFModel(folder), dp=2)
    assert _applied(c, bench).model == wb.HFModel(folder)
    # The model's own count: transformers' class, real tensors, each counted once.
    assert _shown(c) == ("qwen3", sum(p.numel() for p in model.parameters()))
    assert "4 blocks" in c.picker.facts.value and "✗ ep: a dense model" in c.picker.facts.value
    assert "✓ tp" in c.picker.facts.value and "✓ pp" in c.picker.facts.value and "✓ cp" in c.picker.facts.value


def test_its_weights_come_with_it_when_asked(bench, qwen3_folder):
    folder, _ = qwen3_folder
    c = Controls(bench)
    c.model.value = HF_FOLDER
    c.picker.folder.value = str(folder)
    c.picker.weights.value = True
    assert c.config.model == wb.HFModel(folder, weights=folder)
    assert _applied(c, bench).model.weights == str(folder.resolve())
    assert _shown(c)[0] == f"qwen3 ({folder.name})"


def test_a_factory_with_its_plan_is_applied_as_a_custom_source(bench):
    c = Controls(bench)
    c.model.value = FACTORY
    assert c.config is None and c.error.startswith("model.factory")  # nothing typed yet
    with c.model.hold_trait_notifications():
        c.picker.factory.value = GPT
        c.picker.plan.value = json.dumps(PLAN)
        c.picker.arguments.value = '{"dim": 64, "layers": 2}'
        c.dp.value, c.tp.value = 1, 2
    c.validate()
    source = wb.CustomModel(GPT, plan=PLAN, dim=64, layers=2)
    assert c.error is None and c.config == wb.Config(model=source, tp=2)
    assert _applied(c, bench).model == source
    assert _shown(c) == (GPT, sum(p.numel() for p in tiny_gpt(dim=64, layers=2).parameters()))
    assert "2 blocks" in c.picker.facts.value and "✓ tp" in c.picker.facts.value


def test_without_its_plan_tensor_parallel_is_refused_and_the_picker_says_why(bench):
    c = Controls(bench)
    with c.model.hold_trait_notifications():
        c.model.value = FACTORY
        c.picker.factory.value = GPT
        c.dp.value, c.tp.value = 1, 2
    c.validate()
    assert c.config is None and c.error.startswith("tp: ") and "no tensor-parallel plan" in c.message.value
    assert "✗ tp: " in c.picker.facts.value and "no tensor-parallel plan" in c.picker.facts.value
    assert c.apply() is None and bench.session.applied == []


@pytest.mark.parametrize("entry, inputs, message", [
    (HF_FOLDER, {"folder": "/no/such/folder"}, "model.config: config folder '/no/such/folder' does not exist"),
    (HF_FOLDER, {"folder": ""}, "model.config: no folder given"),
    (FACTORY, {"factory": "tests.models.custom_models.tiny_gpt"}, "model.factory: expected 'package.module:callable'"),
    (FACTORY, {"factory": "tests.models.custom_models:nowhere"}, "model: .*has no callable 'nowhere'"),
    (FACTORY, {"factory": "no_such_package.models:build"}, "model: .*cannot import 'no_such_package.models'"),
    (FACTORY, {"factory": GPT, "plan": "{h.*.attn.q: colwise}"}, "model.plan: not JSON"),
    (FACTORY, {"factory": GPT, "arguments": "[64]"}, "model.kwargs: expected a JSON object"),
    (FACTORY, {"factory": "tests.models.custom_models:no_blocks"}, "model: .*could not find its blocks"),
])
def test_a_bad_folder_or_factory_is_refused_inline_and_touches_no_rank(bench, entry, inputs, message):
    c = Controls(bench)
    with c.model.hold_trait_notifications():
        c.model.value = entry
        for name, value in inputs.items():
            getattr(c.picker, name).value = value
    c.validate()
    assert c.config is None and re.match(message, c.error), c.error
    assert "✗" in c.message.value and c.apply_button.disabled
    assert c.apply() is None
    c.wait(5)
    assert bench.session.applied == [] and bench.config is None


def test_a_folder_without_weights_is_refused_when_they_are_asked_for(bench, tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(**QWEN3).save_pretrained(tmp_path)  # config.json alone
    c = Controls(bench)
    with c.model.hold_trait_notifications():
        c.model.value = HF_FOLDER
        c.picker.folder.value = str(tmp_path)
        c.picker.weights.value = True
    c.validate()
    assert c.config is None and "model.weights" in c.error and "holds no .safetensors file" in c.error
    assert bench.session.applied == []


def test_a_config_shown_with_another_model_gets_its_entry_and_back(bench):
    from transformers import Qwen3Config

    qwen = wb.HFModel(Qwen3Config(**QWEN3))
    c = Controls(bench)
    c.set_config(wb.Config(model=qwen, dp=2, seq_len=32))
    assert c.model.value == "current (qwen3)" and c.config == wb.Config(model=qwen, dp=2, seq_len=32)
    assert c.top_k.disabled and c.capacity_factor.disabled  # the built-in model's routing: not this model's
    assert _shown(c)[0] == "qwen3"
    c.model.value = "tiny"
    assert c.config == wb.Config(dp=2, seq_len=32) and _shown(c)[0] == "tiny"
    assert "✗ ep: a dense model" in c.picker.facts.value


def test_the_facts_are_the_model_layers_own(bench):
    """What the picker shows is `describe_model`'s, as it is (the UI counts nothing), and it is the model's count."""
    from workbench.models.transformer import build_model

    c = Controls(bench)
    c.model.value = "tiny-moe"
    facts = bench.describe_model(wb.ModelConfig.preset("tiny-moe"))
    own = sum(p.numel() for p in build_model(wb.ModelConfig.preset("tiny-moe"), 0).parameters())
    assert _shown(c) == ("tiny-moe", facts.params) and facts.params == own
    assert facts.support["cp"] and f"✗ cp: {facts.support['cp']}" in c.picker.facts.value
    assert "✓ ep" in c.picker.facts.value


def test_the_dashboard_draws_a_model_chosen_in_the_picker(bench, qwen3_folder):
    """Applied and trained from the dashboard, a Hugging Face model fills the plots like the built-in one; the experts'
    panels say why they have nothing (its router is its own), rather than fail."""
    from tests.ui.test_dashboard import _until
    from workbench.ui.dashboard import dashboard

    d = dashboard(bench)
    try:
        d.controls.model.value = HF_FOLDER
        d.controls.picker.folder.value = str(qwen3_folder[0])
        d.controls.apply_button.click()
        d.controls.wait(10)
        d.controls.steps.value = 5
        d.controls.train_button.click()
        d.controls.wait(10)
        loss = d.plots.figures["loss"]
        _until(lambda: loss.data[0].x is not None and len(loss.data[0].x) == 5)
        assert d.plots.refresh(force=True)
        assert "expert_load" in d.plots.absent and "the experts' load is measured in the built-in" in \
            d.plots.absent["expert_load"]
    finally:
        d.close()


def test_a_factory_chosen_in_the_picker_trains_and_its_traced_estimate_is_drawn_beside_the_measurement(bench, tmp_path):
    """A module of one's own is estimated from its trace like any other model: the dashboard's predicted-beside-
    measured table and the report have its prediction, and everything else draws."""
    from tests.ui.test_dashboard import _until
    from workbench.ui.dashboard import dashboard

    d = dashboard(bench)
    try:
        d.controls.model.value = FACTORY
        d.controls.picker.factory.value = GPT
        d.controls.apply_button.click()
        d.controls.wait(10)
        assert bench.config.model == wb.CustomModel(GPT)
        d.controls.steps.value = 3
        d.controls.train_button.click()
        d.controls.wait(10)
        _until(lambda: "<table>" in d.predicted.value)
        assert "No prediction" not in d.predicted.value and "memory: activations" in d.predicted.value
        assert "expert_load" in d.plots.absent
    finally:
        d.close()
    report = bench.report(tmp_path / "run.html").read_text()
    assert "Predicted beside measured" in report and "No prediction" not in report
