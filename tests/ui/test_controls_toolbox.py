"""The toolbox's rows of the controls table (optimizer, torch.compile, CUDA Graphs, fp8): each maps to its Config
field and explains itself, and what the ranks' device cannot run is refused inline with Config's own message."""

from __future__ import annotations

import pytest

import workbench as wb
from tests.ui.fakes import fake_workbench
from workbench.config import COMPILE_HELP, CUDA_GRAPHS_HELP, OPTIMIZER_HELP, ConfigError
from workbench.ui.controls import Controls


@pytest.fixture
def controls():
    return Controls(fake_workbench(world_size=2))  # a CPU: no fp8, no CUDA Graphs


def test_optimizer_and_compile_map_to_the_config_and_explain_themselves(controls):
    c = controls
    assert c.optimizer.options == ("adamw", "lion", "sgd") and c.optimizer.value == "adamw"
    assert "Lion" not in c.explain.value and COMPILE_HELP[:40] not in c.explain.value
    c.optimizer.value, c.compile.value, c.lr.value = "lion", True, 1e-4
    assert c.config == wb.Config(dp=2, optimizer="lion", compile=True, lr=1e-4) and c.error is None
    assert OPTIMIZER_HELP["lion"][:40] in c.explain.value and COMPILE_HELP[:40] in c.explain.value
    c.set_config(wb.Config(dp=2, optimizer="sgd"))
    assert (c.optimizer.value, c.compile.value) == ("sgd", False) and COMPILE_HELP[:40] not in c.explain.value


def test_cuda_graphs_applies_only_with_compile_and_is_refused_on_a_cpu(controls):
    c = controls
    assert c.cuda_graphs.disabled  # compile is off: the input does not apply
    c.compile.value = True
    assert not c.cuda_graphs.disabled
    c.cuda_graphs.value = True
    with pytest.raises(ConfigError) as refused:
        wb.Config(dp=2, compile=True, cuda_graphs=True).check_device("cpu", cuda=False)
    assert c.config is None and c.apply_button.disabled and c.error == str(refused.value)
    assert c.error.startswith("cuda_graphs") and CUDA_GRAPHS_HELP[:30] in c.explain.value
    c.compile.value = False  # greyed out again, and its field left as the shown Config has it: valid
    assert c.cuda_graphs.disabled and c.config == wb.Config(dp=2) and c.error is None


@pytest.mark.parametrize("precision", ["fp8_tensorwise", "fp8_rowwise"])
def test_fp8_is_offered_and_refused_where_the_device_has_no_fp8(controls, precision):
    c = controls
    assert precision in c.precision.options
    c.precision.value = precision
    assert c.config is None and c.error.startswith("precision") and "fp8 matrix units" in c.error
    assert c.apply() is None and c.bench.session.applied == []  # never sent to the ranks
