"""The controls without a browser: inputs → Config, refusals explained inline, buttons that return at once."""

from __future__ import annotations

import time

import pytest

import workbench as wb
from tests.ui.fakes import fake_workbench
from workbench.config import PRESETS, RECOMPUTE_HELP, SCHEDULE_HELP, ZERO_HELP, ConfigError
from workbench.ui.controls import Controls


@pytest.fixture
def bench():
    return fake_workbench(world_size=2, step_s=0.02)


def test_starts_from_a_valid_layout_that_fills_the_pool(bench):
    c = Controls(bench)
    assert c.config == wb.Config(dp=2) and c.error is None
    assert not c.apply_button.disabled and "dp2" in c.message.value


def test_every_input_maps_to_its_config_field(bench):
    c = Controls(bench)
    c.model.value = "small"
    c.dp.value, c.pp.value = 1, 2
    c.schedule.value = "interleaved_1f1b"
    c.micro_batches.value = 4
    c.stages_per_rank.value = 3
    c.recompute.value = "full"
    c.precision.value = "bf16"
    c.batch_size.value = 8
    c.seq_len.value = 64
    c.lr.value = 1e-3
    assert c.config == wb.Config(model=PRESETS["small"], pp=2, schedule="interleaved_1f1b", micro_batches=4,
                                 stages_per_rank=3, activation_checkpointing="full", precision="bf16",
                                 batch_size=8, seq_len=64, lr=1e-3)


def test_set_config_shows_a_config_in_the_inputs(bench):
    c = Controls(bench)
    cfg = wb.Config(tp=2, zero=0, precision="bf16", seed=3, weight_decay=0.1,
                    model=wb.ModelConfig(dim=64, n_layers=2, n_heads=2))
    c.set_config(cfg)
    assert c.config == cfg and c.model.value == "current (custom)"


def _refusal(**values) -> str:
    with pytest.raises(ConfigError) as e:
        wb.Config(**values)
    return str(e.value)


@pytest.mark.parametrize("changes, field", [
    (dict(pp=2, dp=1, micro_batches=1), "micro_batches"),   # 1F1B needs ≥ pp micro-batches
    (dict(zero=1, dp=1, tp=2), "zero"),                     # ZeRO shards across dp ranks
    (dict(batch_size=6, micro_batches=4), "batch_size"),
    (dict(seq_len=4096), "seq_len"),
])
def test_refusals_are_the_configs_own_message(bench, changes, field):
    c = Controls(bench)
    with c.model.hold_trait_notifications():
        for name, value in changes.items():
            getattr(c, name).value = value
    c.validate()
    assert c.config is None and c.error == _refusal(**c.values()) and c.error.startswith(field)
    assert c.apply_button.disabled and "✗" in c.message.value and field in c.message.value


def test_a_layout_that_does_not_fill_the_pool_is_refused(bench):
    c = Controls(bench)
    c.tp.value = 2  # dp2·tp2 = 4 ranks on a pool of 2
    assert c.config is None and c.error.startswith("dp·tp·pp") and "2 ranks" in c.error
    assert c.apply_button.disabled


def test_a_precision_the_device_lacks_is_refused(bench):
    c = Controls(bench)  # the fake device has no fp16
    c.precision.value = "fp16"
    assert c.config is None and "fp16 is not supported" in c.error


def test_a_refused_layout_never_reaches_the_ranks(bench):
    c = Controls(bench)
    c.tp.value = 2
    assert c.apply() is None
    c.apply_button.click()
    assert bench.session.applied == [] and bench.config is None


def test_apply_runs_in_the_background_and_the_model_takes_the_layout(bench):
    c = Controls(bench)
    c.zero.value = 1
    thread = c.apply()
    assert thread is not None
    c.wait(5)
    assert bench.session.applied == [wb.Config(dp=2, zero=1)] and bench.config == wb.Config(dp=2, zero=1)
    assert "dp2·zero1" in c.status.value and "applied dp2·zero1" in c.status.value


def test_train_returns_at_once_and_stop_ends_the_run(bench):
    c = Controls(bench)
    c.apply()
    c.wait(5)
    c.steps.value = 500  # 10 s at the fake's pace
    c.train_button.click()
    assert bench.running is not None and "training · step " in c.status.value and "/500" in c.status.value
    # At once: the click returned before the run ended (500 steps take 10 s at the fake's pace).
    assert not bench.running.done
    c.refresh_status()
    assert c.train_button.disabled and c.apply_button.disabled and not c.stop_button.disabled
    time.sleep(0.1)
    c.stop_button.click()
    c.wait(5)
    assert bench.running is None and 0 < len(bench.history) < 500
    assert not c.train_button.disabled and f"trained {len(bench.history)} of 500 steps (stopped)" in c.status.value


