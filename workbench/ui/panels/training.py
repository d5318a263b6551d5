"""Loss (with the layout changes marked) and throughput/MFU per rank."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.telemetry.store import Snapshot
from workbench.ui.panels.style import axes_visible, base_layout, note, rank_color


def setup_loss(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Loss per step")
    fig.add_scatter(name="loss (global batch)", mode="lines+markers", marker=dict(size=4), line=dict(color="#4C78A8"))
    fig.add_scatter(name="skipped step", mode="markers", marker=dict(symbol="x", size=9, color="#E45756"))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss")


def draw_loss(fig: go.Figure, snap: Snapshot) -> None:
    steps = snap.steps(0)
    loss, skipped = fig.data[0], fig.data[1]
    loss.x, loss.y = [m.step for m in steps], [m.loss for m in steps]
    loss.customdata = [m.layout for m in steps]
    loss.hovertemplate = "step %{x}<br>loss %{y:.4f}<br>%{customdata}<extra></extra>"
    skipped.x = [m.step for m in steps if m.skipped]
    skipped.y = [m.loss for m in steps if m.skipped]
    skipped.customdata = [m.skip_reason for m in steps if m.skipped]
    skipped.hovertemplate = "step %{x} skipped: %{customdata}<extra></extra>"
    # A layout change takes effect at its step: the marker sits just before it.
    fig.layout.shapes = [dict(type="line", x0=c.step - 0.5, x1=c.step - 0.5, y0=0, y1=1, yref="paper",
                              line=dict(color="#888", dash="dot", width=1)) for c in snap.layout_changes]
    labels = [dict(text=c.layout, x=c.step - 0.5, y=1, xref="x", yref="paper", showarrow=False, textangle=-90,
                   xanchor="left", yanchor="top", font=dict(size=11, color="#555")) for c in snap.layout_changes]
    fig.layout.annotations = labels + note(None if steps else "no steps yet: Apply a layout, then Train")
    axes_visible(fig, bool(steps))


# -- throughput and MFU ------------------------------------------------------------------------------
def setup_throughput(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Throughput and MFU")
    fig.add_scatter(name="tokens/s (all ranks)", mode="lines", line=dict(color="#4C78A8"))
    for r in range(world_size):
        fig.add_scatter(name=f"MFU rank {r}", mode="lines", yaxis="y2", line=dict(color=rank_color(r + 1)))
    # Two rows on one step axis: with a fixed model MFU follows tokens/s, and on twin axes the lines would
    # lie on top of each other.
    fig.update_layout(yaxis=dict(title="tokens/s", rangemode="tozero", domain=[0.55, 1]),
                      yaxis2=dict(title="MFU", tickformat=".1%", rangemode="tozero", domain=[0, 0.42], anchor="x"),
                      xaxis=dict(title=dict(text="step", standoff=4), anchor="y2"))


def draw_throughput(fig: go.Figure, snap: Snapshot) -> None:
    steps = snap.steps(0)
    fig.data[0].x, fig.data[0].y = [m.step for m in steps], [m.tokens_per_s for m in steps]
    any_mfu = False
    for r, trace in enumerate(fig.data[1:]):
        with_mfu = [m for m in snap.steps(r) if m.mfu is not None]
        any_mfu |= bool(with_mfu)
        trace.x, trace.y = [m.step for m in with_mfu], [m.mfu for m in with_mfu]
    axes_visible(fig, bool(steps))
    if not steps:
        fig.layout.annotations = note("no steps yet")
    else:  # tokens/s is drawn; the note sits above it
        fig.layout.annotations = note(None if any_mfu else "MFU: not reported yet (needs FLOP counts and the "
                                       "device's peak)", y=0.2)
