"""Bytes the data-parallel gradient sync sent per step per rank (what Config.compression changes)."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.telemetry.runs import Snapshot
from workbench.ui.panels.style import base_layout, note, rank_color


def setup_sync_bytes(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Gradient sync: bytes sent per step per rank")
    for r in range(world_size):
        fig.add_scatter(name=f"rank {r}", mode="lines+markers", marker=dict(size=4), line=dict(color=rank_color(r)))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="bytes sent", rangemode="tozero")


def draw_sync_bytes(fig: go.Figure, snap: Snapshot) -> None:
    """StepMetrics.grad_sync_bytes as measured on each rank; layout changes (e.g. none → int8) marked as on the
    loss plot, so the two plots read side by side."""
    any_sync = False
    for r, trace in enumerate(fig.data):
        steps = snap.steps(r)
        any_sync |= any(m.grad_sync_bytes for m in steps)
        trace.x, trace.y = [m.step for m in steps], [m.grad_sync_bytes for m in steps]
        trace.customdata = [m.layout for m in steps]
        trace.hovertemplate = "step %{x}<br>%{y:,} B<br>%{customdata}<extra></extra>"
    fig.layout.shapes = [dict(type="line", x0=c.step - 0.5, x1=c.step - 0.5, y0=0, y1=1, yref="paper",
                              line=dict(color="#888", dash="dot", width=1)) for c in snap.layout_changes]
    labels = [dict(text=c.layout, x=c.step - 0.5, y=1, xref="x", yref="paper", showarrow=False, textangle=-90,
                   xanchor="left", yanchor="top", font=dict(size=11, color="#555")) for c in snap.layout_changes]
    steps = snap.steps(0)
    fig.layout.annotations = labels + note(None if any_sync else "no data-parallel gradient sync measured yet "
                                            "(needs dp > 1 and telemetry)" if steps else "no steps yet", y=0.5)
