"""Loss (with the layout changes marked), tokens/s and step time, each with the runs picked for comparison."""

from __future__ import annotations

import html

import plotly.graph_objects as go

from workbench.telemetry.events import StepMetrics
from workbench.telemetry.runs import Snapshot
from workbench.ui.panels.style import (
    COMPARED_SLOTS,
    CURRENT_COLOR,
    axes_visible,
    base_layout,
    compared_color,
    compared_runs,
    layout_markers,
    note,
    recovery_markers,
)


def _history_name(snap: Snapshot) -> str:
    current = snap.current
    return f"now: {current.name}" if current is not None else "now"


def _set_line(trace, steps: tuple[StepMetrics, ...] | list[StepMetrics], value, name: str | None = None,
              legend: bool = True) -> None:
    trace.x, trace.y = [m.step for m in steps], [value(m) for m in steps]
    trace.customdata = [m.layout for m in steps]
    if name is not None:
        trace.name = name
    trace.showlegend = legend and bool(steps)


def setup_loss(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Loss per step")
    fig.add_scatter(name="now", mode="lines+markers", marker=dict(size=4), line=dict(color=CURRENT_COLOR))
    fig.add_scatter(name="skipped step", mode="markers", marker=dict(symbol="x", size=9, color="#E45756"),
                    showlegend=False)
    for slot in range(COMPARED_SLOTS):
        fig.add_scatter(mode="lines", line=dict(color=compared_color(slot), width=1.5), showlegend=False)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss")


def draw_loss(fig: go.Figure, snap: Snapshot) -> None:
    steps = snap.steps(0)
    loss, skipped, slots = fig.data[0], fig.data[1], fig.data[2:]
    _set_line(loss, steps, lambda m: m.loss, _history_name(snap))
    loss.hovertemplate = "step %{x}<br>loss %{y:.4f}<br>%{customdata}<extra></extra>"
    skipped.x = [m.step for m in steps if m.skipped]
    skipped.y = [m.loss for m in steps if m.skipped]
    skipped.customdata = [m.skip_reason for m in steps if m.skipped]
    skipped.hovertemplate = "step %{x} skipped: %{customdata}<extra></extra>"
    skipped.showlegend = bool(skipped.x)
    compared = compared_runs(snap)
    for slot, trace in enumerate(slots):
        run = compared[slot] if slot < len(compared) else None
        _set_line(trace, run.steps(0) if run else (), lambda m: m.loss, run.name if run else "")
        trace.hovertemplate = f"{html.escape(run.name) if run else ''}<br>step %{{x}}<br>loss %{{y:.4f}}<extra></extra>"
    shown = [m.step for m in steps] + [m.step for r in compared for m in r.steps(0)]
    span = (max(shown) - min(shown)) if shown else 0
    # A layout change takes effect at its step: the marker sits just before it.
    lines, labels = layout_markers(snap.layout_changes, span)
    in_history = {run.id for run in snap.lineage}
    recovered_lines, recovered_labels = recovery_markers([r for r in snap.recoveries if r.run in in_history])
    fig.layout.shapes = lines + recovered_lines
    fig.layout.annotations = (labels + recovered_labels
                              + note(None if steps or compared else "no steps yet: Apply a layout, then Train"))
    axes_visible(fig, bool(steps or compared))


# -- throughput and step time -------------------------------------------------------------------------
def setup_throughput(fig: go.Figure, world_size: int) -> None:
    base_layout(fig, "Throughput and step time")
    fig.add_scatter(name="now", mode="lines", line=dict(color=CURRENT_COLOR))
    for slot in range(COMPARED_SLOTS):
        fig.add_scatter(mode="lines", line=dict(color=compared_color(slot), width=1.5), showlegend=False)
    fig.add_scatter(mode="lines", yaxis="y2", line=dict(color=CURRENT_COLOR), showlegend=False)
    for slot in range(COMPARED_SLOTS):
        fig.add_scatter(mode="lines", yaxis="y2", line=dict(color=compared_color(slot), width=1.5),
                        showlegend=False)
    # Two rows on one step axis: tokens/s of the whole pool above, one step's wall time (rank 0) below.
    fig.update_layout(yaxis=dict(title="tokens/s", rangemode="tozero", domain=[0.55, 1], tickformat=".3s"),
                      yaxis2=dict(title="ms/step", rangemode="tozero", domain=[0, 0.42], anchor="x"),
                      xaxis=dict(title=dict(text="step", standoff=4), anchor="y2"))


def _mfu_line(latest: dict[int, StepMetrics]) -> str:
    measured = {r: m for r, m in sorted(latest.items()) if m.mfu is not None}
    if not measured:
        return "MFU: not reported yet (needs FLOP counts and the device's peak)"
    basis = next(iter(measured.values())).mfu_basis or "the device's peak"
    per_rank = ", ".join(f"rank {r} {m.mfu:.1%}" for r, m in measured.items())
    return f"MFU {per_rank} — of {basis}"


def draw_throughput(fig: go.Figure, snap: Snapshot) -> None:
    steps = snap.steps(0)
    n = 1 + COMPARED_SLOTS
    tokens, times = fig.data[:n], fig.data[n:]
    compared = compared_runs(snap)
    runs: list[tuple[str, tuple[StepMetrics, ...]]] = [(_history_name(snap), steps)]
    runs += [(r.name, r.steps(0)) for r in compared]
    for i, (tok, t) in enumerate(zip(tokens, times)):
        name, ms = runs[i] if i < len(runs) else ("", ())
        _set_line(tok, ms, lambda m: m.tokens_per_s, name)
        _set_line(t, ms, lambda m: m.step_time_s * 1e3, name, legend=False)  # one entry per run: tokens/s's
        tok.hovertemplate = "%{fullData.name}<br>step %{x}: %{y:,.0f} tokens/s<br>%{customdata}<extra></extra>"
        t.hovertemplate = "%{fullData.name}<br>step %{x}: %{y:.1f} ms<br>%{customdata}<extra></extra>"
    axes_visible(fig, bool(steps or compared))
    if not steps:
        fig.layout.title.text = "Throughput and step time"
        fig.layout.annotations = note(None if compared else "no steps yet")
        return
    fig.layout.title.text = ("Throughput and step time<br><sup>"
                             f"{html.escape(_mfu_line(snap.common_latest()))}</sup>")
    fig.layout.annotations = []
