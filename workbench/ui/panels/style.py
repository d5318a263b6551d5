"""What every panel shares: sizes, colours, and the few layout helpers that make an empty panel say why."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.telemetry.events import MEMORY_CATEGORIES

MEMORY_COLORS = dict(zip(MEMORY_CATEGORIES, ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#BAB0AC")))
COMPUTE_COLORS = {"forward": "#4C78A8", "backward": "#72B7B2", "optimizer": "#54A24B", "F": "#4C78A8", "B": "#72B7B2",
                  "I": "#9ECAE9", "W": "#B07AA1"}  # pipeline actions: the split backward's input and weight halves
COMM_COLORS = {"all_reduce": "#E45756", "all_gather": "#F58518", "reduce_scatter": "#B279A2", "all_to_all": "#FF9DA6",
               "broadcast": "#9D755D", "send": "#EECA3B", "recv": "#EECA3B"}
RANK_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D")
HEIGHT = 300
WIDTH = 560
"""Fixed: a FigureWidget sizes itself once, when first drawn, and a container that was hidden or narrower
then (a collapsed output, a cell scrolled out of view) would leave it at plotly's default 700 px."""

def base_layout(fig: go.Figure, title: str) -> None:
    # uirevision: keep the user's zoom across redraws.
    fig.update_layout(template="plotly_white", height=HEIGHT, width=WIDTH,
                      title=dict(text=title, font=dict(size=14), x=0.01), margin=dict(l=60, r=20, t=58, b=40),
                      legend=dict(orientation="h", y=-0.2, font=dict(size=11)), uirevision="keep")


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
