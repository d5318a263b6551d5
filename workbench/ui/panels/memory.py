"""Memory per rank by category, now and at peak."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.telemetry.store import Snapshot
from workbench.ui.panels.style import MEMORY_CATEGORIES, MEMORY_COLORS, axes_visible, base_layout, note


def setup_memory(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Memory per rank by category")
    for cat in MEMORY_CATEGORIES:
        # "other" is the rest of the process (on CPU the Python and torch runtime, hundreds of MB) and would
        # flatten the categories a layout changes; it starts hidden, one click on its legend entry away.
        fig.add_bar(name=cat, marker_color=MEMORY_COLORS[cat], visible="legendonly" if cat == "other" else True)
    fig.update_layout(barmode="stack", yaxis=dict(title="bytes", tickformat=".2s", ticksuffix="B"))


def draw_memory(fig: go.Figure, snap: Snapshot) -> None:
    latest = snap.common_latest()
    ranks = [r for r in sorted(latest) if latest[r].memory or latest[r].peak_memory]
    # Two bars per rank: the bytes held at the end of the step, and each category's peak during it.
    x = [[f"rank {r}" for r in ranks for _ in (0, 1)], ["end of step", "peak"] * len(ranks)]
    for cat, trace in zip(MEMORY_CATEGORIES, fig.data):
        trace.x = x
        trace.y = [d.get(cat) for r in ranks for d in (latest[r].memory, latest[r].peak_memory)]
        trace.hovertemplate = f"{cat}: %{{y:.3s}}B<extra>%{{x}}</extra>"
    step = next(iter(latest.values())).step if latest else None
    fig.layout.title.text = (f"Memory per rank by category, step {step}<br><sup>'other' (the runtime) starts hidden: "
                             "click it in the legend</sup>" if ranks else "Memory per rank by category")
    missing = None if ranks else ("no steps yet" if not latest else "memory by category: not reported yet")
    fig.layout.annotations = note(missing)
    axes_visible(fig, bool(ranks))
