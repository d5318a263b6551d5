"""The latest step's compute, waits and collectives per rank, and the overlap ratio over steps."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.schedules import Action
from workbench.telemetry.events import Interval, StepMetrics
from workbench.telemetry.store import Snapshot
from workbench.ui.panels.style import (
    COMM_COLORS,
    COMPUTE_COLORS,
    RANK_COLORS,
    axes_visible,
    base_layout,
    name_color,
    note,
    rank_color,
)


TIMELINE_KINDS = ("compute", "wait", "comm")
WAIT_COLOR = "#BAB0AC"


def _actions(metrics: StepMetrics) -> dict[tuple[int, int], Action]:
    """The pipeline actions a rank reported, by their (start_ns, end_ns): the compute spans they timed."""
    return {(start, end): Action(stage, kind, mb) for stage, mb, kind, start, end in metrics.pipeline_actions}


def setup_timeline(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Timeline of the latest step")
    for kind in TIMELINE_KINDS:
        fig.add_bar(name=kind, orientation="h", showlegend=False, textposition="inside", insidetextanchor="middle",
                    textangle=0, marker_line=dict(width=1, color="white"))
    # Labels that do not fit a short bar are hidden rather than shrunk to nothing (hover still names it).
    fig.update_layout(barmode="overlay", bargap=0.25, uniformtext=dict(minsize=9, mode="hide"),
                      xaxis=dict(title="ms from the step's first interval"),
                      yaxis=dict(autorange="reversed", type="category"))


def _bars(trace, items: list[tuple[int, Interval, Action | None]], origin: int) -> None:
    # Ranks on one host share CLOCK_MONOTONIC, so one origin lines their bars up in real time.
    trace.y = [f"rank {r} {iv.kind}" for r, iv, _ in items]
    trace.base = [(iv.start_ns - origin) / 1e6 for _, iv, _ in items]
    trace.x = [(iv.end_ns - iv.start_ns) / 1e6 for _, iv, _ in items]
    trace.marker.color = [_interval_color(iv, a) for _, iv, a in items]
    trace.text = [_label(iv, a) for _, iv, a in items]
    trace.customdata = [[iv.name, iv.bytes, iv.group] for _, iv, _ in items]
    trace.hovertemplate = ("%{customdata[0]}<br>%{base:.3f} ms + %{x:.3f} ms<br>%{customdata[1]:.3s}B "
                           "%{customdata[2]}<extra>%{y}</extra>")


def _label(iv: Interval, action: Action | None) -> str:
    return f"{action.kind}{action.microbatch}" if action is not None else iv.name


def _interval_color(iv: Interval, action: Action | None) -> str:
    if iv.kind == "wait":
        return WAIT_COLOR
    if action is not None:
        return COMPUTE_COLORS[action.kind]
    return name_color(iv.name, COMM_COLORS if iv.kind == "comm" else COMPUTE_COLORS, RANK_COLORS)


def draw_timeline(fig: go.Figure, snap: Snapshot) -> None:
    latest = snap.common_latest()
    origin = min((iv.start_ns for m in latest.values() for iv in m.intervals), default=0)
    items = []
    for r in sorted(latest):
        actions = _actions(latest[r])
        items += [(r, iv, actions.get((iv.start_ns, iv.end_ns)) if iv.kind == "compute" else None)
                  for iv in latest[r].intervals]
    for kind, trace in zip(TIMELINE_KINDS, fig.data):
        _bars(trace, [item for item in items if item[1].kind == kind], origin)
    present = {iv.kind for _, iv, _ in items}
    fig.layout.yaxis.categoryarray = [f"rank {r} {kind}" for r in sorted(latest) for kind in TIMELINE_KINDS
                                      if kind in present]
    axes_visible(fig, bool(items))
    if not items:
        fig.layout.title.text = "Timeline of the latest step"
        fig.layout.annotations = note("no steps yet" if not latest else "timeline: intervals not reported yet")
        return
    step = next(iter(latest.values())).step
    parts = [f"rank {r}: " + (f"{m.overlap:.0%} of comm overlapped, {m.exposed_comm_s * 1e3:.1f} ms exposed"
                              if m.overlap is not None else "no comm") for r, m in sorted(latest.items())]
    fig.layout.title.text = f"Timeline of step {step}<br><sup>{' · '.join(parts)}</sup>"
    fig.layout.annotations = []


# -- overlap over steps ------------------------------------------------------------------------------
def setup_overlap(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Communication hidden behind computation")
    for r in range(world_size):
        fig.add_scatter(name=f"rank {r}", mode="lines", line=dict(color=rank_color(r)))
    fig.update_layout(xaxis=dict(title="step"), yaxis=dict(title="overlap", tickformat=".0%", range=[0, 1.05]))


def draw_overlap(fig: go.Figure, snap: Snapshot) -> None:
    seen = False
    for r, trace in enumerate(fig.data):
        points = [m for m in snap.steps(r) if m.overlap is not None]
        seen |= bool(points)
        trace.x, trace.y = [m.step for m in points], [m.overlap for m in points]
        trace.customdata = [m.exposed_comm_s * 1e3 for m in points]
        trace.hovertemplate = ("step %{x}: %{y:.0%} overlapped, %{customdata:.2f} ms exposed"
                               "<extra>%{fullData.name}</extra>")
    missing = None if seen else ("no steps yet" if not snap.by_rank else "overlap: not reported yet")
    fig.layout.annotations = note(missing)
    axes_visible(fig, seen)