def test_train_without_a_model_explains_why(bench):
    c = Controls(bench)
    c.train()
    assert "apply" in c.message.value and c.actions.activity is None


def test_restart_restarts_the_pool_and_rebuilds_the_layout(bench):
    c = Controls(bench)
    c.apply()
    c.wait(5)
    applied = len(bench.session.applied)
    c.restart_button.click()  # nothing trained yet: no question
    c.wait(5)
    assert bench.pool.restarts == 1 and "rebuilt untrained" in c.status.value
    assert len(bench.session.applied) == applied + 1 and bench.session.applied[-1] == bench.config


def test_status_names_ranks_device_backend_health_and_layout(bench):
    c = Controls(bench)
    status = c.status.value
    for part in ("2 ranks", "cpu", "gloo", "healthy", "no model yet"):
        assert part in status
    bench.pool.broken, bench.pool.broken_reason = True, "rank 1 died"
    c.refresh_status()
    assert "broken: rank 1 died" in c.status.value


def test_the_explanation_follows_zero_schedule_and_recompute(bench):
    c = Controls(bench)
    c.zero.value = 3
    assert ZERO_HELP[3] in c.explain.value and SCHEDULE_HELP["1f1b"] not in c.explain.value
    c.dp.value, c.pp.value, c.zero.value, c.micro_batches.value = 1, 2, 0, 2
    c.schedule.value = "gpipe"
    c.recompute.value = "selective"
    assert SCHEDULE_HELP["gpipe"] in c.explain.value and RECOMPUTE_HELP["selective"] in c.explain.value


def test_pipeline_only_inputs_are_disabled_without_a_pipeline(bench):
    c = Controls(bench)
    assert c.schedule.disabled and c.stages_per_rank.disabled
    c.dp.value, c.pp.value = 1, 2
    assert not c.schedule.disabled and c.stages_per_rank.disabled
    c.schedule.value = "interleaved_1f1b"
    assert not c.stages_per_rank.disabled


def test_a_new_model_shape_is_said_to_start_from_step_0(bench):
    c = Controls(bench)
    c.apply()
    c.wait(5)
    assert "applied dp2" in c.status.value and "new model" in c.status.value  # nothing trained yet: a new one
    c.zero.value = 2
    c.apply()
    c.wait(5)
    assert "applied dp2·zero2" in c.status.value and "new model" not in c.status.value  # resharded
    c.model.value = "small"
    c.apply()
    c.wait(5)
    assert "applied dp2·zero2 (a new model, from step 0)" in c.status.value


def test_expert_parallel_and_routing_inputs_map_to_the_config(bench):
    c = Controls(bench)
    assert c.capacity_factor.disabled and c.top_k.disabled  # tiny is dense: no routing to set
    c.model.value = "tiny-moe"
    assert not c.capacity_factor.disabled
    c.ep.value = 2
    c.capacity_factor.value, c.top_k.value, c.aux_loss_coef.value = 0.5, 1, 0.0
    import dataclasses

    model = dataclasses.replace(PRESETS["tiny-moe"], capacity_factor=0.5, top_k=1, aux_loss_coef=0.0)
    assert c.config == wb.Config(model=model, dp=2, ep=2)
    assert "mixture of experts: 4 experts, top-1" in c.explain.value
    c.set_config(wb.Config(model=model, dp=2))
    assert c.model.value == "tiny-moe" and c.ep.value == 1 and c.capacity_factor.value == 0.5


def test_an_expert_parallel_refusal_is_explained_inline(bench):
    c = Controls(bench)
    c.ep.value = 2  # the model is dense
    assert c.config is None and c.apply_button.disabled
    assert "ep: ep=2 splits experts, but the model is dense" in c.message.value


# -- the one table of controls ----------------------------------------------------------------------------
def test_every_row_of_the_table_is_a_config_field_with_a_widget(bench):
    from workbench.ui.fields import CONTROLS, read

    c = Controls(bench)
    cfg = wb.Config(dp=2)
    for control in CONTROLS:
        read(cfg, control.path)  # raises AttributeError for a row naming no Config field
        assert getattr(c, control.name) is c.fields[control.name]
    assert len({control.name for control in CONTROLS}) == len(CONTROLS)


