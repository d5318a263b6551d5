"""The dashboard's panels: each draws telemetry and computes nothing.

A panel is a pair of functions, one module per subject: `setup(fig, world_size)`
makes the traces once, `draw(fig, snapshot)` sets their data from a `Snapshot`
of the store. The same pairs fill the notebook's FigureWidgets
(`workbench.ui.live.LivePlots`) and the static figures of an HTML report
(`static_figures`). A field the telemetry has not delivered yet (memory,
intervals, MFU, overlap) is shown as a note saying so, never as a made-up number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import plotly.graph_objects as go

from workbench.telemetry.store import Snapshot
from workbench.ui.panels.communication import draw_sync_bytes, setup_sync_bytes
from workbench.ui.panels.experts import draw_expert_load, draw_routing, setup_expert_load, setup_routing
from workbench.ui.panels.memory import draw_memory, setup_memory
from workbench.ui.panels.pipeline import draw_pipeline, pipeline_intervals, setup_pipeline
from workbench.ui.panels.timeline import draw_overlap, draw_timeline, setup_overlap, setup_timeline
from workbench.ui.panels.training import draw_loss, draw_throughput, setup_loss, setup_throughput

__all__ = ["PANELS", "Panel", "pipeline_intervals", "static_figures"]


@dataclass(frozen=True)
class Panel:
    name: str
    setup: Callable[[go.Figure, int], None]
    draw: Callable[[go.Figure, Snapshot], None]


PANELS: tuple[Panel, ...] = (
    Panel("loss", setup_loss, draw_loss),
    Panel("throughput", setup_throughput, draw_throughput),
    Panel("memory", setup_memory, draw_memory),
    Panel("timeline", setup_timeline, draw_timeline),
    Panel("overlap", setup_overlap, draw_overlap),
    Panel("pipeline", setup_pipeline, draw_pipeline),
    Panel("sync_bytes", setup_sync_bytes, draw_sync_bytes),
    Panel("expert_load", setup_expert_load, draw_expert_load),
    Panel("routing", setup_routing, draw_routing),
)


def static_figures(snap: Snapshot, world_size: int) -> dict[str, go.Figure]:
    """Plain plotly figures of a snapshot (for reports and for looking at without widgets)."""
    figures = {}
    for panel in PANELS:
        fig = go.Figure()
        panel.setup(fig, world_size)
        panel.draw(fig, snap)
        figures[panel.name] = fig
    return figures
