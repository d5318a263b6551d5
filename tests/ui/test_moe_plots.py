"""The mixture-of-experts panels: the router's counts as a layer × expert heatmap, the balancing loss beside the
loss, drops per layer and step; all drawn verbatim from the StepMetrics the ranks agreed (tested against a recount
and one process in tests/test_moe_model.py and tests/engine/test_moe.py)."""

from __future__ import annotations

import dataclasses

import workbench as wb
from tests.ui.fakes import step_metrics
from workbench.telemetry.store import TelemetryStore
from workbench.ui.live import LivePlots
from workbench.ui.panels import static_figures

MOE = wb.Config(dp=2, ep=2, model=dataclasses.replace(wb.ModelConfig.preset("tiny-moe"), moe_every=2))
LOADS = [((300, 200, 260, 264), (512, 12, 0, 500)), ((256, 256, 256, 256), (400, 124, 250, 250))]


def _moe_store() -> TelemetryStore:
    store = TelemetryStore()
    store.add_layout_change(0, MOE)
    for step, load in enumerate(LOADS):
        for r in range(2):
            store.add(r, dataclasses.replace(step_metrics(r, step), expert_load=load, tokens_dropped=(step, 7 * step),
                                             aux_loss=0.02 - 0.001 * step))
    return store


def test_expert_load_heatmap_is_the_latest_steps_counts():
    fig = LivePlots(_moe_store(), 2).figures["expert_load"]
    heat = fig.data[0]
    assert [list(row) for row in heat.z] == [list(row) for row in LOADS[-1]]
    assert list(heat.y) == ["layer 1", "layer 3"]  # moe_every=2: blocks 1 and 3
    assert "step 1" in fig.layout.title.text and "[1, 7]" in fig.layout.title.text
    assert not fig.layout.annotations


def test_aux_loss_beside_the_loss_and_drops_per_layer_and_step():
    fig = LivePlots(_moe_store(), 2).figures["routing"]
    loss, aux, dropped = fig.data
    assert list(loss.y) == [5.0, 4.99] and list(aux.y) == [0.02, 0.019]
    assert list(dropped.x) == [0, 1] and [list(r) for r in dropped.z] == [[0, 1], [0, 7]]
    assert list(dropped.y) == ["layer 1", "layer 3"]


def test_a_dense_model_says_it_has_no_experts():
    store = TelemetryStore()
    store.add_layout_change(0, wb.Config(dp=2))
    store.add(0, step_metrics(0, 0))
    figs = static_figures(store.snapshot(), 2)
    for name in ("expert_load", "routing"):
        assert "dense model" in figs[name].layout.annotations[0].text
