"""The plan panel draws wb.plan's ranking and applies the chosen layout, scaled by plan.scale_layout, locally."""

from __future__ import annotations

import workbench as wb
from tests.ui.fakes import fake_workbench
from workbench.plan import plan, scale_layout
from workbench.ui.dashboard import dashboard
from workbench.ui.plan_panel import APPLIED, PlanPanel


def test_the_panel_shows_the_plans_top_layouts_and_applies_one_scaled_down():
    bench = fake_workbench(world_size=2, step_s=0.01)
    panel = PlanPanel(bench, model="8b", gpus=16, global_batch=64, seq_len=4096, top=5)
    panel.run_plan()
    expected = plan("8b", "h100", 16, 64, seq_len=4096)
    for row in expected.rows(5):
        assert row["layout"].replace("·", "·<wbr>") in panel.table.value
    assert [label for label, _ in panel.choice.options][0].startswith(f"#1 {expected.best.config.layout} · ")
    panel.choice.value = 1
    scaled = scale_layout(expected.top(5)[1].config, 2, wb.Config())
    assert scaled.describe() in panel.scaling.value.replace("&gt;", ">")
    panel.apply()
    assert bench.config == scaled.config and bench.config.world_size == 2
    assert "applied" in panel.status.value


def test_a_bad_input_is_said_inline():
    panel = PlanPanel(fake_workbench(world_size=2), gpus=3, global_batch=64)
    panel.seq_len.value = 100_000  # longer than the model's rotary table: every layout invalid
    panel.run_plan()
    assert "no layout fits" in panel.table.value and panel.apply_button.disabled


def test_the_dashboard_holds_the_panel_and_sends_the_layout_through_its_controls():
    bench = fake_workbench(world_size=2, step_s=0.01)
    d = dashboard(bench)
    try:
        d.planner.gpus.value, d.planner.global_batch.value = 8, 32
        d.planner.run_plan()
        scaled = d.planner.scaled()
        d.planner.apply()
        d.controls.wait(5)
        assert bench.config == scaled.config
    finally:
        d.close()


def test_dropdown_rows_read_apart():
    """Rows sharing a layout string (it omits gradient-accumulation micro-batches) still differ in the dropdown."""
    panel = PlanPanel(fake_workbench(world_size=2), model="125m", gpus=8, global_batch=64, seq_len=2048, top=8)
    panel.run_plan()
    layouts = [row["layout"] for row in panel.plan.rows(8)]
    assert len(set(layouts)) < len(layouts)  # the case this is about
    labels = [label.split(" ", 1)[1] for label, _ in panel.choice.options]  # without the "#i"
    assert len(set(labels)) == len(labels)


def test_the_applied_model_of_ones_own_is_offered_and_planned_by_its_trace():
    """Once a Hugging Face model is applied, the panel offers it beside the presets and plans it (traced): the table
    heads with its own parameter count, and a layout applies scaled down onto the same model."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tests.ui.test_model_picker import QWEN3

    bench = fake_workbench(world_size=2, step_s=0.01)
    panel = PlanPanel(bench, gpus=4, global_batch=8, seq_len=128, top=3)
    assert APPLIED not in [v for _, v in panel.model.options], "nothing but the presets before such an apply"
    source = wb.HFModel(QWEN3 | {"model_type": "qwen3"})
    bench.apply(wb.Config(model=source, dp=2))
    panel.refresh_models()
    assert (f"applied: {source.name}", APPLIED) in panel.model.options
    panel.model.value = APPLIED
    panel.run_plan()
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3)).parameters())
    assert panel.plan.best.estimate.model_params == numel and panel.choice.options
    panel.apply()
    assert bench.config.model == source and "applied" in panel.status.value
    bench.apply(wb.Config(dp=2))
    panel.refresh_models()
    assert panel.model.value == "8b" and APPLIED not in [v for _, v in panel.model.options]
