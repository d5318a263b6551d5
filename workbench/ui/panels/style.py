"""What every panel shares: sizes, colours, and the few layout helpers that make an empty panel say why."""

from __future__ import annotations

import functools

import plotly.graph_objects as go
import plotly.io as pio

from workbench.telemetry.events import MEMORY_CATEGORIES
from workbench.telemetry.runs import RunRecord, Snapshot

MEMORY_COLORS = dict(zip(MEMORY_CATEGORIES, ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#BAB0AC")))
COMPUTE_COLORS = {"forward": "#4C78A8", "backward": "#72B7B2", "optimizer": "#54A24B", "F": "#4C78A8", "B": "#72B7B2",
                  "I": "#9ECAE9", "W": "#B07AA1"}  # pipeline actions: the split backward's input and weight halves
COMM_COLORS = {"all_reduce": "#E45756", "all_gather": "#F58518", "reduce_scatter": "#B279A2", "all_to_all": "#FF9DA6",
               "broadcast": "#9D755D", "send": "#EECA3B", "recv": "#EECA3B"}
RANK_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D")
CURRENT_COLOR = "#4C78A8"
"""The current run's history, on every plot that overlays runs."""
COMPARED_COLORS = ("#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#9D755D")
COMPARED_SLOTS = len(COMPARED_COLORS)
"""Runs a plot overlays beside the current history: fixed traces, set up once (a FigureWidget's traces are
cheapest to keep, and no run's colour changes as others come and go)."""
HEIGHT = 330
"""Heights are fixed; widths follow the dashboard's column (workbench.ui.figure.LiveFigure)."""

@functools.cache
def template() -> go.layout.Template:
    """plotly_white's layout only: a full template styles every trace type, and validating it costs ~50 ms per
    figure (most of a dashboard's start)."""
    return go.layout.Template(layout=pio.templates["plotly_white"].layout)


def new_figure(cls: type = go.Figure) -> go.Figure:
    """An empty figure of `cls` (a go.Figure or a FigureWidget) in the panels' template."""
    return cls(layout=dict(template=template()))


def base_layout(fig: go.Figure, title: str) -> None:
    # uirevision: keep the user's zoom across redraws. The legend sits at the foot of the figure, under the x
    # axis's title (in the container's coordinates, so it never lands on the axis whatever the plot's height).
    fig.update_layout(height=HEIGHT, autosize=True,
                      title=dict(text=title, font=dict(size=14), x=0.01), margin=dict(l=60, r=20, t=58, b=84),
                      legend=dict(orientation="h", yref="container", y=0.0, yanchor="bottom", x=0, font=dict(size=11)),
                      uirevision="keep")
    fig.update_xaxes(title_standoff=4)


def note(text: str | None, y: float = 0.5) -> list[dict]:
    """A grey centred line saying what is missing; [] when nothing is."""
    if not text:
        return []
    return [dict(text=text, xref="paper", yref="paper", x=0.5, y=y, showarrow=False,
                 font=dict(color="#888", size=13))]


def axes_visible(fig: go.Figure, visible: bool) -> None:
    """Empty axes only show made-up ranges (e.g. -1 B to 4 B): hide them while a panel has no data."""
    fig.update_xaxes(visible=visible)
    fig.update_yaxes(visible=visible)


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def name_color(name: str, palette: dict[str, str], fallback: tuple[str, ...]) -> str:
    base = name.split(":")[-1]
    if base in palette:
        return palette[base]
    return fallback[sum(map(ord, base)) % len(fallback)]  # stable across runs, unlike hash()


def compared_runs(snap: Snapshot) -> tuple[RunRecord, ...]:
    """The picked runs a plot draws beside the current history: the newest, as many as it has trace slots."""
    return snap.picked[-COMPARED_SLOTS:]


def compared_color(slot: int) -> str:
    return COMPARED_COLORS[slot % len(COMPARED_COLORS)]


def layout_markers(changes, steps_span: int) -> tuple[list[dict], list[dict]]:
    """Dotted lines where layouts took effect, and their labels; labels of changes closer than a few percent of
    the steps shown are joined ("dp2 → tp2") so that none is printed over another."""
    gap = max(1.0, 0.04 * steps_span)
    groups: list[list] = []
    for change in changes:
        if groups and change.step - groups[-1][-1].step < gap:
            groups[-1].append(change)
        else:
            groups.append([change])
    lines = [dict(type="line", x0=c.step - 0.5, x1=c.step - 0.5, y0=0, y1=1, yref="paper",
                  line=dict(color="#888", dash="dot", width=1)) for c in changes]
    labels = [dict(text=" → ".join(c.layout for c in group), x=group[0].step - 0.5, y=1, xref="x", yref="paper",
                   showarrow=False, textangle=-90, xanchor="left", yanchor="top", font=dict(size=11, color="#555"))
              for group in groups]
    return lines, labels


def recovery_markers(recoveries) -> tuple[list[dict], list[dict]]:
    """Dashed red lines where a run recovered by itself (`train(recover=True)`): at the step it went back to, with
    how many steps it trained again and why (the label's hover text)."""
    lines = [dict(type="line", x0=r.step - 0.5, x1=r.step - 0.5, y0=0, y1=1, yref="paper",
                  line=dict(color="#E45756", dash="dash", width=1)) for r in recoveries]
    labels = [dict(text=f"recovered · {r.replayed} replayed", x=r.step - 0.5, y=0, xref="x", yref="paper",
                   showarrow=False, textangle=-90, xanchor="right", yanchor="bottom",
                   font=dict(size=11, color="#E45756"),
                   hovertext=f"{r.reason}<br>back to step {r.step} in {r.seconds:.1f} s") for r in recoveries]
    return lines, labels