def test_a_control_is_one_row(bench, monkeypatch):
    """A row added to the table appears in the inputs, reaches the Config, is shown by set_config, explains itself."""
    from workbench.ui import controls as controls_module, fields

    row = fields.Control("seed", "training", fields.integer("seed", 0, 1 << 30, 120),
                         help=lambda v: f"seeded with {v.seed}")
    monkeypatch.setattr(controls_module, "CONTROLS", (*fields.CONTROLS, row))
    c = Controls(bench)
    assert c.seed in c.inputs and c.seed in c.lines["training"].children
    c.seed.value = 7
    assert c.config == wb.Config(dp=2, seed=7) and "seeded with 7" in c.explain.value
    c.set_config(wb.Config(dp=2, seed=3))
    assert c.seed.value == 3


def test_fields_without_a_control_are_carried_over(bench):
    c = Controls(bench)
    c.set_config(wb.Config(dp=2, seed=5, weight_decay=0.1, powersgd_rank=4))
    c.zero.value = 1
    assert c.config == wb.Config(dp=2, zero=1, seed=5, weight_decay=0.1, powersgd_rank=4)


def test_an_input_that_does_not_apply_leaves_its_field_as_shown(bench):
    c = Controls(bench)
    c.dp.value, c.pp.value, c.micro_batches.value = 1, 2, 2
    c.schedule.value = "gpipe"
    assert c.config.schedule == "gpipe"
    c.dp.value, c.pp.value = 2, 1  # no pipeline: the schedule is greyed out and not applied
    assert c.schedule.disabled and c.config.schedule == "1f1b"


def test_zero_help_does_not_speak_of_an_all_reduce_without_data_parallel(bench):
    c = Controls(bench)
    assert ZERO_HELP[0] in c.explain.value  # dp2
    c.dp.value, c.tp.value = 1, 2
    assert c.config is not None and ZERO_HELP[0] not in c.explain.value and "dp = 1" in c.explain.value


# -- questions before discarding weights, progress, the file buttons ---------------------------------------
def _trained(bench, steps: int = 3) -> Controls:
    c = Controls(bench)
    c.apply()
    c.wait(5)
    bench.train(steps).wait()
    return c


def test_restart_asks_first_when_weights_were_trained(bench):
    c = _trained(bench)
    c.restart_button.click()
    assert c.confirm.asking and bench.pool.restarts == 0 and "weights trained so far (3 steps)" in c.confirm.question.value
    c.confirm.cancel.click()
    assert not c.confirm.asking and bench.pool.restarts == 0
    c.restart_button.click()
    c.confirm.yes.click()
    c.wait(5)
    assert bench.pool.restarts == 1 and "ranks restarted" in c.status.value


def test_a_new_model_asks_first_and_a_reshard_does_not(bench):
    c = _trained(bench)
    c.zero.value = 1  # a reshard: the trained weights carry over
    c.apply_button.click()
    c.wait(5)
    assert not c.confirm.asking and bench.config.zero == 1
    c.model.value = "small"  # a new shape: a new model
    c.apply_button.click()
    assert c.confirm.asking and "new model" in c.confirm.question.value and bench.config.model.dim == 128
    c.confirm.yes.click()
    c.wait(5)
    assert bench.config.model == PRESETS["small"] and "(a new model, from step 0)" in c.status.value


def test_the_status_line_says_the_phase_and_the_progress(bench):
    c = _trained(bench)
    bench.phase = "resharding"
    c.refresh_status()
    assert "resharding …" in c.status.value
    bench.phase = None
    bench.session.step_s = 0.05
    run = bench.train(40)
    deadline = time.monotonic() + 10
    while len(bench.history) < 3 + 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    c.refresh_status()
    progress = run.progress()
    assert 5 <= progress.done < 40 and progress.eta_s > 0
    assert "training · step " in c.status.value and "/40 · ETA " in c.status.value
    run.stop()


def test_export_and_report_write_where_the_path_says(bench, tmp_path):
    c = _trained(bench)
    c.path.value = str(tmp_path / "launch")
    c.export_button.click()
    c.wait(5)
    assert (tmp_path / "launch" / "config.json").exists() and "exported to" in c.status.value
    c.path.value = str(tmp_path / "page.html")
    c.report_button.click()
    c.wait(120)
    assert (tmp_path / "page.html").exists() and "wrote" in c.status.value


def test_a_failed_file_action_is_said_inline(bench, tmp_path):
    c = _trained(bench)
    c.path.value = str(tmp_path / "nothing-here")
    c.load_button.click()
    c.confirm.yes.click()  # trained weights: it asks first
    c.wait(5)
    assert "✗" in c.message.value and "nothing-here" in c.message.value
