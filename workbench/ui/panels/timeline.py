"""The latest step's compute, waits and collectives per rank (with a legend of what each colour is), the checkpoint
saves and compilations that overlap it on a row of their own, and the overlap ratio over steps."""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.schedules import Action, config_stages
from workbench.telemetry.events import Interval, StepMetrics
from workbench.telemetry.spans import COMPILING, SAVE_BACKGROUND, SAVE_HELD, Span, spans_within
from workbench.telemetry.runs import Snapshot
from workbench.ui.panels.pipeline import action_label
from workbench.ui.panels.style import (
    COMM_COLORS,
    COMPUTE_COLORS,
    axes_visible,
    base_layout,
    note,
    rank_color,
)

SPAN_ROW = "save/compile"
TIMELINE_KINDS = ("compute", "wait", "comm", SPAN_ROW)
WAIT_COLOR = "#BAB0AC"
GROUPS: tuple[tuple[str, str, str], ...] = (
    ("forward", "compute", COMPUTE_COLORS["forward"]),
    ("backward", "compute", COMPUTE_COLORS["backward"]),
    ("optimizer", "compute", COMPUTE_COLORS["optimizer"]),
    ("other compute", "compute", "#D8B5A5"),
    ("waiting on a collective", "wait", WAIT_COLOR),
    ("all_reduce", "comm", COMM_COLORS["all_reduce"]),
    ("all_gather", "comm", COMM_COLORS["all_gather"]),
    ("reduce_scatter", "comm", COMM_COLORS["reduce_scatter"]),
    ("all_to_all", "comm", COMM_COLORS["all_to_all"]),
    ("broadcast", "comm", COMM_COLORS["broadcast"]),
    ("send/recv", "comm", COMM_COLORS["send"]),
    ("other comm", "comm", "#79706E"),
    (COMPILING, SPAN_ROW, "#8CD17D"),
    (SAVE_HELD, SPAN_ROW, "#499894"),
    (SAVE_BACKGROUND, SPAN_ROW, "#A0CBE8"),
)
"""One bar trace per colour, so the legend says what each colour is: (legend name, row kind, colour)."""


def _actions(metrics: StepMetrics) -> dict[tuple[int, int], Action]:
    """The pipeline actions a rank reported, by their (start_ns, end_ns): the compute spans they timed."""
    return {(start, end): Action(stage, kind, mb) for stage, mb, kind, start, end in metrics.pipeline_actions}


def _group(iv: Interval, action: Action | None) -> str:
    if iv.kind == "wait":
        return "waiting on a collective"
    if action is not None:
        return "forward" if action.kind == "F" else "backward"
    base = iv.name.split(":")[-1]
    if iv.kind == "compute":
        return base if base in ("forward", "backward", "optimizer") else "other compute"
    if base in ("send", "recv"):
        return "send/recv"
    return base if base in COMM_COLORS else "other comm"


def setup_timeline(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Timeline of the latest step")
    for name, _kind, color in GROUPS:
        fig.add_bar(name=name, orientation="h", marker_color=color, textposition="inside",
                    insidetextanchor="middle", textangle=0, marker_line=dict(width=1, color="white"),
                    showlegend=False)
    # Labels that do not fit a short bar are hidden rather than shrunk to nothing (hover still names it).
    fig.update_layout(barmode="overlay", bargap=0.25, uniformtext=dict(minsize=9, mode="hide"),
                      xaxis=dict(title="ms from the step's first interval"),
                      yaxis=dict(autorange="reversed", type="category"),
                      legend=dict(font=dict(size=10), traceorder="normal"))


def _bars(trace, items: list[tuple[int, Interval, str]], origin: int) -> None:
    # Ranks on one host share CLOCK_MONOTONIC, so one origin lines their bars up in real time.
    trace.y = [f"rank {r} {iv.kind}" for r, iv, _ in items]
    trace.base = [(iv.start_ns - origin) / 1e6 for _, iv, _ in items]
    trace.x = [(iv.end_ns - iv.start_ns) / 1e6 for _, iv, _ in items]
    trace.text = [label for _, _, label in items]
    trace.customdata = [[iv.name, iv.bytes, iv.group] for _, iv, _ in items]
    trace.hovertemplate = ("%{customdata[0]}<br>%{base:.3f} ms + %{x:.3f} ms<br>%{customdata[1]:.3s}B "
                           "%{customdata[2]}<extra>%{y}</extra>")
    trace.showlegend = bool(items)  # the legend lists what this step has, nothing else


def _span_bars(trace, items: list[Span], origin: int) -> None:
    trace.y = [f"rank {s.rank} {SPAN_ROW}" for s in items]
    trace.base = [(s.start_ns - origin) / 1e6 for s in items]
    trace.x = [(s.end_ns - s.start_ns) / 1e6 for s in items]
    trace.text = [s.kind.split(": ")[-1] for s in items]
    trace.customdata = [[s.kind, s.detail] for s in items]
    trace.hovertemplate = "%{customdata[0]}<br>%{base:.3f} ms + %{x:.3f} ms<br>%{customdata[1]}<extra>%{y}</extra>"
    trace.showlegend = bool(items)


def draw_timeline(fig: go.Figure, snap: Snapshot) -> None:
    latest = snap.common_latest()
    origin = min((iv.start_ns for m in latest.values() for iv in m.intervals), default=0)
    v = config_stages(snap.config) if snap.config is not None else 1
    grouped: dict[str, list[tuple[int, Interval, str]]] = {name: [] for name, _, _ in GROUPS}
    present = set()
    for r in sorted(latest):
        actions = _actions(latest[r])
        for iv in latest[r].intervals:
            action = actions.get((iv.start_ns, iv.end_ns)) if iv.kind == "compute" else None
            label = action_label(action, v) if action is not None else iv.name
            grouped[_group(iv, action)].append((r, iv, label))
            present.add(iv.kind)
    end = max((iv.end_ns for m in latest.values() for iv in m.intervals), default=0)
    spans = spans_within(snap.saves, snap.compilations, origin, end) if present else []
    for (name, kind, _color), trace in zip(GROUPS, fig.data):
        if kind == SPAN_ROW:
            _span_bars(trace, [s for s in spans if s.kind == name], origin)
        else:
            _bars(trace, grouped[name], origin)
    with_spans = {s.rank for s in spans}
    fig.layout.yaxis.categoryarray = [f"rank {r} {kind}" for r in sorted(set(latest) | with_spans)
                                      for kind in TIMELINE_KINDS
                                      if kind in present or (kind == SPAN_ROW and r in with_spans)]
    axes_visible(fig, bool(present))
    if not present:
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
