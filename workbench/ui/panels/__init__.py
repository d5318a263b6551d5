"""The dashboard's panels: each draws telemetry and computes nothing.

A panel is a pair of functions, one module per subject: `setup(fig, world_size)`
makes the traces once, `draw(fig, snapshot)` sets their data from a `Snapshot`
of the store. The same pairs fill the notebook's FigureWidgets
(`workbench.ui.live.LivePlots`) and the static figures of an HTML report
(`static_figures`). A field the telemetry has not delivered yet (memory,
intervals, MFU, overlap) is shown as a note saying so, never as a made-up number.
A panel about something the layout does not have (a pipeline, a gradient sync,
experts) says so in one line instead of drawing (`Panel.absent`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import plotly.graph_objects as go

from workbench.config import ModelConfig
from workbench.telemetry.runs import Snapshot
from workbench.ui.panels.communication import draw_sync_bytes, setup_sync_bytes
from workbench.ui.panels.experts import draw_expert_load, draw_routing, setup_expert_load, setup_routing
from workbench.ui.panels.memory import draw_memory, setup_memory
from workbench.ui.panels.pipeline import draw_pipeline, pipeline_intervals, setup_pipeline
from workbench.ui.panels.style import new_figure
from workbench.ui.panels.timeline import draw_overlap, draw_timeline, setup_overlap, setup_timeline
from workbench.ui.panels.training import draw_loss, draw_throughput, setup_loss, setup_throughput

__all__ = ["PANELS", "Panel", "pipeline_intervals", "static_figures"]


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    setup: Callable[[go.Figure, int], None]
    draw: Callable[[go.Figure, Snapshot], None]
    absent: Callable[[Snapshot], str | None] = lambda snap: None
    """Why the current layout has nothing for this panel to show (one line), or None when it applies."""


def _no_pipeline(snap: Snapshot) -> str | None:
    cfg = snap.config
    if cfg is None:
        return "appears when a layout with pp ≥ 2 is applied"
    return None if cfg.pp > 1 else f"{cfg.layout} has no pipeline (pp = 1)"


def _no_sync(snap: Snapshot) -> str | None:
    cfg = snap.config
    if cfg is None:
        return "appears when a layout with dp ≥ 2 is applied"
    return None if cfg.dp > 1 else f"{cfg.layout} has no data-parallel gradient sync (dp = 1)"


def _no_experts(snap: Snapshot) -> str | None:
    cfg = snap.config
    if cfg is None:
        return "appears when a mixture of experts is applied (model preset \"tiny-moe\")"
    if not isinstance(cfg.model, ModelConfig):  # its router is its own: the ranks measure the built-in one's
        return (f"{cfg.model.name}: the experts' load is measured in the built-in mixture of experts (a ModelConfig "
                "with n_experts, e.g. \"tiny-moe\")")
    return None if cfg.model.n_experts else "dense model: no experts (a ModelConfig with n_experts, e.g. \"tiny-moe\")"


PANELS: tuple[Panel, ...] = (
    Panel("loss", "Loss per step", setup_loss, draw_loss),
    Panel("throughput", "Throughput and step time", setup_throughput, draw_throughput),
    Panel("memory", "Memory per rank by category", setup_memory, draw_memory),
    Panel("timeline", "Timeline of the latest step", setup_timeline, draw_timeline),
    Panel("overlap", "Communication hidden behind computation", setup_overlap, draw_overlap),
    Panel("pipeline", "Pipeline schedule", setup_pipeline, draw_pipeline, _no_pipeline),
    Panel("sync_bytes", "Gradient sync: bytes sent per step", setup_sync_bytes, draw_sync_bytes, _no_sync),
    Panel("expert_load", "Expert load", setup_expert_load, draw_expert_load, _no_experts),
    Panel("routing", "Balancing loss and dropped tokens", setup_routing, draw_routing, _no_experts),
)


def static_figures(snap: Snapshot, world_size: int, applicable_only: bool = False) -> dict[str, go.Figure]:
    """Plain plotly figures of a snapshot (for reports and for looking at without widgets); with
    `applicable_only`, none for the panels the current layout has nothing for."""
    figures = {}
    for panel in PANELS:
        if applicable_only and panel.absent(snap) is not None:
            continue
        fig = new_figure()
        panel.setup(fig, world_size)
        panel.draw(fig, snap)
        figures[panel.name] = fig
    return figures
